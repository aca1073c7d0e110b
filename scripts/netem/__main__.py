"""``python -m scripts.netem check|cleanup|selftest`` (as root, from the repository root).

- ``check``: says whether this machine can build the emulated network, or what it lacks.
- ``cleanup``: removes every namespace and link a crashed run left (names ``stn*``).
- ``selftest A B``: two hosts with profiles A and B; measures round trip and throughput
  from A to B through B's relay, next to what the profiles should give.
"""

from __future__ import annotations

import argparse
import sys

from scripts.netem.network import (
    PREFIX,
    NetemUnavailable,
    Network,
    check,
    remove,
)
from scripts.netem.profiles import PROFILES, profile


def selftest(a: str, b: str, seconds: float) -> None:
    with Network([profile(a), profile(b)]) as net:
        src, dst = net.hosts
        net.start_relay(dst)
        got = net.probe(src, dst, seconds)
    pa, pb = src.profile, dst.profile
    want = {
        "rtt_ms": 2 * (pa.delay_ms + pb.delay_ms),
        "up_mbit": min(pa.up_mbit, pb.down_mbit),
        "down_mbit": min(pb.up_mbit, pa.down_mbit),
    }
    print(f"{a} -> {b} through {b}'s relay:")
    for k, v in want.items():
        print(f"  {k:<10} profile {v:8.1f}   measured {got[k]:8.1f}   ratio {got[k] / v:5.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check")
    sub.add_parser("cleanup")
    t = sub.add_parser("selftest")
    t.add_argument("profiles", nargs=2, choices=sorted(PROFILES))
    t.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    if args.cmd == "cleanup":
        removed = remove(PREFIX)
        print(f"removed: {', '.join(removed)}" if removed else "nothing to remove")
        return 0
    try:
        check()
        if args.cmd == "check":
            print("ok: namespaces, veth pairs, a bridge and the tbf qdisc work here")
        else:
            selftest(*args.profiles, args.seconds)
    except NetemUnavailable as e:
        print(f"SKIPPED: {e}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
