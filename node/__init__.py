"""The node daemon a volunteer runs, and the ``swarmtrain`` command line.

- ``cli``: the ``swarmtrain`` console script, its parser in ``cli_args`` (light: no torch);
  ``serve``, ``status``, ``train``, ``demo``, ``baseline``, ``whoami`` (``id``): its
  subcommands; ``maddrs``: checks of the addresses a person types. ``progress`` and
  ``plot``: what a person sees.
- ``daemon``: ``Node``, the lifecycle: join, measure, announce, take a stage, serve, leave.
- ``placement``: the node's stage at join and its rebalancing moves, over the run's gossip
  topic (``gossip``: GossipSub through the node's own ``p2pd``).
- ``dht``: ``SwarmDHT``, hivemind's DHT behind a small surface; every record read is checked.
- ``capacity``: device choice and per-stage throughput; ``bandwidth``: link speed to a peer.
- ``files``: atomic writes and the identity key file.
- ``servicer``: the base of the node's RPC services; ``stage_server``, ``stage_client``,
  ``stage_wire``: one pipeline stage served over hivemind P2P streams, and its calls.
- ``stage_averaging``, ``averaging_process``, ``stage_state``: averaging among a stage's
  peers and state download for joiners.
- ``trainer``: stochastic wiring of micro-batches through the stages, with retries.
- ``local_swarm``: node processes on 127.0.0.1 for the demo, tests and benchmarks.
"""
