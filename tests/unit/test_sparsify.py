"""Compressed averaging: the coordinates a DiLoCo round sends, the 8-bit grid, the lossless
wire codec (``protocol.sparsify``), the spec's bounds, and the error-feedback residual of
``DiLoCoStrategy`` driven as the round loop drives it (no averager, no DHT)."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.compression import (
    NoCompression,
    deserialize_torch_tensor,
    serialization,
    serialize_torch_tensor,
)
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from pydantic import ValidationError

from models.training import StageOptimizer
from node.averaging import state as stage_state
from node.averaging.process import StageAveragerProcess
from node.averaging.strategies import (
    AveragingStats,
    DiLoCoStrategy,
    GradientStrategy,
    Strategy,
    make_strategy,
)
from node.averaging.transport import BlockCodec, process_settings
from node.rpc.hivemind_compat import use_compression
from protocol import sparsify
from protocol.averaging import robust_mean
from protocol.identity import peer_id_of
from protocol.run_spec import AveragingSpec, decode_run_spec, make_run_spec, sign_run_spec
from tests.averaging_peer import MICRO, backward, make_spec
from tests.unit.test_averaging_strategies import _stage

SALT = "run/0"


def test_every_groupmate_draws_the_same_coordinates_and_all_are_drawn_alike():
    n, density = 1003, 0.1
    idx = sparsify.choose_indices(n, density, sparsify.round_seed(SALT, 7))
    assert torch.equal(idx, sparsify.choose_indices(n, density, sparsify.round_seed(SALT, 7)))
    assert len(idx) == sparsify.sent_count(n, density) == 101
    valid = idx[idx >= 0]
    assert bool((valid.diff() > 0).all()) and int(valid.max()) < n  # one per block of 10
    assert bool(((valid // 10) == torch.arange(len(idx))[idx >= 0]).all())
    other = sparsify.choose_indices(n, density, sparsify.round_seed(SALT, 8))
    assert not torch.equal(idx, other)  # another epoch, other coordinates
    drawn = torch.zeros(n)
    for epoch in range(500):
        i = sparsify.choose_indices(n, density, sparsify.round_seed(SALT, epoch))
        drawn[i[i >= 0]] += 1
    assert float(drawn.min()) >= 20 and float(drawn.max()) <= 85  # about 50 each
    assert len(sparsify.choose_indices(n, 1.0, (1, 2))) == n  # density 1: all of them


def test_gather_and_scatter_skip_the_slots_past_the_end():
    flat = torch.arange(5, dtype=torch.float32)
    idx = torch.tensor([1, 3, -1])
    assert sparsify.gather(flat, idx).tolist() == [1.0, 3.0, 0.0]
    assert sparsify.scatter(torch.tensor([7.0, 8.0, 9.0]), idx, 5).tolist() == [0, 7, 0, 8, 0]


def test_values_on_the_grid_travel_in_about_a_byte_each_and_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20_000, generator=g) * 1e-3
    x[:100] *= 1000  # one block of large values: the others keep their own scale
    rounded = sparsify.round_to_grid(x)
    assert float((rounded - x).abs().max()) <= float(x.abs().max()) / 127
    data = sparsify.encode(rounded)
    assert len(data) < 1.1 * len(x)
    assert torch.equal(sparsify.decode(data, len(x)), rounded)
    assert torch.equal(sparsify.round_to_grid(rounded), rounded)  # idempotent
    # Anything else travels unrounded: float16 or float32 blocks, never changed.
    for values in (x, (rounded - sparsify.round_to_grid(x * 0.7)) / 3, torch.zeros(5)):
        assert torch.equal(sparsify.decode(sparsify.encode(values), len(values)), values)


def _grid_parts(n: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    """``k`` groupmates' parts of ``n`` values, each rounded to its own 8-bit grid."""
    g = torch.Generator().manual_seed(seed)
    return [sparsify.round_to_grid(torch.randn(n, generator=g) * 1e-3) for _ in range(k)]


@pytest.mark.parametrize("weights", [[1.0, 1.0], [1608.0, 1600.0], [3.0, 5.0, 7.0]])
def test_a_snapped_mean_returns_in_about_a_byte_per_value_and_the_same_to_every_copy(weights):
    n = 6016
    parts = _grid_parts(n, len(weights))
    mean = sum(p * w for p, w in zip(parts, weights, strict=True)) / sum(weights)
    snapped = sparsify.snap_mean(mean, parts)
    for part in parts:
        returned = snapped - part  # what the reducer sends back, as hivemind computes it
        assert len(sparsify.encode(returned)) < 1.1 * n
        assert torch.equal(part + returned, snapped)  # every copy holds the same mean
    # Unequal weights: the plain mean less a part needs float32 (4 bytes a value).
    if len(set(weights)) > 1:
        assert len(sparsify.encode(mean - parts[0])) > 3 * n
    # Rounded to nearest on the finest grid of the block's parts: at most half a step.
    finest = np.stack([sparsify.grid_exponents(p.numpy()) for p in parts]).min(axis=0)
    per_block = finest.reshape(-1, sparsify.CODEC_BLOCK).min(axis=1)  # n is a multiple
    step = torch.from_numpy(np.exp2(np.repeat(per_block, sparsify.CODEC_BLOCK)))
    assert bool(((snapped - mean).abs() <= step / 2).all())
    assert float((snapped - mean).abs().max()) > 0  # it did round


def test_snapping_leaves_what_it_cannot_round_and_zeros_alone():
    x = torch.randn(100)  # full float32 values: their grid is finer than the mean's bits
    assert torch.equal(sparsify.snap_mean(x, [x, x]), x)
    bad = torch.tensor([float("nan"), 1.0])
    assert torch.equal(sparsify.snap_mean(torch.ones(2), [bad, torch.ones(2)]), torch.ones(2))
    zeros = torch.zeros(70)  # a groupmate with no samples: its zeros are on every grid
    (part,) = _grid_parts(70, 1)
    assert torch.equal(sparsify.snap_mean(part, [part, zeros]), part)  # zeros of weight 0
    assert torch.equal(sparsify.snap_mean(zeros, [zeros, zeros]), zeros)
    e = sparsify.grid_exponents(torch.tensor([0.75, 1.0, -6.0, 0.0, 2**-140]).numpy())
    assert e[:3].tolist() == [-2, 0, 1] and e[3] > 1000 and e[4] == -140


def test_the_stage_averager_snaps_the_means_of_compressed_rounds_only():
    parts, weights = _grid_parts(600, 2), [3.0, 5.0]
    plain = robust_mean(parts, weights)

    def reduced(compression) -> torch.Tensor:
        dht = types.SimpleNamespace(client_mode=False, peer_id=PeerID(b"me"))
        averager = StageAveragerProcess(
            [torch.zeros(4)], dht, start=False, prefix="p", state_source=lambda: ({}, []),
            compression=compression,
        )  # fmt: skip
        return averager.reduce_parts(parts, weights)

    assert torch.equal(reduced(BlockCodec()), sparsify.snap_mean(plain, parts))
    assert not torch.equal(reduced(BlockCodec()), plain)
    assert torch.equal(reduced(NoCompression()), plain)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda d: d[:-1],  # short
        lambda d: d + b"\0",  # long
        lambda d: bytes([9]) + d[1:],  # an unknown block kind
        lambda d: d[:5] + bytes([0x81]) + d[6:],  # block 0's exponent -127: out of range
        lambda d: bytes([3]) + d[1:],  # block 0 said float32: the size no longer matches
        lambda d: b"",
    ],
)
def test_malformed_parts_are_refused(tamper):
    data = sparsify.encode(sparsify.round_to_grid(torch.randn(300)))
    with pytest.raises(sparsify.CodecError):
        sparsify.decode(tamper(data), 300)


def test_the_codec_takes_a_hivemind_slot_and_refuses_a_wrong_dtype():
    codec = process_settings(AveragingSpec(mode="diloco", compression="uint8"))["compression"]
    assert isinstance(codec, BlockCodec)
    # Not hivemind's UNIFORM_8BIT: the stage pipeline's uint8 activations use that one.
    assert codec.compression_type == runtime_pb2.BLOCKWISE_8BIT
    kept = serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"]
    use_compression(codec)  # as the averager process does
    try:
        x = sparsify.round_to_grid(torch.randn(1000))
        wire = serialize_torch_tensor(x, runtime_pb2.BLOCKWISE_8BIT)
        assert len(wire.buffer) < 1100 and torch.equal(deserialize_torch_tensor(wire), x)
        nan = serialize_torch_tensor(torch.tensor([float("nan"), 1.0]), codec.compression_type)
        assert bool(deserialize_torch_tensor(nan).isnan()[0])  # check_part refuses it after
    finally:
        serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = kept
    wire.dtype = "float64"
    with pytest.raises(sparsify.CodecError):
        codec.extract(wire)


@pytest.mark.parametrize(
    "values",
    [[float("nan"), 1.0], [float("inf"), 1.0], [0.5, 2e4]],
)
def test_a_part_that_decodes_to_non_finite_or_huge_values_is_refused_by_the_screen(values):
    """The codec carries any float32 exactly (a sender may send NaN): the stage averager's
    screen refuses such a groupmate's part as it refuses an uncompressed one."""
    x = torch.tensor(values * 40)
    part = sparsify.decode(sparsify.encode(x), len(x))
    assert torch.equal(part.isnan(), x.isnan()) and torch.equal(part.nan_to_num(), x.nan_to_num())
    assert StageAveragerProcess.check_part(None, part, 1.0) is not None  # uses no state
    ok = sparsify.decode(sparsify.encode(sparsify.round_to_grid(x.nan_to_num(0, 0, 0))), len(x))
    assert StageAveragerProcess.check_part(None, ok.clamp(-1, 1), 1.0) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"density": 0.0},
        {"density": 1.5},
        {"density": float("nan")},
        {"mode": "gradient", "density": 0.1},
        {"compression": "int4"},
    ],
)
def test_settings_outside_the_bounds_are_refused(bad):
    with pytest.raises(ValidationError):
        AveragingSpec(**({"mode": "diloco"} | bad))


def _built(spec) -> Strategy:
    module = _stage(spec)
    optimizer = StageOptimizer(module, spec.optim)
    return make_strategy(
        module, optimizer, threading.Lock(), spec.averaging, AveragingStats(), salt=SALT
    )


def _compressed(density: float, compression: str = "uint8") -> DiLoCoStrategy:
    s = _built(
        make_spec("sparse", mode="diloco", inner_steps=1, density=density, compression=compression)
    )
    assert isinstance(s, DiLoCoStrategy) and s.compressed
    return s


def _inner(s: DiLoCoStrategy, seed: int) -> None:
    for k in range(s.target // MICRO):
        with s.lock:
            s.optimizer.accumulated(backward(s.module, 100 * seed + k))
            s.on_accumulated_locked(False)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def test_what_a_round_does_not_send_stays_in_the_residual_and_goes_later():
    s = _compressed(0.25)
    n = sum(p.numel() for p in s.params)
    assert s.shapes == [torch.Size([sparsify.sent_count(n, 0.25)])]
    _inner(s, 0)
    delta = _flat(s.digest_tensors()) - _flat(s.params)  # anchor - params
    c = s.begin()
    assert torch.allclose(c.pending, delta) and c.tensors[0].shape == s.shapes[0]
    assert torch.equal(c.tensors[0], sparsify.round_to_grid(sparsify.gather(delta, c.indices)))
    assert s.finish(c.tensors, c)  # alone in the round: our own values are the mean
    sent = sparsify.scatter(c.tensors[0], c.indices, n)
    # The residual is exactly what we held and did not send (the 8-bit rounding included),
    # and the copy goes on from the new anchor plus that progress of its own.
    assert torch.allclose(s.residual, delta - sent, atol=0)
    assert float(s.residual.abs().sum()) > 0
    assert torch.allclose(_flat(s.digest_tensors()) - _flat(s.params), s.residual, atol=1e-7)
    # Next round: the delta from the new anchor holds the residual; another draw.
    _inner(s, 1)
    c2 = s.begin()
    assert torch.allclose(c2.pending, _flat(s.digest_tensors()) - _flat(s.params))
    assert not torch.equal(c2.indices, c.indices)
    s.give_back(c2)  # a failed round: nothing leaves the residual
    assert torch.allclose(s.residual, delta - sent, atol=0)


def test_stepping_alone_applies_everything_and_a_downloaded_state_clears_the_residual():
    s = _compressed(0.1, compression="none")
    _inner(s, 0)
    c = s.begin()
    s.finish(c.tensors, c)
    assert float(s.residual.abs().sum()) > 0
    _inner(s, 1)
    assert s.step_alone()  # nothing travels: the whole delta and residual step
    assert float(s.residual.abs().sum()) == 0
    assert torch.equal(_flat(s.params), _flat(s.digest_tensors()))
    _inner(s, 2)
    c = s.begin()
    s.finish(c.tensors, c)
    s.apply_state(_state_of(s))
    assert float(s.residual.abs().sum()) == 0


def _state_of(s: DiLoCoStrategy) -> stage_state.StageState:
    metadata, tensors = s.capture("donor")
    return stage_state.parse(metadata, tensors, s.module, mode=s.mode)


def test_a_joiner_downloads_the_anchor_never_the_donors_residual():
    donor = _compressed(0.25)
    _inner(donor, 0)
    c = donor.begin()
    donor.finish(c.tensors, c)
    assert float(donor.residual.abs().sum()) > 0  # the donor holds unsent progress
    joiner = _compressed(0.25)
    joiner.apply_state(_state_of(donor))
    # What travels is the anchor all copies agreed on: the joiner starts from it, with an
    # empty residual of its own; the donor's unsent progress stays the donor's.
    assert torch.equal(_flat(joiner.params), _flat(donor.digest_tensors()))
    assert torch.equal(_flat(joiner.digest_tensors()), _flat(donor.digest_tensors()))
    assert float(joiner.residual.abs().sum()) == 0
    assert not torch.equal(_flat(joiner.params), _flat(donor.params))


def test_two_copies_that_average_their_sparse_parts_agree_on_the_anchor():
    a, b = _compressed(0.25), _compressed(0.25)
    for r in range(3):
        _inner(a, r)
        _inner(b, 50 + r)  # different data: different deltas
        ca, cb = a.begin(), b.begin()
        assert torch.equal(ca.indices, cb.indices)
        mean = [(ca.tensors[0] + cb.tensors[0]) / 2]
        a.finish(mean, ca)
        b.finish(mean, cb)
        assert torch.equal(_flat(a.digest_tensors()), _flat(b.digest_tensors()))
        for s in (a, b):  # each keeps its own unsent progress in its parameters
            assert torch.allclose(
                _flat(s.digest_tensors()) - _flat(s.params), s.residual, atol=1e-7
            )
    assert not torch.equal(a.residual, b.residual)


def test_a_compressed_spec_signs_with_its_density_and_a_dense_one_without():
    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    owner = peer_id_of(key.public_key())
    for density in (0.05, 1.0):
        averaging = AveragingSpec(mode="diloco", density=density, compression="uint8")
        spec = make_run_spec("zip", "tiny", 2, owner=owner, averaging=averaging)
        signed = sign_run_spec(spec, key)
        assert (b"density" in signed.raw) is (density < 1)
        assert decode_run_spec(signed.raw, run=spec.run).spec.averaging == averaging


def _gradient(compression: str = "uint8") -> GradientStrategy:
    s = _built(make_spec("grad8", compression=compression))
    assert isinstance(s, GradientStrategy) and s.compressed is (compression == "uint8")
    return s


def _accumulate(s: GradientStrategy, seeds) -> None:
    for seed in seeds:
        with s.lock:
            s.optimizer.accumulated(backward(s.module, seed))


def test_a_compressed_gradient_round_sends_8_bits_and_keeps_the_rounding_for_later():
    s = _gradient()
    n = sum(p.numel() for p in s.params)
    assert s.shapes == [torch.Size([n])]
    _accumulate(s, [0, 1])
    expected = [p.grad / (2 * MICRO) for p in s.params]  # the mean gradients
    c = s.begin()
    assert c.weight == 2 * MICRO and torch.allclose(c.pending, _flat(expected), atol=0)
    sent = c.tensors[0]
    assert torch.equal(sent, sparsify.round_to_grid(c.pending, block=sparsify.CODEC_BLOCK))
    # 8 bits a value on the wire (plus a kind and an exponent byte per 64 values)
    blocks = -(-n // sparsify.CODEC_BLOCK)
    assert len(sparsify.encode(sent)) == blocks * (sparsify.CODEC_BLOCK + 2)
    assert not torch.equal(sent, c.pending)
    before = _flat(s.params).clone()
    assert s.finish(c.tensors, c)  # alone in the round: our own values are the mean
    assert not torch.equal(_flat(s.params), before) and s.epoch == 1
    assert torch.equal(s.residual, c.pending - sent) and float(s.residual.abs().sum()) > 0
    # The next round sends its mean gradients plus what this one left out.
    _accumulate(s, [2, 3])
    means = _flat([p.grad / (2 * MICRO) for p in s.params])
    c2 = s.begin()
    assert torch.allclose(c2.pending, means + s.residual, atol=0)
    kept = s.residual.clone()
    s.give_back(c2)  # a failed round: the residual stays for the next attempt
    assert torch.equal(s.residual, kept) and s.optimizer.samples == 2 * MICRO
    s.apply_state(_state_of(s))  # a downloaded state: the residual was about our old copy
    assert float(s.residual.abs().sum()) == 0


def test_copies_averaging_compressed_gradients_take_the_same_step_close_to_the_exact_one():
    """Two copies on different data, averaged as a reducer does it (``snap_mean``, the
    wire codec both ways): their parameters stay bitwise equal round after round, and near
    an uncompressed pair's."""
    a, b = _gradient(), _gradient()
    exact = [_gradient("none"), _gradient("none")]
    for r in range(4):
        for s, seeds in ((a, [r, r + 10]), (b, [r + 50, r + 60])):
            _accumulate(s, seeds)
        for s, seeds in zip(exact, ([r, r + 10], [r + 50, r + 60]), strict=True):
            _accumulate(s, seeds)
        ca, cb = a.begin(), b.begin()
        wire = [sparsify.decode(sparsify.encode(c.tensors[0]), len(c.tensors[0])) for c in (ca, cb)]
        mean = sparsify.snap_mean((wire[0] + wire[1]) / 2, wire)
        back = [w + sparsify.decode(sparsify.encode(mean - w), len(w)) for w in wire]
        assert all(torch.equal(x, mean) for x in back)  # returned exactly, to each copy
        a.finish([back[0]], ca)
        b.finish([back[1]], cb)
        ea, eb = exact[0].begin(), exact[1].begin()
        m = [(x + y) / 2 for x, y in zip(ea.tensors, eb.tensors, strict=True)]
        exact[0].finish(m, ea)
        exact[1].finish(m, eb)
        assert torch.equal(_flat(a.params), _flat(b.params))
    assert not torch.equal(a.residual, b.residual)  # each keeps its own
    gap = float((_flat(a.params) - _flat(exact[0].params)).norm())
    moved = float((_flat(exact[0].params) - _flat(_stage(make_spec("grad8")).parameters())).norm())
    # Adam magnifies the rounding of its smallest gradients in its first steps: 0.11 of
    # the distance moved after 4 rounds here (float16 rounding: 0.04).
    assert gap < 0.2 * moved, (gap, moved)
