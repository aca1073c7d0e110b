"""Emulated home and datacenter links on one Linux machine (run as root).

- ``profiles.py``: what a host's link is like (bandwidth up/down, latency, jitter, loss).
- ``network.py``: hosts as network namespaces on a bridge (veth pairs, addresses in
  10.77.0.0/24 only), bandwidth shaped with ``tbf``; teardown on exit, failure or Ctrl-C,
  and ``cleanup`` of leftovers by name prefix; home hosts behind NAT routers (nftables
  masquerade: they dial out, nothing dials in).
- ``relay.py``: a user-space TCP relay in front of each host's node that adds latency,
  jitter and loss, because this kernel has no ``netem`` qdisc.
- ``__main__.py``: ``python -m scripts.netem check|cleanup|selftest``.
"""
