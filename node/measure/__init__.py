"""What a node measures of itself: per-stage throughput on its device (``capacity``) and its
link speed to a peer (``bandwidth``)."""
