"""A sybil flood against a public run: records from freshly generated keys, stored by a
raw ``hivemind.DHT`` that checks nothing (as ``test_node_records`` stores forged ones).

Every sybil record is validly signed, but no sybil runs a node: none answers a call or a
dial. What must hold: the honest peers stay listed in ``swarmtrain status --json``, a
trainer keeps training at half its undisturbed rate or more (routing gives a peer
traffic only as its calls succeed, a trainer checks a bounded part of each read of the
run's peers, and a node shares its reads of them longer as they grow), and claims of
1e9 samples/s on a stage move no peer off it (placement counts only peers it has
reached)."""

from __future__ import annotations

import re
import subprocess
import sys

from node.harness.attackers import attacker_dht, sybil_flood
from protocol.records import MAX_MEMBERSHIP_CHARS, MAX_STAGES, PeerBounds
from tests.swarm import LOCAL, launch_node, status, stop_all, swarmtrain, wait_until

SYBILS = 1000
# The flood costs a trainer a few seconds once, at its start (about 3 s on an idle
# machine, in 64 and in 256 micro-batches alike), then little: the window must be long
# enough that the rate, not that fixed cost, is what the bound compares.
MICRO_BATCHES = 256
_RATE = re.compile(r"trained (\d+) micro-batches \((\d+) samples, (\d+) samples/s\)")


def _train(run: str, maddrs: list[str], micro_batches: int, timeout: float) -> tuple[float, str]:
    """``swarmtrain train`` to the end: its samples/s and its output (the test fails if it
    does not finish within ``timeout``)."""
    proc = swarmtrain(
        "train", "--run", run, "--initial-peers", *maddrs, "--host-maddrs", LOCAL,
        "--micro-batches", str(micro_batches),
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(
            f"the trainer did not finish within {timeout} s:\n{err[-3000:]}"
        ) from None
    found = _RATE.search(out)
    assert proc.returncode == 0 and found, f"trainer failed:\n{out[-2000:]}\n{err[-3000:]}"
    return float(found.group(3)), out + err


def test_a_sybil_flood_neither_blinds_readers_nor_slows_the_trainer(tmp_path):
    """1,000 records as large as today's bounds allowed (a throughput tuple of 256
    entries, a full membership field: refused now, as sized past what a 2-stage public run
    needs) and 1,000 of the largest size the run allows, each claiming to serve at 1e9
    samples/s: the honest peers stay listed and the trainer keeps half its rate (over
    ``MICRO_BATCHES``, validations before and after included, as ``swarmtrain train``
    prints it)."""
    period = 5.0  # the default: records live 15 s
    a = launch_node(tmp_path, "a", "sybil", extra=["--stage", "0"], update_period=period)
    run = a.run_id
    b = launch_node(
        tmp_path, "b", run, initial_peers=[a.maddr], extra=["--stage", "1"], update_period=period
    )
    nodes, attacker = [a, b], None
    try:
        for n in nodes:
            n.wait_serving()
        maddrs = [n.maddr for n in nodes]
        calm, _ = _train(run, maddrs, MICRO_BATCHES, timeout=240)

        attacker = attacker_dht(a.maddr)
        fat = sybil_flood(
            attacker, run, SYBILS,
            throughput=(123456789.12345679,) * MAX_STAGES, membership="A" * MAX_MEMBERSHIP_CHARS,
        )  # fmt: skip
        largest = PeerBounds(2, private=False).max_bytes
        lean = sybil_flood(attacker, run, SYBILS, max_bytes=largest, throughput=(1e9, 1e9))
        reads: list[set[str]] = []

        def honest_listed() -> set[str] | None:
            reads.append({p["peer_id"] for p in status(run, a.maddr)["peers"]})
            return reads[-1] if {a.peer_id, b.peer_id} <= reads[-1] else None

        listed = wait_until(honest_listed, 60, "status to list the honest peers", every=0)
        print(f"status reads: {[len(r) for r in reads]} peers listed")

        attacked, out = _train(run, maddrs, MICRO_BATCHES, timeout=240)
        print(
            f"records of {fat} and {lean} bytes; status listed {len(listed)} peers; trainer "
            f"{calm:.0f} samples/s undisturbed, {attacked:.0f} under the flood"
        )
        assert attacked >= calm / 2, f"{attacked} samples/s under the flood, {calm} without"
    finally:
        if attacker is not None:
            attacker.shutdown()
        stop_all(nodes)


def test_fake_throughput_claims_move_no_peer_off_a_stage(tmp_path):
    """Sybil records claim 1e9 samples/s on the stage where a movable peer serves: were
    they believed, that stage would look oversupplied and the peer would move off it
    (and its move be confirmed, the sybils "still serving" the stage). It stays."""
    fast = ["--rebalance-period", "2"]
    a = launch_node(tmp_path, "a", "lure", extra=["--stage", "0"])
    run = a.run_id
    b = launch_node(tmp_path, "b", run, initial_peers=[a.maddr], extra=["--stage", "1"])
    c = launch_node(tmp_path, "c", run, initial_peers=[a.maddr], extra=fast)
    nodes, attacker = [a, b, c], None
    try:
        for n in nodes:
            n.wait_serving()
        stage = c.stage()
        attacker = attacker_dht(a.maddr)
        rates = (1e9, 0.0) if stage == 0 else (0.0, 1e9)
        sybil_flood(attacker, run, 20, stage=stage, throughput=rates)
        listed = wait_until(
            lambda: (v := status(run, a.maddr)) and len(v["peers"]) >= 23 and v,
            30,
            "status to list the sybils",
        )
        assert sum(1 for p in listed["peers"] if p["throughput"] == 1e9) == 20
        checked = len(c.events("placement.checked")) + 5
        wait_until(
            lambda: c.events("placement.moved") or len(c.events("placement.checked")) >= checked,
            60,
            "five checks of the movable peer",
        )
        assert not c.events("placement.moved"), f"moved: {c.events('placement.moved')}"
        assert c.stage() == stage
    finally:
        if attacker is not None:
            attacker.shutdown()
        stop_all(nodes)


if __name__ == "__main__":
    sys.exit("run with pytest")
