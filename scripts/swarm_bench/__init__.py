"""Pieces of ``scripts/bench_swarm.py``.

- ``worker.py``: the trainer, run as its own process (in a namespace under ``--netem``);
  it trains in timed phases and prints a JSON line per phase and per micro-batch.
- ``swarm.py``: node processes on loopback or one per emulated host; kills, replacements.
- ``throttle.py``: a CPU cap on a node's processes (a cgroup), for slow peers.
- ``wire.py``: the bytes a run must move per sample, and loopback's byte counter.
"""
