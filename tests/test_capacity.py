"""What a node measures of its own machine: compute throughput per stage."""

import json

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.capacity import pick_device, stage_kind, stage_throughputs
from protocol.identity import peer_id_of
from protocol.run_spec import make_run_spec

OWNER = peer_id_of(Ed25519PrivateKey.from_private_bytes(bytes([3]) * 32).public_key())


def test_stages_doing_the_same_work_get_one_measurement(tmp_path):
    # tiny: 4 transformer blocks; cut in 4, stages 1 and 2 hold one block each.
    spec = make_run_spec("capacity", "tiny", 4, owner=OWNER)
    kinds = [stage_kind(spec, s) for s in range(4)]
    assert kinds == [(True, 2, False), (False, 1, False), (False, 1, False), (False, 2, True)]
    measured = stage_throughputs(spec, pick_device("cpu"), tmp_path)
    assert len(measured) == 4 and all(t > 0 for t in measured)
    assert measured[1] == measured[2]
    assert len(set(measured)) == 3  # the other kinds were measured on their own
    # Cached on disk for the next start, keyed by device and model.
    assert list(json.loads((tmp_path / "throughput.json").read_text()).values()) == [measured]
    assert stage_throughputs(spec, pick_device("cpu"), tmp_path) == measured
