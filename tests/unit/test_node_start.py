"""A node's start: what it finds out about its machine without asking a peer
(``examine_machine``, run on a thread beside the reachability check), and the line that
says how long each step of a sequence (the start, a stage's loading) took."""

from __future__ import annotations

import re

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.daemon.settings import NodeSettings
from node.daemon.start import Steps, examine_machine
from protocol.identity import peer_id_of
from protocol.run_spec import make_run_spec

OWNER = peer_id_of(Ed25519PrivateKey.from_private_bytes(bytes([5]) * 32).public_key())


def test_a_declared_throughput_is_taken_as_it_is_and_a_node_that_does_not_train_reads_no_data():
    spec = make_run_spec("start", "tiny", 3, owner=OWNER)
    settings = NodeSettings(run=spec.run, device="cpu", throughput=7.0, train=False)
    machine = examine_machine(settings, spec)
    assert machine.throughput == (7.0, 7.0, 7.0) and machine.device.name == "cpu"
    assert machine.corpus is None and machine.pretrained is None and machine.seconds >= 0


def test_the_line_names_every_step_and_adds_only_the_steps_that_ran_in_turn():
    steps = Steps(("process and DHT", 3.0))
    steps.done("run joined")
    steps.done("machine examined on a thread", 1e6)  # beside the others: not added
    line = steps.line()
    seconds = dict(re.findall(r"([a-zA-Z][a-zA-Z ]+?) ([\d.]+) s", line.split("(", 1)[1]))
    assert list(seconds) == ["process and DHT", "run joined", "machine examined on a thread"]
    assert float(seconds["process and DHT"]) == 3.0 and float(seconds["run joined"]) < 60
    assert 3.0 <= steps.total < 1e6 and line.startswith(f"{steps.total:.1f} s ("), line
