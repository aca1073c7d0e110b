"""Which stage a node holds: the node's driver (``driver``) of the placement rules in
``protocol.assignment``, over the run's gossip topic."""
