"""The node daemon a volunteer runs, and the ``swarmtrain`` command line; one subpackage per
subsystem:

- ``cli``: the ``swarmtrain`` command, one module per subcommand.
- ``daemon``: ``Node``, the lifecycle, and its checkpoints.
- ``placement``: which stage a node holds.
- ``pipeline``: stage servers, calls between stages, the trainer.
- ``averaging``: averaging among a stage's peers, state download.
- ``measure``: compute and bandwidth.
- ``rpc``: transport, DHT, gossip, the membership gate, hivemind compatibility.
- ``harness``: local node processes for the demo, tests and benchmarks.
- ``files``: atomic writes and the identity key file; ``events``: the structured event log.
- ``limits``: the bandwidth and memory a volunteer lets the node take, and the bytes it
  moves by purpose.
"""
