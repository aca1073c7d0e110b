"""Node processes on 127.0.0.1 for the demo, tests and benchmarks (``local_swarm``)."""
