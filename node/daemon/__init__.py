"""The node daemon: ``node.Node`` (join, measure, announce, take stages, serve, leave) and
its checkpoints on disk (``checkpoint``)."""
