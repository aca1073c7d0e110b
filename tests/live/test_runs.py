"""Finding public runs: two owners' nodes, each its own public run in one shared DHT, are
listed by ``swarmtrain runs``; announcements forged into the DHT by a peer that checks
nothing are refused by the honest nodes and not listed, and a validly signed announcement
of a run with no live peer (what a flood of fresh keys can cost-free make) is not listed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from node.files import load_or_create_key
from protocol.announce import MAX_ANNOUNCE_AGE_S, RunAnnouncement, encode_announcement
from protocol.identity import peer_id_of
from protocol.keys import RUNS_KEY
from protocol.ownership import make_run_id
from protocol.records import PROTOCOL_VERSION
from protocol.run_spec import make_run_spec, sign_run_spec, spec_file_text
from tests.swarm import LOCAL, launch_node, stop_all, wait_until
from tests.unit.test_announce import _forged


def _runs(maddr: str) -> dict:
    """``swarmtrain runs --json`` as a dict."""
    proc = subprocess.run(
        [sys.executable, "-m", "node.cli", "runs", "--initial-peers", maddr,
         "--host-maddrs", LOCAL, "--json", "--timeout", "15"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _listed(maddr: str) -> dict[str, dict]:
    return {r["run"]: r for r in _runs(maddr)["runs"]}


def _announcement(owner: str, run: str) -> RunAnnouncement:
    now = get_dht_time()
    return RunAnnouncement(
        owner=owner, run=run, version=PROTOCOL_VERSION, preset="tiny", n_layer=4, n_embd=64,
        data="stdlib", peers=1000, stage_throughput=(1e6, 1e6), created=now, timestamp=now,
    )  # fmt: skip


def test_runs_lists_the_public_runs_started_and_not_a_forged_announcement(tmp_path):
    nodes, attacker = [], None
    try:
        a = launch_node(tmp_path, "a", "alpha")  # a new public run; owner key tmp_path/owner.key
        nodes.append(a)
        # The second owner starts its run in the first's DHT, from its own signed spec.
        b_owner = load_or_create_key(tmp_path / "b-owner.key")
        spec = make_run_spec("beta", "tiny", 2, owner=peer_id_of(b_owner.public_key()))
        spec_file = tmp_path / "beta.spec.json"
        spec_file.write_text(spec_file_text(sign_run_spec(spec, b_owner)))
        extra = ["--spec", str(spec_file), "--owner-key", str(tmp_path / "b-owner.key")]
        b = launch_node(tmp_path, "b", spec.run, initial_peers=[a.maddr], extra=extra)
        nodes.append(b)
        a.wait_serving(), b.wait_serving()
        runs = {a.run_id, b.run_id}

        # A peer that checks nothing writes into the directory: an announcement of run a
        # signed by another key, one of a run id with a's fingerprint signed by that other
        # key as its owner, and a valid one of a fresh key's own run that has no peers.
        attacker = hivemind.DHT(initial_peers=[a.maddr], host_maddrs=[LOCAL], start=True)
        a_owner = peer_id_of(load_or_create_key(tmp_path / "owner.key").public_key())
        other = Ed25519PrivateKey.generate()
        forger = peer_id_of(other.public_key())
        phantom = a.run_id.replace("alpha@", "phantom@")
        bare_key = Ed25519PrivateKey.generate()
        bare_owner = peer_id_of(bare_key.public_key())
        bare_run = make_run_id("bare", bare_owner)
        planted = {
            a.run_id: _forged(other, _announcement(a_owner, a.run_id)),
            phantom: _forged(other, _announcement(a_owner, phantom), owner=forger),
            bare_run: encode_announcement(_announcement(bare_owner, bare_run), bare_key),
        }
        expires = get_dht_time() + MAX_ANNOUNCE_AGE_S - 10
        for run, value in planted.items():
            attacker.store(RUNS_KEY, subkey=run, value=value, expiration_time=expires)

        def both_listed() -> dict | None:
            view = _runs(a.maddr)
            return view if {r["run"] for r in view["runs"]} >= runs else None

        view = wait_until(both_listed, 40, "swarmtrain runs to list both public runs", every=1)
        listed = {r["run"]: r for r in view["runs"]}
        assert set(listed) == runs, f"listed: {sorted(listed)}"
        for run in runs:  # counted from the runs' own peer records, not as announced
            assert listed[run]["peers"] == 1 and listed[run]["stages"] == 2
            assert max(listed[run]["stage_throughput"]) <= 100.0  # each declares 100
            assert listed[run]["model"] == "tiny"
        assert view["join"] == f"swarmtrain node --run RUN_ID --initial-peers {a.maddr}"
        # The bare run was stored (it is validly signed) but has no live peer.
        assert view["no_live_peers"] >= 1 and view["not_checked"] == 0

        def refused(reason: str) -> bool:
            return any(
                reason in e["reason"]
                for node in nodes
                for e in node.events("record.refused")
                if e.get("key") == RUNS_KEY
            )

        wait_until(
            lambda: (
                refused(f"bad signature on the record of peer {a_owner}")
                and refused(f"does not belong to owner {forger}")
            ),
            10,
            "the honest nodes to refuse both forged announcements",
        )
    finally:
        if attacker is not None:
            attacker.shutdown()
        stop_all(nodes)
