"""Link profiles: what the access link of an emulated host is like."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    up_mbit: float  # upload cap, shaped with tbf on the host's side of its veth
    down_mbit: float  # download cap, shaped with tbf on the bridge's side
    delay_ms: float  # one-way latency of this host's access link (added by the relay)
    jitter_ms: float = 0.0  # uniform +- around delay_ms, never reordering bytes
    loss: float = 0.0  # probability that a chunk is "lost": it waits a retransmission

    def __post_init__(self) -> None:
        if min(self.up_mbit, self.down_mbit) <= 0:
            raise ValueError(f"profile {self.name}: bandwidth must be > 0")
        if not 0 <= self.jitter_ms <= self.delay_ms:
            raise ValueError(f"profile {self.name}: jitter_ms must be in [0, delay_ms]")
        if not 0 <= self.loss < 1:
            raise ValueError(f"profile {self.name}: loss must be in [0, 1)")


PROFILES = {
    p.name: p
    for p in (
        Profile("home", up_mbit=50, down_mbit=200, delay_ms=40, jitter_ms=5),
        Profile("datacenter", up_mbit=1000, down_mbit=1000, delay_ms=5),
        Profile("mobile", up_mbit=10, down_mbit=40, delay_ms=60, jitter_ms=20, loss=0.01),
    )
}


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
