"""A low-rank stage boundary (``ModelConfig.boundary_rank``, ``models.boundary``): the cut
model computes the whole model exactly, exports as a plain model, and its requests carry
the token ids and are refused at the wrong width."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from models.boundary import fold
from models.config import ModelConfig, preset
from models.hf_export import from_hf, to_hf
from models.memory import stage_memory
from models.stages import Stage, even_boundaries
from node.limits import stage_bytes_per_sample
from node.pipeline.executor import StageExecutor
from node.pipeline.wire import deserialize, narrow_ids, serialize
from protocol.identity import peer_id_of
from protocol.run_spec import PretrainedSpec, make_run_spec
from protocol.stage_messages import (
    BACKWARD,
    FORWARD,
    GRAD_OUTPUTS,
    INPUTS,
    TARGETS,
    TOKENS,
    StageContract,
    StageMeta,
    StageRequestError,
    check_header,
    parse_request,
)

RANK = 12
GPT = dataclasses.replace(
    ModelConfig(block_size=16, n_layer=3, n_head=2, n_embd=32), boundary_rank=RANK
)
LLAMA = dataclasses.replace(preset("llama-tiny")[0], block_size=16, boundary_rank=RANK)
OWNER = peer_id_of(Ed25519PrivateKey.generate().public_key())


def _perturbed(config: ModelConfig) -> dict[str, torch.Tensor]:
    """A whole model's state that is not its initial one (writes outside the trained
    coordinates would show)."""
    whole = Stage(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in whole.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return whole.state_dict()


def _cut(config: ModelConfig, state: dict, n: int) -> list[Stage]:
    stages = [Stage(config, r) for r in even_boundaries(config, n)]
    for s in stages:
        s.load_state_dict({k: v for k, v in state.items() if k in s.state_dict()})
    return stages


def _data(config: ModelConfig, b: int = 3):
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, config.vocab_size, (b, config.block_size), generator=g)
    return x, torch.randint(0, config.vocab_size, (b, config.block_size), generator=g)


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
def test_a_cut_model_sends_rank_values_and_computes_the_whole_model(config):
    state = _perturbed(config)
    (whole,) = _cut(config, state, 1)
    stages = _cut(config, state, 3)
    x, y = _data(config)
    expected = whole(x, y)
    expected.backward()

    h1 = stages[0](x)
    assert h1.shape == (3, config.block_size, RANK)
    h2 = stages[1](h1, tokens=x)
    assert h2.shape == (3, config.block_size, RANK)
    loss = stages[2](h2, y, tokens=x)
    loss.backward()
    assert torch.allclose(loss, expected, atol=1e-6)
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    for name, p in whole.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-6), name
    assert torch.allclose(stages[2].logits(h2, x), whole.logits(x), atol=1e-5), (
        "generation through the cut is the whole model's"
    )

    with pytest.raises(ValueError, match="token ids"):
        stages[1](h1)
    with pytest.raises(ValueError, match=rf"\(B, T, {RANK}\)"):
        stages[1](torch.zeros(3, config.block_size, config.n_embd), tokens=x)


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
def test_fold_gives_a_plain_model_with_the_same_function(config):
    state = _perturbed(config)
    (whole,) = _cut(config, state, 1)
    plain = Stage(dataclasses.replace(config, boundary_rank=None))
    plain.load_state_dict(fold(state, config))
    x, y = _data(config)
    assert torch.allclose(plain(x, y), whole(x, y), atol=1e-6)
    # the Hugging Face export writes the folded model: read back, it is the plain one
    back = from_hf(to_hf(state, config), dataclasses.replace(config, boundary_rank=None))
    plain.load_state_dict(back)
    assert torch.allclose(plain(x, y), whole(x, y), atol=1e-6)


def test_the_rank_is_checked_and_kept_out_of_a_pretrained_run():
    for bad in (0, 32, 40, 1.5, "8"):
        with pytest.raises(ValueError, match="boundary_rank"):
            dataclasses.replace(GPT, boundary_rank=bad)
    assert (
        GPT.boundary_width == RANK
        and dataclasses.replace(GPT, boundary_rank=None).boundary_width == 32
    )
    assert "boundary_rank" not in dataclasses.replace(GPT, boundary_rank=None).to_dict()
    spec = make_run_spec("r", "tiny", 2, owner=OWNER, model=GPT)
    assert spec.model.boundary_rank == RANK
    files = {"config.json": "0" * 64, "model.safetensors": "1" * 64}
    pretrained = PretrainedSpec(architecture="GPT2LMHeadModel", tied=False, files=files)
    with pytest.raises(ValueError, match="boundary_rank"):
        make_run_spec("r", "tiny", 2, owner=OWNER, model=GPT, pretrained=pretrained)


def test_requests_across_a_low_rank_boundary_carry_the_token_ids():
    first, middle, last = (
        StageContract.for_stage(GPT, r, i) for i, r in enumerate(even_boundaries(GPT, 3))
    )
    assert first.roles(FORWARD) == (INPUTS,) and first.roles(BACKWARD) == (INPUTS, GRAD_OUTPUTS)
    assert middle.roles(FORWARD) == (INPUTS, TOKENS)
    assert middle.roles(BACKWARD) == (INPUTS, GRAD_OUTPUTS, TOKENS)
    assert last.roles(FORWARD) == (INPUTS, TARGETS, TOKENS)
    assert last.roles(FORWARD, infer=True) == (INPUTS, TOKENS)
    one = dataclasses.replace(GPT, boundary_rank=1)  # the widest requests fit the byte limit
    tokens = 32 * one.block_size
    widest = tokens * max(4 + 8 + 8, 2 * 4 + 8)  # states, targets, ids; states, grads, ids
    assert StageContract.for_stage(one, last.blocks, 2).max_message_bytes >= widest

    _, n = check_header(middle, INPUTS, dtype="float32", shape=(2, 16, RANK), compression="NONE")
    assert n == 2 * 16 * RANK * 4
    with pytest.raises(StageRequestError, match=rf"hidden states \(B, T, {RANK}\), got"):
        check_header(middle, INPUTS, dtype="float32", shape=(2, 16, 32), compression="NONE")
    with pytest.raises(StageRequestError, match="compression"):
        check_header(middle, TOKENS, dtype="int64", shape=(2, 16), compression="FLOAT16")

    x, y = _data(GPT, 2)
    h = torch.randn(2, 16, RANK)
    request = parse_request(last, StageMeta("r", 2, FORWARD, 0, train=True), [h, y, x])
    assert request.targets is y and torch.equal(request.tokens, x)
    # the token ids travel in a byte each (a byte-level vocabulary), widened on receipt
    narrow = narrow_ids(x)
    assert narrow.dtype == torch.uint8 and serialize(narrow).ByteSize() < 2 * 16 + 64
    assert narrow_ids(torch.tensor([0, 2**15])).dtype == torch.int32
    header = serialize(narrow)
    _, n = check_header(middle, TOKENS, dtype=header.dtype, shape=(2, 16), compression="NONE")
    assert n == 2 * 16
    request = parse_request(middle, StageMeta("r", 1, FORWARD, 0), [h, deserialize(header)])
    assert request.tokens.dtype == torch.int64 and torch.equal(request.tokens, x)
    with pytest.raises(StageRequestError, match="dtype int64, got uint8"):
        check_header(last, TARGETS, dtype="uint8", shape=(2, 16), compression="NONE")
    with pytest.raises(StageRequestError, match="carries 3 tensors"):
        parse_request(last, StageMeta("r", 2, FORWARD, 0, train=True), [h, y])
    outside = x.clone()
    outside[0, 0] = GPT.vocab_size
    with pytest.raises(StageRequestError, match="out of range"):
        parse_request(middle, StageMeta("r", 1, FORWARD, 0), [h, outside])
    with pytest.raises(StageRequestError, match="do not match"):
        parse_request(middle, StageMeta("r", 1, FORWARD, 0), [h, x[:, :8]])


def test_a_stage_server_executes_a_low_rank_forward_and_its_backward():
    state = _perturbed(GPT)
    stages = _cut(GPT, state, 3)
    reference = _cut(GPT, state, 3)
    contract = StageContract.for_stage(GPT, stages[1].range, 1)
    executor = StageExecutor(stages[1], contract, lambda key, n: None, lock=threading.Lock())
    x, _ = _data(GPT, 2)
    h = torch.randn(2, 16, RANK)
    g = torch.randn(2, 16, RANK)
    forward = parse_request(contract, StageMeta("r", 1, FORWARD, 7, train=True), [h, x])
    (out,) = executor.run(forward, "caller")
    backward = parse_request(contract, StageMeta("r", 1, BACKWARD, 7), [h, g, x])
    (grad_h,) = executor.run(backward, "caller")
    assert executor.reused == 1, "the kept graph served the backward"

    h_ref = h.detach().clone().requires_grad_()
    out_ref = reference[1](h_ref, tokens=x)
    out_ref.backward(g)
    assert torch.allclose(out, out_ref) and torch.allclose(grad_h, h_ref.grad)
    # other token ids with the same hidden states: a recompute, not the kept graph
    executor.run(forward, "caller")
    other = parse_request(contract, StageMeta("r", 1, BACKWARD, 7), [h, g, x.flip(0)])
    executor.run(other, "caller")
    assert executor.reused == 1


def test_memory_counts_the_fixed_columns_every_stage_holds():
    for blocks in even_boundaries(GPT, 2):
        plain = stage_memory(dataclasses.replace(GPT, boundary_rank=None), blocks)
        low = stage_memory(GPT, blocks)
        fixed = (GPT.vocab_size + GPT.block_size) * (GPT.n_embd - RANK)  # wte and wpe columns
        assert (low.parameters, low.fixed) == (plain.parameters, fixed)
        assert low.total == plain.total + 4 * fixed


def test_link_planning_counts_the_rank_and_the_token_ids():
    full = make_run_spec("r", "tiny", 2, owner=OWNER, compression="none")
    low = make_run_spec(
        "r",
        "tiny",
        2,
        owner=OWNER,
        compression="none",
        model=dataclasses.replace(full.model, boundary_rank=16),
    )
    t, c = full.model.block_size, full.model.n_embd
    sent_full, received_full = stage_bytes_per_sample(full, 1)
    sent_low, received_low = stage_bytes_per_sample(low, 1)
    averaging = sent_full - (8 + t * c * 4)  # the last stage: the loss and a gradient out
    assert sent_low == pytest.approx(averaging + 8 + t * 16 * 4)
    assert received_low == pytest.approx(received_full - t * (c - 16) * 4 + t)  # a byte an id
