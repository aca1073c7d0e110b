"""What a node measures of its own machine: compute throughput per stage."""

import functools
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from models.stages import Stage
from node.measure import capacity
from node.measure.capacity import (
    free_memory,
    pick_device,
    stage_kind,
    stage_memory,
    stage_throughputs,
)
from protocol.identity import peer_id_of
from protocol.run_spec import make_run_spec

OWNER = peer_id_of(Ed25519PrivateKey.from_private_bytes(bytes([3]) * 32).public_key())


@pytest.fixture
def brief_measurements(monkeypatch):
    """Each stage timed for a few passes, not half a second: what these tests check is which
    stages get measured and what is cached, not the figures' precision."""
    real = capacity.measure_stage
    monkeypatch.setattr(capacity, "measure_stage", functools.partial(real, min_time_s=0.02))


def test_stages_doing_the_same_work_get_one_measurement(tmp_path, brief_measurements):
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


def test_a_stage_s_training_memory_is_counted_without_allocating_it():
    spec = make_run_spec("capacity", "tiny", 4, owner=OWNER)
    for s in (0, 1, 3):  # the embedding, a block, the head
        real = sum(p.numel() for p in Stage(spec.model, spec.stage_range(s)).parameters())
        assert stage_memory(spec, s) == int(real * 16 * 1.5)  # weights, grads, 2 moments
    assert stage_memory(spec, 0) > stage_memory(spec, 1)  # the embedding table weighs
    assert free_memory(pick_device("cpu")) > stage_memory(spec, 0)
