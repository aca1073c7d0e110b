"""A valid peer record to start from, for tests that forge, mutate or plant records
(``node.harness.attackers.peer_info``, which attackers start from too)."""

from __future__ import annotations

from node.harness.attackers import peer_info

__all__ = ["peer_info"]
