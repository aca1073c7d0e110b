"""The node daemon: one volunteer's node in one run, from start to stop.

- ``node``: ``Node``, the composition root: it owns the node's parts and resources,
  starts them in order, runs their tasks in one ``asyncio.TaskGroup`` and closes them in
  reverse order.
- ``settings``: ``NodeSettings``, what a person sets, and the paths derived from it.
- ``start``: before serving: the run joined, the invite shown, the machine examined, how
  long each step took.
- ``join``: joining a run (shared with the other commands that join one).
- ``reachability``: whether peers can dial the node, and the relay it serves through
  (``relay_keeper`` keeps that relay).
- ``offer``: the throughput and bandwidth it announces, within the volunteer's limits.
- ``stages``: the stages it holds, and their lifecycle (take, load, move, release).
- ``checkpointing``: checkpoints of the held stages, on a period and on stop
  (``checkpoint``: their format on disk).
- ``training``: the trainer loop.
- ``publishing``: what it keeps published in the DHT (its record, the spec, the run
  directory entry) and its membership against revocations.
- ``watch``: reads of the run's peers, who joins and leaves, the heartbeat.
- ``archive``: an archive node, which keeps every stage instead of serving one.
"""
