"""The node's transport on hivemind's P2P: the RPC service base (``service``: attach, ban,
capped frames), the run's DHT (``dht``), GossipSub (``gossip``), the
membership gate (``membership``), dial-backs that tell a node whether peers can reach it
(``reach``), child processes that die with the node (``child_process``),
and every patch of hivemind internals (``hivemind_compat``)."""
