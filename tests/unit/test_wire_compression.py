"""Grouped low-bit compression of stage boundaries (``int4``, ``int2``): what it keeps of a
tensor, what it costs on the wire, and what it refuses."""

from __future__ import annotations

import math
import struct
import typing

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.proto import runtime_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from node.cli import args
from node.limits import stage_bytes_per_sample
from node.pipeline import lowbit, wire
from node.pipeline.wire import (
    Assembler,
    Encoded,
    deserialize,
    generic_header_check,
    received,
    serialize,
    split_message,
)
from protocol.identity import peer_id_of
from protocol.run_spec import Compression, make_run_spec
from protocol.stage_messages import (
    BACKWARD,
    LOWBIT_GROUP,
    BackwardRequest,
    StageContract,
    StageMeta,
    StageRequestError,
    check_header,
    parse_request,
    wire_nbytes,
)
from tests.stage_rig import CFG, MAX_TOKENS, THREE

LOWBIT = {"int4": 4, "int2": 2}
OWNER = peer_id_of(Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key())
MIDDLE = StageContract.for_stage(CFG, THREE[1], 1, max_tokens=MAX_TOKENS)


def _hidden(shape=(3, 5, 32), seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3 + 1


def _wire(setting: str, buffer: bytes, shape) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(
        buffer=buffer, size=shape, dtype="float32", compression=wire.COMPRESSIONS[setting]
    )


@pytest.mark.parametrize("setting", sorted(LOWBIT))
@pytest.mark.parametrize("shape", [(3, 5, 32), (2, 7, 64), (1, 1, 1), (2, 3, 100)])
def test_round_trip_keeps_shape_and_each_value_within_one_step(setting, shape):
    x = _hidden(shape)
    sent = serialize(x, setting)
    numel = math.prod(shape)
    name = wire.compression_name(sent.compression)
    assert name == lowbit.wire_name(LOWBIT[setting])
    assert len(sent.buffer) == wire_nbytes(name, "float32", numel)
    y = deserialize(sent)
    assert y.shape == x.shape and y.dtype == torch.float32
    groups = -(-numel // LOWBIT_GROUP)
    padded = torch.cat([x.reshape(-1), torch.zeros(groups * LOWBIT_GROUP - numel)])
    rows = padded.view(groups, LOWBIT_GROUP)
    step = (rows.amax(1) - rows.amin(1)) / (2 ** LOWBIT[setting] - 1)  # (groups,)
    error = (y.reshape(-1) - x.reshape(-1)).abs()
    bound = step.repeat_interleave(LOWBIT_GROUP)[:numel] * (1 + 1e-5) + 1e-6
    assert bool((error <= bound).all())


@pytest.mark.parametrize("setting", sorted(LOWBIT))
def test_constant_groups_and_zeros_travel_exactly(setting):
    x = torch.full((2, 4, 64), 0.375)
    x[1] = 0.0
    assert torch.equal(deserialize(serialize(x, setting)), x)


@pytest.mark.parametrize("setting", sorted(LOWBIT))
def test_stochastic_rounding_is_unbiased(setting):
    # The mean of many decodings converges to the tensor itself (nearest rounding would
    # keep an error of up to half a step on every value, whatever the number of draws).
    x = _hidden((1, 1, 64))
    n = 2000
    copies = x.expand(n, 1, 64)  # one group each: n independent roundings of x
    g = torch.Generator().manual_seed(0)
    decoded = lowbit.decode(lowbit.encode(copies, LOWBIT[setting], g), LOWBIT[setting], (n, 1, 64))
    mean = decoded.mean(dim=0, keepdim=True)
    step = float((x.amax() - x.amin()) / (2 ** LOWBIT[setting] - 1))
    # The standard error of the mean is at most step / (2 sqrt(n)); allow ~5 of them.
    assert float((mean - x).abs().max()) < 5 * step / (2 * math.sqrt(n))
    assert float((mean - x).abs().max()) < 0.1 * step


def test_rounding_draws_nothing_from_the_global_generator():
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    serialize(_hidden(), "int4")
    assert torch.equal(torch.rand(4), expected)


def test_bytes_per_value_against_the_other_settings():
    x = _hidden((8, 64, 384))
    size = {s: len(serialize(x, s).buffer) for s in wire.COMPRESSIONS}
    assert size["none"] == 4 * x.numel()
    assert size["int4"] == x.numel() // 64 * (8 + 32)  # 5 bits a value
    assert size["int2"] == x.numel() // 64 * (8 + 16)  # 3 bits a value
    assert size["none"] > size["float16"] > size["uint8"] > size["int4"] > size["int2"]


@pytest.mark.parametrize("setting", sorted(LOWBIT))
def test_a_backward_request_travels_through_the_servers_checks(setting):
    # The path of a request at a middle stage: header checks with exact byte counts while
    # the chunks arrive, then decoding and the request's own checks.
    inputs, grads = _hidden((4, 16, 32), 1), _hidden((4, 16, 32), 2) * 1e-6
    meta = StageMeta("rpc-test", 1, BACKWARD, 5)
    sent = [serialize(inputs, setting), serialize(grads, setting)]
    roles = MIDDLE.roles(BACKWARD)
    batch = None

    def check(index: int, header: runtime_pb2.Tensor) -> int:
        nonlocal batch
        batch, nbytes = check_header(
            MIDDLE, roles[index], dtype=header.dtype, shape=tuple(header.size),
            compression=wire.compression_name(header.compression), batch=batch,
        )  # fmt: skip
        return nbytes

    assembler = Assembler(MIDDLE.max_message_bytes, check)
    for message in split_message(runtime_pb2.ExpertRequest, meta.encode(), sent):
        # as bytes on the stream: our compression codes survive protobuf's parsing
        assembler.add(runtime_pb2.ExpertRequest.FromString(message.SerializeToString()))
    assert assembler.complete(2)
    request = parse_request(MIDDLE, meta, [deserialize(t) for t in assembler.tensors()])
    assert isinstance(request, BackwardRequest)
    # gradients a million times smaller than activations keep their own scale
    relative = (request.grad_outputs - grads).norm() / grads.norm()
    assert float(relative) < (0.2 if setting == "int4" else 0.8)


@pytest.mark.parametrize("setting", sorted(LOWBIT))
def test_a_buffer_of_the_wrong_size_is_refused(setting):
    x = _hidden()
    good = serialize(x, setting).buffer
    for buffer in (good[:-1], good + b"\0", b""):
        with pytest.raises(StageRequestError, match="bytes"):
            deserialize(_wire(setting, buffer, x.shape))
    # a receiver counting chunks refuses the extra byte before it decodes anything
    check = generic_header_check(2**20)
    assembler = Assembler(2**20, check)
    too_long = _wire(setting, good + b"\0", x.shape)
    with pytest.raises(StageRequestError, match="more than the"):
        for message in split_message(runtime_pb2.ExpertResponse, b"m", [too_long]):
            assembler.add(message)


@pytest.mark.parametrize("setting", sorted(LOWBIT))
@pytest.mark.parametrize(
    ("lo", "step"),
    [
        (math.nan, 1.0),
        (math.inf, 1.0),
        (0.0, math.nan),
        (0.0, math.inf),
        (0.0, -1.0),
        (3e38, 3e38),
    ],  # fmt: skip
)
def test_non_finite_or_negative_group_parameters_are_refused(setting, lo, step):
    x = _hidden((1, 1, 64))
    good = serialize(x, setting).buffer
    bad = struct.pack("<ff", lo, step) + good[8:]
    with pytest.raises(StageRequestError, match="not finite|non-finite|negative"):
        deserialize(_wire(setting, bad, x.shape))


@pytest.mark.parametrize("setting", sorted(LOWBIT))
def test_non_finite_activations_are_refused_on_arrival(setting):
    x = _hidden()
    x[0, 0, 0] = math.nan
    with pytest.raises(StageRequestError):
        deserialize(serialize(x, setting))


def test_header_checks_know_the_new_compressions_only_for_floats():
    check = generic_header_check(2**20)
    header = runtime_pb2.Tensor(dtype="float32", size=[2, 64], compression=104)
    assert check(0, header) == 2 * (8 + 32)
    with pytest.raises(StageRequestError, match="compression"):
        check(0, runtime_pb2.Tensor(dtype="int64", size=[2, 64], compression=104))
    with pytest.raises(StageRequestError, match="unknown compression 103"):
        check(0, runtime_pb2.Tensor(dtype="float32", size=[2, 64], compression=103))
    with pytest.raises(StageRequestError, match="token ids may be sent with compression"):
        first = StageContract.for_stage(CFG, THREE[0], 0, max_tokens=MAX_TOKENS)
        check_header(first, "inputs", dtype="int64", shape=(2, 16), compression="GROUPED_4BIT")


def test_token_ids_travel_exact_whatever_the_setting():
    ids = torch.arange(12).reshape(3, 4)
    assert torch.equal(deserialize(serialize(ids, "int2")), ids)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(st.sampled_from(sorted(LOWBIT)), st.lists(st.integers(1, 70), min_size=1, max_size=3),
       st.data())  # fmt: skip
def test_any_buffer_of_the_declared_size_decodes_or_is_refused(setting, shape, data):
    numel = math.prod(shape)
    name = lowbit.wire_name(LOWBIT[setting])
    n = wire_nbytes(name, "float32", numel)
    buffer = data.draw(st.binary(min_size=n, max_size=n))
    try:
        t = deserialize(_wire(setting, buffer, shape))
    except StageRequestError as e:
        assert str(e)
        return
    assert tuple(t.shape) == tuple(shape) and bool(torch.isfinite(t).all())


def test_the_spec_takes_the_new_settings_and_refuses_other_bit_widths():
    assert set(typing.get_args(Compression)) == set(wire.COMPRESSIONS) == set(args.COMPRESSIONS)
    spec = make_run_spec("zip", "tiny", 2, owner=OWNER, compression="int4")
    assert spec.compression == "int4"
    for bad in ("int3", "int8", "int1", "int16"):
        with pytest.raises(ValidationError, match="compression"):
            make_run_spec("zip", "tiny", 2, owner=OWNER, compression=bad)


def test_planned_bytes_follow_the_setting():
    sent = {
        c: stage_bytes_per_sample(make_run_spec("zip", "tiny", 2, owner=OWNER, compression=c), 0)
        for c in ("uint8", "int4")
    }
    assert sent["uint8"][0] > sent["int4"][0]


@pytest.mark.parametrize("setting", sorted(LOWBIT))
def test_finite_values_whose_range_overflows_float32_travel(setting):
    x = torch.tensor([3e38, -3e38, 1.0, 0.0] * 16).reshape(1, 1, 64)
    y = deserialize(serialize(x, setting))
    step = 6e38 / (2 ** LOWBIT[setting] - 1)
    assert bool(torch.isfinite(y).all()) and float((y - x).abs().max()) <= step * (1 + 1e-5)


@pytest.mark.parametrize("setting", ["int4", "int2", "uint8"])
def test_a_tensor_kept_encoded_goes_on_in_the_bytes_it_came_in(setting):
    x = _hidden((2, 3, 100))
    sent = serialize(x, setting)
    kept = received(sent, keep_encoded=True)
    assert isinstance(kept, Encoded) and kept.shape == x.shape
    assert kept.is_floating_point()
    assert serialize(kept, setting) is sent  # the same encoding: as it came
    assert torch.equal(kept.decode(), deserialize(sent))
    again = serialize(kept, "none")  # another encoding: decoded, then encoded
    assert torch.equal(deserialize(again), deserialize(sent))
    assert torch.equal(received(sent), deserialize(sent))  # not kept: decoded


@pytest.mark.parametrize("setting", ["int4", "uint8"])
@pytest.mark.parametrize("shape", [(), (5,), (2, 64)])
def test_only_hidden_states_and_their_gradients_are_kept_encoded(setting, shape):
    """A loss (a scalar) or any tensor not shaped (B, T, W) is decoded, whatever its
    encoding: the caller reads it (``float(loss)``), it passes nothing on."""
    sent = serialize(torch.full(shape, 2.5), setting)
    got = received(sent, keep_encoded=True)
    assert isinstance(got, torch.Tensor) and torch.equal(got, deserialize(sent))


@pytest.mark.parametrize("setting", ["none", "float16"])
def test_exact_encodings_and_token_ids_are_decoded_even_when_keeping(setting):
    sent = serialize(_hidden(), setting)
    assert torch.equal(received(sent, keep_encoded=True), deserialize(sent))
    ids = torch.arange(12).reshape(3, 4)
    assert torch.equal(received(serialize(ids, setting), keep_encoded=True), ids)


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(st.sampled_from(sorted(LOWBIT)), st.lists(st.integers(1, 12), min_size=3, max_size=3),
       st.data())  # fmt: skip
def test_a_buffer_kept_encoded_is_one_that_decodes_finite(setting, shape, data):
    """Keeping a tensor encoded checks only the groups' minima and steps, never decoding:
    what it keeps must decode to finite values (what the next stage checks of them), or the caller
    would pass a bad peer's answer on and the next stage would refuse the caller."""
    name = lowbit.wire_name(LOWBIT[setting])
    n = wire_nbytes(name, "float32", math.prod(shape))
    edges = [0.0, 1.0, -2.5, 1e37, 2.3e37, -3e38, 3.4e38, math.inf, -math.inf, math.nan]
    floats = st.one_of(st.sampled_from(edges), st.floats(width=32))
    groups = -(-math.prod(shape) // LOWBIT_GROUP)
    params = data.draw(st.lists(floats, min_size=2 * groups, max_size=2 * groups))
    head = struct.pack(f"<{2 * groups}f", *params)
    buffer = head + data.draw(st.binary(min_size=n - len(head), max_size=n - len(head)))
    try:
        kept = received(_wire(setting, buffer, shape), keep_encoded=True)
    except StageRequestError:
        return
    assert bool(torch.isfinite(kept.decode()).all())


def test_an_8bit_codebook_with_a_non_finite_entry_is_not_kept_encoded():
    sent = serialize(_hidden(), "uint8")
    bad = bytearray(sent.buffer)
    bad[8:12] = struct.pack("<f", math.nan)
    with pytest.raises(StageRequestError, match="non-finite"):
        received(_wire("uint8", bytes(bad), sent.size), keep_encoded=True)
