"""Stage servers on real hivemind P2P daemons (loopback): the pipeline they compute is the
local one, gradients accumulate as in ``models.training``, and bad requests are refused
without touching state, and callers refused again and again are banned for a while."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P, P2PHandlerError
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from models.config import ModelConfig
from models.stages import Stage, StageRange, validate_boundaries
from models.training import StageOptimizer, pipeline_loss
from node.measure.bandwidth import BandwidthProbe, measure_bandwidth
from node.pipeline import client as stage_client
from node.pipeline import lowbit
from node.pipeline import server as server_module
from node.pipeline.client import StageBusy, StageRefused, StageTimeout, StageUnavailable
from node.pipeline.server import SESSION, StageServer, stage_namespace
from node.pipeline.wire import Encoded, serialize
from node.rpc.membership import MembershipGate, present
from node.rpc.service import BAN_AFTER, BAN_WINDOW_S
from protocol.admission import AdmissionLimits, InFlight
from protocol.identity import peer_id_of
from protocol.membership import MembershipPolicy, issue_invite, parse_invite_token
from protocol.ownership import make_run_id
from protocol.routing import BanList
from protocol.stage_messages import (
    BACKWARD,
    FORWARD,
    MAX_METADATA_BYTES,
    StageMeta,
)
from tests.stage_rig import (
    CFG,
    LOOPBACK,
    OPT,
    RUN,
    THREE,
    TWO,
    B,
    _assert_same,
    _batch,
    _patient,
    _run,
    _swarm,
    _tensor,
)


def _peer(server: StageServer):
    return server.peer_id


def _local(cut: tuple[StageRange, ...]) -> list[Stage]:
    return [Stage(CFG, r) for r in cut]


def _grads(stage: Stage) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in stage.named_parameters()}


def _params(stage: Stage) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in stage.named_parameters()}


def test_pipeline_over_rpc_equals_local_pipeline():
    x, y = _batch()
    local = _local(THREE)
    h0 = local[0](x)
    h0.retain_grad()
    h1 = local[1](h0)
    h1.retain_grad()
    ref = local[2](h1, y)
    (ref * B).backward()
    assert torch.equal(ref, pipeline_loss(_local(THREE), x, y))

    async def body():
        # s1a serves the middle stage's forward, s1b (same initial weights) its backward.
        async with _swarm(THREE, [0, 1, 1, 2]) as (client, (s0, s1a, s1b, s2)):
            kw = {"run_id": RUN, "micro_batch": 7}
            a0 = await stage_client.forward(client, _peer(s0), x, stage=0, **kw)
            a1 = await stage_client.forward(client, _peer(s1a), a0, stage=1, **kw)
            assert torch.equal(a0, h0) and torch.equal(a1, h1)

            loss, grad = await stage_client.loss(
                client, _peer(s2), a1, y, stage=2, train=False, **kw
            )
            assert torch.equal(loss, ref) and grad is None
            assert all(g is None for g in _grads(s2.stage).values())  # evaluation: no grads

            loss, g1 = await stage_client.loss(client, _peer(s2), a1, y, stage=2, train=True, **kw)
            assert torch.equal(loss, ref) and torch.equal(g1, h1.grad)
            g0 = await stage_client.backward(client, _peer(s1b), a0, g1, stage=1, **kw)
            assert torch.equal(g0, h0.grad)
            none = await stage_client.backward(client, _peer(s0), x, g0, stage=0, **kw)
            assert none is None

            for server, ref_stage in [(s0, local[0]), (s1b, local[1]), (s2, local[2])]:
                _assert_same(_grads(server.stage), _grads(ref_stage))
                assert server.optimizer.samples == B
            assert all(g is None for g in _grads(s1a.stage).values())  # it only ran forward
            # The instance that ran the forward computes the same backward.
            g0_again = await stage_client.backward(client, _peer(s1a), a0, g1, stage=1, **kw)
            assert torch.equal(g0_again, g0)
            _assert_same(_grads(s1a.stage), _grads(s1b.stage))

            assert s1a.counters.forward == 1 and s1a.counters.backward == 1
            assert s2.counters.forward == 2 and s2.counters.backward == 1
            assert s0.load == 0 and s0.counters.rejected == 0

    _run(body())


def test_an_inference_forward_gives_the_models_logits_and_trains_nothing():
    """Generation's forward (``infer``) through the stages: the last stage returns the
    local model's logits at each sequence's last position, exact; no stage accumulates a
    sample or counts it as a training or validation forward, and a stage whose step's
    batch is committed does not hold it back."""
    x, _ = _batch()
    local = _local(THREE)
    with torch.no_grad():
        ref = local[2].logits(local[1](local[0](x)))[:, -1]  # (B, vocab)

    async def body():
        async with _swarm(THREE, [0, 1, 2]) as (client, (s0, s1, s2)):
            kw = {"run_id": RUN, "micro_batch": 1}
            # Stage 0's batch (8 samples) is committed: training forwards would wait now.
            for mb in (10, 11):
                await stage_client.forward(client, _peer(s0), x, stage=0, train=True,
                                           run_id=RUN, micro_batch=mb)  # fmt: skip
            assert s0.committed_samples() == OPT.target_batch_size
            async with asyncio.timeout(2.0):  # below HOLD_S: not held
                h = await stage_client.forward(client, _peer(s0), x, stage=0, infer=True, **kw)
            h = await stage_client.forward(client, _peer(s1), h, stage=1, infer=True, **kw)
            logits = await stage_client.logits(
                client, _peer(s2), h, stage=2, vocab_size=CFG.vocab_size, **kw
            )
            assert torch.equal(logits, ref)
            assert s0.counters.held == 0 and s0.counters.forward == 2  # the training ones
            assert s0.committed_samples() == OPT.target_batch_size
            for server in (s1, s2):
                assert server.counters.forward == server.counters.backward == 0
                assert server.optimizer.samples == 0
                assert all(g is None for g in _grads(server.stage).values())
            assert [s.counters.inferred for s in (s0, s1, s2)] == [1, 1, 1]
            with pytest.raises(StageUnavailable, match="malformed response"):  # wrong vocab
                await stage_client.logits(client, _peer(s2), h, stage=2, vocab_size=7, **kw)

    _run(body())


def test_one_peer_serves_two_stages_side_by_side():
    """Two stage servers on one P2P (a two-stage peer): each stage's requests reach its
    own server, and the pipeline through them computes what one process does."""
    x, y = _batch()
    local = _local(TWO)
    ref = local[1](local[0](x), y)

    async def body():
        async with _swarm(TWO, [0, 1], shared=True) as (client, (s0, s1)):
            assert _peer(s0) == _peer(s1)
            kw = {"run_id": RUN, "micro_batch": 3}
            a = await stage_client.forward(client, _peer(s0), x, stage=0, **kw)
            loss, g = await stage_client.loss(client, _peer(s1), a, y, stage=1, train=True, **kw)
            assert torch.equal(loss, ref.detach())
            await stage_client.backward(client, _peer(s0), x, g, stage=0, **kw)
            assert (s0.counters.forward, s0.counters.backward) == (1, 1)
            assert (s1.counters.forward, s1.counters.backward) == (1, 1)  # loss, train
            assert s0.optimizer.samples == s1.optimizer.samples == B

    _run(body())


def test_a_peer_calls_its_own_stages_in_process():
    """libp2p does not dial its own peer id, so a node's own trainer calls its servers
    in-process (``local=``): the same checks and result as over the network, the kept
    graph reused, bad requests refused alike."""
    x, y = _batch()
    local = _local(TWO)
    ref = local[1](local[0](x), y)

    async def body():
        async with _swarm(TWO, [0, 1], shared=True) as (_, (s0, s1)):
            own, me = s0.p2p, _peer(s0)
            kw = {"run_id": RUN, "micro_batch": 3}
            with pytest.raises(StageUnavailable):  # what the network path does to itself
                await stage_client.forward(own, me, x, stage=0, timeout=5, **kw)
            a = await stage_client.forward(own, me, x, stage=0, train=True, local=s0, **kw)
            loss, g = await stage_client.loss(own, me, a, y, stage=1, train=True, local=s1, **kw)
            assert torch.equal(loss, ref.detach())
            await stage_client.backward(own, me, x, g, stage=0, local=s0, **kw)
            assert (s0.counters.forward, s0.counters.backward, s0.counters.reused) == (1, 1, 1)
            assert s0.optimizer.samples == s1.optimizer.samples == B
            # Admission as for a remote caller: with the step's batch committed (B
            # accumulated, B open), a further training forward waits for the step.
            await stage_client.forward(
                own, me, x, stage=0, train=True, local=s0, run_id=RUN, micro_batch=4
            )
            held = asyncio.ensure_future(
                stage_client.forward(
                    own, me, x, stage=0, train=True, local=s0, run_id=RUN, micro_batch=5
                )
            )
            while s0.counters.waiting == 0:
                await asyncio.wait({held}, timeout=0.02)
                assert not held.done()
            await stage_client.backward(own, me, x, g, stage=0, local=s0, run_id=RUN, micro_batch=4)
            await held
            assert s0.counters.steps == 1 and s0.counters.held == 1
            assert s0.counters.overdue == 0
            await stage_client.backward(own, me, x, g, stage=0, local=s0, run_id=RUN, micro_batch=5)
            assert s0.optimizer.samples == B
            with pytest.raises(StageRefused):  # token ids out of the vocabulary
                await stage_client.forward(own, me, x + CFG.vocab_size, stage=0, local=s0, **kw)
            assert s0.counters.rejected == 1 and s0.optimizer.samples == B
            await s0.shutdown()
            with pytest.raises(StageUnavailable):  # shut down (a move): try another peer
                await stage_client.forward(own, me, x, stage=0, local=s0, **kw)

    _run(body())


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_training_forward_waits_while_its_stage_has_a_step_pending(max_staleness):
    """Two training micro-batches make up stage 0's batch (8 samples): with
    ``max_staleness`` 0 a third one waits until their backwards came and the stage stepped,
    so that it runs on the stepped parameters (and the two kept their graphs); with 1 it
    runs at once, on the parameters before the step, and its gradient goes into the next."""
    x, _ = _batch()
    g = torch.randn(B, CFG.block_size, CFG.n_embd, generator=torch.Generator().manual_seed(1))
    opt = dataclasses.replace(OPT, max_staleness=max_staleness)

    class Server(StageServer):
        def __init__(self, stage, optimizer, *args, **kw):
            super().__init__(stage, StageOptimizer(stage, opt), *args, **kw)

    async def body():
        async with _swarm(TWO, [0], server_cls=Server) as (client, (server,)):
            kw = {"run_id": RUN, "stage": 0}
            peer = _peer(server)
            before = _params(server.stage)
            for k in (1, 2):
                await stage_client.forward(client, peer, x, micro_batch=k, train=True, **kw)
            third = asyncio.ensure_future(
                stage_client.forward(client, peer, x, micro_batch=3, train=True, **kw)
            )
            if max_staleness == 0:
                while server.counters.waiting == 0:  # received, and held
                    await asyncio.wait({third}, timeout=0.02)
                    assert not third.done()
            else:
                await third
            for k in (1, 2):
                await stage_client.backward(client, peer, x, g, micro_batch=k, **kw)
            out = await third
            assert server.counters.steps == 1 and server.counters.reused == 2
            local = _local(TWO)[0]
            local.load_state_dict(before if max_staleness else _params(server.stage))
            with torch.no_grad():
                assert torch.equal(out, local(x))
            assert server.counters.held == (1 if max_staleness == 0 else 0)
            assert server.counters.overdue == 0

    _run(body())


def test_a_forward_kept_for_its_backward_gives_what_a_recompute_gives():
    """A forward marked ``train`` keeps its graph, and the backward sent to the same peer
    skips the recompute; the gradients are bitwise those of a peer that recomputes. Changed
    parameters, other inputs, or a graph dropped for room make the peer recompute."""
    x, _ = _batch()
    h0 = _local(THREE)[0](x).detach()
    g1 = torch.randn(h0.shape, generator=torch.Generator().manual_seed(1))

    async def body():
        async with _swarm(THREE, [1, 1], keep_graphs=2) as (client, (kept, other)):
            kw = {"run_id": RUN, "stage": 1}

            async def forward(k: int, inputs=h0) -> torch.Tensor:
                peer = _peer(kept)
                return await stage_client.forward(
                    client, peer, inputs, micro_batch=k, train=True, **kw
                )

            async def backward(k: int, inputs=h0) -> torch.Tensor:
                both = [
                    await stage_client.backward(client, _peer(s), inputs, g1, micro_batch=k, **kw)
                    for s in (kept, other)
                ]
                assert torch.equal(both[0], both[1])
                return both[0]

            out = await forward(1)
            assert torch.equal(out, await stage_client.forward(client, _peer(other), h0, **kw))
            await backward(1)
            assert kept.counters.reused == 1 and other.counters.reused == 0
            _assert_same(_grads(kept.stage), _grads(other.stage))
            await forward(2)
            await backward(2)  # 8 samples: both step, alike
            assert kept.counters.reused == 2 and kept.counters.steps == 1
            _assert_same(_params(kept.stage), _params(other.stage))

            await forward(3)
            for server in (kept, other):  # as an averaging round would
                with server.lock, torch.no_grad():
                    next(server.stage.parameters()).mul_(0.5)
            await backward(3)
            await forward(4)
            await backward(4, inputs=h0 * 2)
            assert kept.counters.reused == 2  # both recomputed
            for k in (5, 6, 7):
                await forward(k)
            await backward(5)  # dropped: only the 2 latest are kept
            assert kept.counters.reused == 2
            await backward(7)
            assert kept.counters.reused == 3 and kept.counters.backward == 6
            _assert_same(_grads(kept.stage), _grads(other.stage))

    _run(body())


# Tolerances: the activations' error (their std is about 0.03), the loss's, and the least
# cosine of the gradients to the exact ones (int4's stochastic rounding measured 0.991).
@pytest.mark.parametrize(
    "compression,atol,loss_tol,cos_min",
    [("float16", 1e-4, 1e-4, 0.99), ("uint8", 1e-2, 5e-3, 0.99), ("int4", 2e-2, 1e-2, 0.97)],
)
def test_compressed_activations_and_gradients(compression, atol, loss_tol, cos_min):
    x, y = _batch()
    local = _local(TWO)
    h = local[0](x)
    h.retain_grad()
    ref = local[1](h, y)
    (ref * B).backward()

    async def body():
        async with _swarm(TWO, [0, 1]) as (client, (s0, s1)):
            for server in (s0, s1):
                server.compression = compression
            kw = {"run_id": RUN, "compression": compression}
            a = await stage_client.forward(client, _peer(s0), x, stage=0, **kw)
            loss, g = await stage_client.loss(client, _peer(s1), a, y, stage=1, train=True, **kw)
            await stage_client.backward(client, _peer(s0), x, g, stage=0, **kw)
            assert not torch.equal(a, h)  # compression did change the activations
            torch.testing.assert_close(a, h, rtol=0, atol=atol)
            assert abs(float(loss) - float(ref.detach())) < loss_tol
            cos = torch.nn.functional.cosine_similarity(g.flatten(), h.grad.flatten(), dim=0)
            assert cos > cos_min
            for server, ref_stage in [(s0, local[0]), (s1, local[1])]:
                for name, p in server.stage.named_parameters():
                    r = dict(ref_stage.named_parameters())[name].grad
                    cos = torch.nn.functional.cosine_similarity(
                        p.grad.flatten(), r.flatten(), dim=0
                    )
                    assert cos > cos_min - 0.01, (name, float(cos))

    _run(body())


@pytest.mark.parametrize("keep", [True, False])
def test_a_boundary_kept_encoded_reaches_the_next_stage_as_it_was_sent(keep, monkeypatch):
    """With ``keep_encoded`` (a trainer's calls) int4 hidden states and gradients go on from
    stage to stage as they came: the caller neither decodes nor encodes one (without it, it does
    both for each), and the middle stage's backward still gets its forward's inputs and
    reuses the kept graph."""
    x, y = _batch()
    caller_codecs: list[str] = []  # int4 decodes and encodes run on the caller's thread
    caller = threading.get_ident()

    def counted(name: str):
        real = getattr(lowbit, name)

        def call(*args):
            if threading.get_ident() == caller:
                caller_codecs.append(name)
            return real(*args)

        return call

    for name in ("encode", "decode"):
        monkeypatch.setattr(lowbit, name, counted(name))

    async def body():
        async with _swarm(THREE, [0, 1, 2]) as (client, (s0, s1, s2)):
            for server in (s0, s1, s2):
                server.compression = "int4"
            kw = {"run_id": RUN, "compression": "int4", "micro_batch": 3, "keep_encoded": keep}
            a0 = await stage_client.forward(client, _peer(s0), x, stage=0, train=True, **kw)
            a1 = await stage_client.forward(client, _peer(s1), a0, stage=1, train=True, **kw)
            assert isinstance(a0, Encoded) == isinstance(a1, Encoded) == keep
            loss, g1 = await stage_client.loss(client, _peer(s2), a1, y, stage=2, train=True, **kw)
            assert isinstance(g1, Encoded) == keep and float(loss) > 0
            g0 = await stage_client.backward(client, _peer(s1), a0, g1, stage=1, **kw)
            assert await stage_client.backward(client, _peer(s0), x, g0, stage=0, **kw) is None
            assert s0.counters.reused == s1.counters.reused == 1
            assert all(s.optimizer.samples == B for s in (s0, s1, s2))

    _run(body())
    if keep:
        assert caller_codecs == []
    else:  # a0 decoded, sent twice; a1, g1, g0 decoded and sent once each
        assert caller_codecs.count("decode") == 4 and caller_codecs.count("encode") == 5


def test_server_steps_at_target_batch_size():
    local = _local(TWO)
    local_opts = [StageOptimizer(s, OPT) for s in local]

    async def body():
        async with _swarm(TWO, [0, 1]) as (client, (s0, s1)):
            before = _params(s0.stage)
            for mb in range(OPT.target_batch_size // B):
                assert s0.optimizer.step_count == 0 and s1.optimizer.step_count == 0
                x, y = _batch(seed=mb)
                kw = {"run_id": RUN, "micro_batch": mb}
                a = await stage_client.forward(client, _peer(s0), x, stage=0, **kw)
                _, g = await stage_client.loss(client, _peer(s1), a, y, stage=1, train=True, **kw)
                await stage_client.backward(client, _peer(s0), x, g, stage=0, **kw)

                (pipeline_loss(local, x, y) * B).backward()
                for o in local_opts:
                    o.accumulated(B)
            for o in local_opts:
                o.step()

            for server, ref_stage in [(s0, local[0]), (s1, local[1])]:
                assert server.counters.steps == 1 and server.counters.samples == 0
                assert all(g is None for g in _grads(server.stage).values())
                _assert_same(_params(server.stage), _params(ref_stage))
            changed = [n for n, p in _params(s0.stage).items() if not torch.equal(p, before[n])]
            assert len(changed) == len(before)

    _run(body())


def test_activations_beyond_the_unary_limit_travel_by_stream():
    # A stage that is only the embedding: 96 x 64 x 256 float32 = 6 MiB of activations
    # each way, over the 4 MiB a unary message may hold, for next to no compute.
    wide = ModelConfig(block_size=64, n_layer=1, n_head=2, n_embd=256, vocab_size=16)
    cut = validate_boundaries(wide, [(0, 1), (1, 3)])
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, wide.vocab_size, (96, wide.block_size), generator=g)
    with torch.no_grad():
        ref = Stage(wide, cut[0])(x)
    grad_out = torch.randn(ref.shape, generator=g)

    async def body():
        async with _swarm(cut, [0], cfg=wide, max_tokens=x.numel()) as (client, (s0,)):
            h = await stage_client.forward(client, _peer(s0), x, run_id=RUN, stage=0)
            assert h.numel() * 4 > 4 * 2**20 and torch.equal(h, ref)
            await stage_client.backward(client, _peer(s0), x, grad_out, run_id=RUN, stage=0)
            assert s0.counters.backward == 1 and s0.counters.steps == 1  # 96 >= 8 samples

    _run(body())


def test_bad_requests_are_refused_and_leave_state_alone(caplog):
    x, y = _batch()
    hidden = torch.randn(B, CFG.block_size, CFG.n_embd)
    nan_hidden = hidden.clone()
    nan_hidden[1, 2, 3] = float("nan")
    far = x.clone()
    far[0, 0] = 300

    def meta(stage, kind=FORWARD, **over):
        return StageMeta(over.pop("run_id", RUN), stage, kind, 1, **over).encode()

    s = serialize
    # (name, stage, kind, metadata, tensors, expected words in the error)
    cases = [
        ("wrong shape", 1, FORWARD, meta(1), [s(hidden[..., :16]), s(y)], "(B, T, 32), got"),
        ("wrong dtype", 1, FORWARD, meta(1), [s(hidden.double()), s(y)], "dtype float32, got"),
        ("NaN input", 1, FORWARD, meta(1), [s(nan_hidden), s(y)], "1 non-finite"),
        (
            "NaN grad_outputs",
            0,
            BACKWARD,
            meta(0, BACKWARD),
            [s(x), s(nan_hidden)],
            "grad_outputs contain 1 non-finite",
        ),
        (
            "grads overflow",
            0,
            BACKWARD,
            meta(0, BACKWARD),
            [s(x), s(torch.full_like(hidden, 3e38))],
            "gradients have",
        ),
        ("token out of range", 0, FORWARD, meta(0), [s(far)], "id 300, out of range [0, 256)"),
        ("too many tokens", 0, FORWARD, meta(0), [s(_batch(B + 1)[0])], "80 tokens exceed"),
        (
            "huge declared shape",
            0,
            FORWARD,
            meta(0),
            [_tensor("int64", [10**6, 16], b"\0" * 8)],
            "16000000 tokens exceed",
        ),
        (
            "targets do not match",
            1,
            FORWARD,
            meta(1),
            [s(hidden), s(y[:2])],
            "do not match the inputs",
        ),
        ("missing targets", 1, FORWARD, meta(1), [s(hidden)], "carries 2 tensors"),
        ("extra tensor", 0, FORWARD, meta(0), [s(x), s(x)], "got more"),
        ("wrong stage", 0, FORWARD, meta(1), [s(x)], "request for stage 1"),
        ("wrong run", 0, FORWARD, meta(0, run_id="other"), [s(x)], "request for run 'other'"),
        ("kind mismatch", 0, BACKWARD, meta(0), [s(x)], "a forward request sent to"),
        ("backward at last", 1, BACKWARD, meta(1, BACKWARD), [s(hidden), s(hidden)], "last"),
        (
            "garbage tensor",
            0,
            FORWARD,
            meta(0),
            [_tensor("int64", [B, 16], b"garbage")],
            "has 7 bytes, its header declares 512",
        ),
        ("unknown dtype", 0, FORWARD, meta(0), [_tensor("object", [B, 16])], "got object"),
        (
            "compressed token ids",
            0,
            FORWARD,
            meta(0),
            [serialize_torch_float16(x)],
            "compression ['NONE'], got FLOAT16",
        ),
        ("malformed metadata", 0, FORWARD, b"\xc1\x00garbage", [s(x)], "malformed metadata"),
        ("metadata not a map", 0, FORWARD, msgpack.packb([1, 2]), [s(x)], "must be a map"),
        (
            "unknown metadata key",
            0,
            FORWARD,
            msgpack.packb({"run": RUN, "stage": 0, "kind": FORWARD, "mb": 1, "x": 1}),
            [s(x)],
            "unknown metadata keys ['x']",
        ),
        (
            "oversized metadata",
            0,
            FORWARD,
            msgpack.packb({"run": "r" * MAX_METADATA_BYTES}),
            [s(x)],
            "exceeds the limit of 256",
        ),
        ("no metadata", 0, FORWARD, b"", [s(x)], "must carry metadata"),
    ]

    async def body():
        caplog.set_level(logging.WARNING, logger="node.rpc.service")
        async with _swarm(TWO, [0, 1], callers=_patient()) as (client, (s0, s1)):
            # One good micro-batch first, so that there are gradients to keep intact.
            a = await stage_client.forward(client, _peer(s0), x, run_id=RUN, stage=0)
            _, g = await stage_client.loss(client, _peer(s1), a, y, run_id=RUN, stage=1, train=True)
            await stage_client.backward(client, _peer(s0), x, g, run_id=RUN, stage=0)
            servers = {0: s0, 1: s1}
            state = {i: (_params(v.stage), _grads(v.stage)) for i, v in servers.items()}

            for name, stage, kind, metadata, tensors, words in cases:
                peer = _peer(servers[stage])
                # a session serves the kind a request declares; a kind's own handler checks it
                stage_client.reuse_streams(client, name != "kind mismatch")
                with pytest.raises(StageRefused) as info:
                    await stage_client.call(
                        client, peer, kind, metadata, tensors, stage=stage, timeout=10
                    )
                assert words in info.value.reason, (name, info.value.reason)
                assert not info.value.retry_elsewhere

            for i, server in servers.items():
                _assert_same(_params(server.stage), state[i][0])
                _assert_same(_grads(server.stage), state[i][1])
                assert server.optimizer.samples == B and server.load == 0
            assert s0.counters.rejected + s1.counters.rejected == len(cases)
            logged = [r.getMessage() for r in caplog.records if r.name == "node.rpc.service"]
            assert len(logged) == len(cases)
            assert all(f"from {client.peer_id}" in line for line in logged), logged[:2]
            assert s0.counters.backward == 1 and s1.counters.backward == 1
            # Still serving.
            a2 = await stage_client.forward(client, _peer(s0), x, run_id=RUN, stage=0)
            assert torch.equal(a2, a)

    _run(body())


def serialize_torch_float16(t: torch.Tensor) -> runtime_pb2.Tensor:
    wire = serialize(t.float(), "float16")
    wire.dtype = "int64"
    return wire


class _StalledServer(StageServer):
    """Fault: the compute thread hangs until ``release`` is set."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def _compute(self, *args):
        self.release.wait(timeout=30)
        return super()._compute(*args)


def test_timeout_and_unreachable_peer_are_retryable():
    x, _ = _batch()

    async def body():
        async with _swarm(TWO, [0, 0], server_cls=_StalledServer) as (client, (stalled, gone)):
            try:
                with pytest.raises(StageTimeout) as info:
                    await stage_client.forward(
                        client, _peer(stalled), x, run_id=RUN, stage=0, timeout=0.5
                    )
                assert info.value.retry_elsewhere
            finally:
                stalled.release.set()
                gone.release.set()

            gone_id = _peer(gone)
            await gone.p2p.shutdown()
            with pytest.raises(StageUnavailable) as info:
                await stage_client.forward(client, gone_id, x, run_id=RUN, stage=0, timeout=10)
            assert info.value.retry_elsewhere and not isinstance(info.value, StageTimeout)

    _run(body())


def test_a_caller_refused_again_and_again_is_banned_for_a_while(caplog):
    x, _ = _batch()
    bad = StageMeta("other", 0, FORWARD, 1).encode()
    kw = {"run_id": RUN, "stage": 0, "timeout": 10}

    async def body():
        caplog.set_level(logging.WARNING, logger="node.rpc.service")
        bans = BanList(duration_s=2.0, strikes=BAN_AFTER, window_s=BAN_WINDOW_S)
        async with _swarm(TWO, [0], callers=bans) as (client, (s0,)):
            other = await P2P.create(
                host_maddrs=[LOOPBACK], initial_peers=await s0.p2p.get_visible_maddrs()
            )
            try:
                for _ in range(BAN_AFTER):
                    with pytest.raises(StageRefused, match="run 'other'"):
                        await stage_client.call(
                            client, s0.peer_id, FORWARD, bad, [serialize(x)], stage=0
                        )
                banned_at = time.monotonic()
                with pytest.raises(StageUnavailable, match="banned until") as info:
                    await stage_client.forward(client, s0.peer_id, x, **kw)
                assert info.value.retry_elsewhere and time.monotonic() - banned_at < 1
                assert s0.counters.rejected == BAN_AFTER  # refused unread: not counted again
                await stage_client.forward(other, s0.peer_id, x, **kw)  # others are served
                logged = [r.getMessage() for r in caplog.records if "banned" in r.getMessage()]
                assert len(logged) == 1 and str(client.peer_id) in logged[0], logged

                deadline = banned_at + 10
                while True:  # served again once the ban ends
                    try:
                        await stage_client.forward(client, s0.peer_id, x, **kw)
                        break
                    except StageUnavailable as e:
                        assert "banned" in e.reason and time.monotonic() < deadline, e.reason
                        await asyncio.sleep(0.2)
                assert time.monotonic() - banned_at > 1.5
            finally:
                await other.shutdown()

    _run(body())


def test_a_caller_banned_by_one_service_of_a_node_is_refused_by_all():
    """A node's services share one ban list: bad bandwidth probes (unary calls) get their
    caller's stage requests refused, and its good probes too; other callers are served."""
    x, _ = _batch()
    kw = {"run_id": RUN, "stage": 0, "timeout": 10}
    bans = BanList(duration_s=60.0, strikes=BAN_AFTER, window_s=BAN_WINDOW_S)

    async def body():
        async with _swarm(TWO, [0], callers=bans) as (client, (s0,)):
            probe = await BandwidthProbe.create(s0.p2p, max_bytes=1024, callers=bans)
            other = await P2P.create(
                host_maddrs=[LOOPBACK], initial_peers=await s0.p2p.get_visible_maddrs()
            )
            try:
                await stage_client.forward(client, s0.peer_id, x, **kw)  # served before
                stub = BandwidthProbe.get_stub(client, s0.peer_id)
                oversized = runtime_pb2.ExpertRequest(metadata=bytes(2048))
                for _ in range(BAN_AFTER):
                    with pytest.raises(P2PHandlerError, match="an upload of 2048 bytes"):
                        await stub.rpc_upload(oversized)
                with pytest.raises(StageUnavailable, match="banned until"):
                    await stage_client.forward(client, s0.peer_id, x, **kw)
                with pytest.raises(P2PHandlerError, match="banned until"):
                    await stub.rpc_upload(runtime_pb2.ExpertRequest(metadata=bytes(16)))
                assert probe.refusals == BAN_AFTER  # the banned call never reached it
                await stage_client.forward(other, s0.peer_id, x, **kw)
                assert await measure_bandwidth(other, s0.peer_id, nbytes=1024)
            finally:
                await other.shutdown()
                await probe.shutdown()

    _run(body())


def test_refused_invites_count_toward_a_ban_and_admission_forgives_them():
    """The membership gate counts a refused proof against its caller, in the node's ban
    list: a stranger forging proofs is banned, even from presenting a good one later; an
    invited peer whose proofs were refused (a stale one, say) is forgiven once admitted."""
    owner_key = Ed25519PrivateKey.generate()
    owner = peer_id_of(owner_key.public_key())
    run = make_run_id("lab", owner)
    policy = MembershipPolicy(run, owner, private=True)
    bans = BanList(duration_s=60.0, strikes=BAN_AFTER, window_s=BAN_WINDOW_S)

    async def body():
        server = await P2P.create(host_maddrs=[LOOPBACK])
        gate = await MembershipGate.create(server, lambda: policy, bans)
        maddrs = await server.get_visible_maddrs()
        honest = await P2P.create(host_maddrs=[LOOPBACK], initial_peers=maddrs)
        forger = await P2P.create(host_maddrs=[LOOPBACK], initial_peers=maddrs)
        token = issue_invite(owner_key, run, expires=get_dht_time() + 600)

        def proof(p2p: P2P) -> str:
            return parse_invite_token(token, owner=owner).proof(p2p.peer_id.to_base58())

        async def refused(p2p: P2P, match: str = "not a member") -> None:
            with pytest.raises(P2PHandlerError, match=match):
                await present(p2p, server.peer_id, "not a proof")

        try:
            for _ in range(BAN_AFTER - 1):
                await refused(honest)
            await present(honest, server.peer_id, proof(honest))
            for _ in range(BAN_AFTER - 1):
                await refused(honest)
            await present(honest, server.peer_id, proof(honest))  # forgiven: not banned
            for _ in range(BAN_AFTER):
                await refused(forger)
            with pytest.raises(P2PHandlerError, match="banned until"):
                await present(forger, server.peer_id, proof(forger))
            assert gate.refusal(forger.peer_id.to_base58()) is not None
        finally:
            await gate.shutdown()
            for p2p in (forger, honest, server):
                await p2p.shutdown()

    _run(body())


async def _until(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_calls_reuse_their_streams_and_a_refusal_ends_only_its_session():
    x, _ = _batch()
    kw = {"run_id": RUN, "stage": 0, "timeout": 30}
    bad = StageMeta("other", 0, FORWARD, 1).encode()

    async def body():
        async with _swarm(TWO, [0], callers=_patient()) as (client, (s0,)):
            first = await stage_client.forward(client, s0.peer_id, x, **kw)
            for _ in range(4):
                assert torch.equal(await stage_client.forward(client, s0.peer_id, x, **kw), first)
            assert (s0.counters.forward, s0.counters.sessions) == (5, 1)
            # calls in flight at once take a stream each: the idle one, and two new ones
            calls = [stage_client.forward(client, s0.peer_id, x, **kw) for _ in range(3)]
            await asyncio.gather(*calls)
            assert (s0.counters.forward, s0.counters.sessions, s0.open_sessions) == (8, 3, 3)

            # a refused request ends its session (closed, never reused); the others serve on
            with pytest.raises(StageRefused, match="run 'other'"):
                await stage_client.call(client, s0.peer_id, FORWARD, bad, [serialize(x)], stage=0)
            await _until(lambda: s0.open_sessions == 2, "the refused session to end")
            await stage_client.forward(client, s0.peer_id, x, **kw)
            assert (s0.counters.forward, s0.counters.rejected, s0.counters.sessions) == (9, 1, 3)

            # one stream per call: the rpc_forward handler, no session
            stage_client.reuse_streams(client, False)
            try:
                assert torch.equal(await stage_client.forward(client, s0.peer_id, x, **kw), first)
            finally:
                stage_client.reuse_streams(client, True)
            assert (s0.counters.forward, s0.counters.sessions) == (10, 3)
            await _until(lambda: s0.open_sessions == 0, "the client's idle sessions to close")

    _run(body())


def test_a_session_the_server_idled_out_is_replaced_without_a_failure(monkeypatch):
    monkeypatch.setattr(server_module, "SESSION_IDLE_S", 0.5)
    x, _ = _batch()
    kw = {"run_id": RUN, "stage": 0, "timeout": 30}

    async def body():
        async with _swarm(TWO, [0]) as (client, (s0,)):
            await stage_client.forward(client, s0.peer_id, x, **kw)
            assert s0.open_sessions == 1
            await _until(lambda: s0.open_sessions == 0, "the idle session to be closed")
            await stage_client.forward(client, s0.peer_id, x, **kw)  # on a new stream
            assert (s0.counters.forward, s0.counters.sessions) == (2, 2)

    _run(body())


def test_a_session_the_caller_leaves_idle_closes_on_both_sides(monkeypatch):
    """No further call comes: the caller closes its idle stream after ``IDLE_S``, the
    server's session ends with it (long before its own ``SESSION_IDLE_S``), and a later
    call opens a new session without a failure."""
    monkeypatch.setattr(stage_client, "IDLE_S", 0.5)
    x, _ = _batch()
    kw = {"run_id": RUN, "stage": 0, "timeout": 30}

    async def body():
        async with _swarm(TWO, [0]) as (client, (s0,)):
            first = await stage_client.forward(client, s0.peer_id, x, **kw)
            assert s0.open_sessions == 1
            await _until(lambda: s0.open_sessions == 0, "the caller to close its idle session")
            assert torch.equal(await stage_client.forward(client, s0.peer_id, x, **kw), first)
            assert (s0.counters.forward, s0.counters.sessions) == (2, 2)

    _run(body())


def test_a_caller_holds_at_most_its_share_of_sessions():
    x, _ = _batch()
    kw = {"run_id": RUN, "stage": 0, "timeout": 30}
    in_flight = InFlight(AdmissionLimits(per_caller=2, total=4, first_s=60.0))

    async def body():
        async with _swarm(TWO, [0], in_flight=in_flight) as (client, (s0,)):
            handle = StageServer.handle_name(stage_namespace(0), SESSION)
            held = [await client.call_binary_stream_handler(s0.peer_id, handle) for _ in range(2)]
            await _until(lambda: s0.open_sessions == 2, "two idle sessions")
            with pytest.raises(StageBusy, match="2 sessions open"):
                await stage_client.forward(client, s0.peer_id, x, **kw)
            held.pop()[2].close()
            await _until(lambda: s0.open_sessions == 1, "a session to end")
            await stage_client.forward(client, s0.peer_id, x, **kw)
            assert (s0.counters.forward, s0.counters.shed) == (1, 1)
            for _, _, writer in held:
                writer.close()

    _run(body())


def test_a_session_that_sends_nothing_is_closed_after_first_s():
    in_flight = InFlight(AdmissionLimits(first_s=0.5))

    async def body():
        async with _swarm(TWO, [0], in_flight=in_flight) as (client, (s0,)):
            handle = StageServer.handle_name(stage_namespace(0), SESSION)
            _, _, writer = await client.call_binary_stream_handler(s0.peer_id, handle)
            try:
                await _until(lambda: s0.counters.sessions == 1, "the session to open")
                await _until(lambda: s0.open_sessions == 0, "the silent session to close", 10)
            finally:
                writer.close()

    _run(body())
