"""Stage checkpoints on disk: what is written reads back as the state a peer would
download; another run's, another spec's or a corrupted file is refused, and the newest
good one stands in."""

from __future__ import annotations

import os

import pytest
import torch

from models.stages import Stage
from models.training import StageOptimizer
from node.averaging import state as stage_state
from node.daemon import checkpoint
from node.daemon.checkpoint import CheckpointError
from protocol.run_spec import make_run_spec

SPEC = make_run_spec(
    "ckpt", "tiny", 2, owner="12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
)
OTHER = make_run_spec("ckpt", "tiny", 3, owner=SPEC.owner)


def _trained(stage_index: int, steps: int) -> tuple[Stage, StageOptimizer]:
    module = Stage(SPEC.model, SPEC.stage_range(stage_index))
    optimizer = StageOptimizer(module, SPEC.optim)
    t, c = SPEC.model.block_size, SPEC.model.n_embd
    tokens = torch.randint(0, 256, (2, t))
    for _ in range(steps):
        if module.takes_tokens:
            module(tokens).pow(2).mean().backward()
        else:
            module(torch.randn(2, t, c), tokens).backward()
        optimizer.accumulated(2)
        optimizer.step()
    return module, optimizer


def _capture(module, optimizer, epoch):
    return stage_state.capture(module, optimizer, epoch=epoch, mode="gradient", peer="me")


def test_a_checkpoint_reads_back_as_the_state_a_peer_would_download(tmp_path):
    module, optimizer = _trained(0, steps=3)
    metadata, tensors = _capture(module, optimizer, epoch=3)
    path = checkpoint.write(tmp_path, SPEC, 0, metadata, tensors)
    assert not list(path.parent.glob(".*"))  # no temporary file left behind
    kept = checkpoint.newest(tmp_path, SPEC, 0)
    assert kept is not None and kept.epoch == 3 and kept.path == path

    fresh, fresh_opt = _trained(0, steps=0)
    state = stage_state.parse(kept.metadata, kept.tensors, fresh, mode="gradient")
    stage_state.apply(state, fresh, fresh_opt)
    assert fresh_opt.step_count == 3
    for a, b in zip(module.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert checkpoint.newest(tmp_path, SPEC, 1) is None  # nothing of stage 1


def test_only_the_newest_are_kept_and_a_corrupted_one_falls_back(tmp_path):
    module, optimizer = _trained(1, steps=1)
    paths = [
        checkpoint.write(tmp_path, SPEC, 1, *_capture(module, optimizer, epoch), keep=2)
        for epoch in (1, 2, 3)
    ]
    assert sorted(p.name for p in paths[0].parent.iterdir()) == [paths[1].name, paths[2].name]
    data = bytearray(paths[2].read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the tensors
    paths[2].write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        checkpoint.read(paths[2], SPEC, 1)
    assert checkpoint.newest(tmp_path, SPEC, 1).epoch == 2
    paths[1].write_bytes(paths[1].read_bytes()[:100])  # truncated
    assert checkpoint.newest(tmp_path, SPEC, 1) is None


def test_another_runs_or_specs_checkpoint_is_refused_naming_both(tmp_path):
    module, optimizer = _trained(0, steps=1)
    path = checkpoint.write(tmp_path, SPEC, 0, *_capture(module, optimizer, 1))
    with pytest.raises(CheckpointError, match="not of 'ckpt@") as e:
        checkpoint.read(path, OTHER, 0)
    assert checkpoint.spec_hash(SPEC) in str(e.value)
    assert checkpoint.spec_hash(OTHER) in str(e.value)
    with pytest.raises(CheckpointError, match="holds stage 0, not 1"):
        checkpoint.read(path, SPEC, 1)


def test_a_restarted_node_knows_the_stages_it_kept_newest_first(tmp_path):
    assert checkpoint.kept_stages(tmp_path, SPEC) == []
    for stage in (1, 0):  # stage 0 written last
        module, optimizer = _trained(stage, steps=1)
        checkpoint.write(tmp_path, SPEC, stage, *_capture(module, optimizer, epoch=1))
    newest = checkpoint.stage_dir(tmp_path, 0)
    older = checkpoint.stage_dir(tmp_path, 1)
    for f in newest.iterdir():
        os.utime(f, (2_000_000_000, 2_000_000_000))
    for f in older.iterdir():
        os.utime(f, (1_000_000_000, 1_000_000_000))
    assert checkpoint.kept_stages(tmp_path, SPEC) == [0, 1]
    assert checkpoint.kept_stages(tmp_path, OTHER) == [], "another spec's is no resume"
    (next(newest.iterdir())).write_bytes(b"garbage")  # unreadable: the other stage's counts
    assert checkpoint.kept_stages(tmp_path, SPEC) == [1]


def test_a_checkpoint_records_the_data_position_of_its_stream(tmp_path):
    module, optimizer = _trained(0, steps=1)
    metadata, tensors = _capture(module, optimizer, epoch=1)
    assert checkpoint.data_position(tmp_path, SPEC, stream=5) == 0  # nothing kept
    position = checkpoint.DataPosition(stream=5, position=40)
    checkpoint.write(tmp_path, SPEC, 0, metadata, tensors, data=position)
    module, optimizer = _trained(1, steps=1)
    metadata, tensors = _capture(module, optimizer, epoch=1)
    checkpoint.write(tmp_path, SPEC, 1, metadata, tensors, data=checkpoint.DataPosition(5, 42))
    assert checkpoint.data_position(tmp_path, SPEC, stream=5) == 42  # the furthest
    assert checkpoint.data_position(tmp_path, SPEC, stream=6) == 0  # another stream's
    assert checkpoint.data_position(tmp_path, OTHER, stream=5) == 0  # another spec's


def test_a_checkpoint_whose_metadata_is_not_an_object_is_refused_everywhere(tmp_path):
    """Valid safetensors whose ``swarmtrain`` metadata is JSON but not an object: refused
    with a CheckpointError, skipped by the header-only readers, never an AttributeError."""
    from safetensors.torch import save_file

    module, optimizer = _trained(0, steps=1)
    path = checkpoint.write(tmp_path, SPEC, 0, *_capture(module, optimizer, 1))
    save_file({"x": torch.zeros(1)}, str(path), metadata={"swarmtrain": "[1, 2]"})
    with pytest.raises(CheckpointError, match="not an object"):
        checkpoint.read(path, SPEC, 0)
    assert checkpoint.newest(tmp_path, SPEC, 0) is None
    assert checkpoint.kept_stages(tmp_path, SPEC) == []
    assert checkpoint.data_position(tmp_path, SPEC, 0) == 0
