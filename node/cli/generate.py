"""``swarmtrain generate``: sample text from an exported model (``--model``: no swarm
needed) or from a live run's stages (``--run``: one inference forward through the
pipeline per token, each stage on a peer that routing picks as it does for training;
nothing is trained, kept or counted toward a step).

Tokens are bytes. Both ways stream them to stdout as they are drawn, as UTF-8 text (a
byte that does not make one shows as U+FFFD), and draw alike
(``models.generate.Sampler``), so at temperature 0 a run's text is its export's text
(while its weights stay as they were, and with activations sent uncompressed).
"""

from __future__ import annotations

import argparse
import codecs
import sys
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import torch

from models.generate import Sampler, sample
from models.hf_export import load_hf
from models.stages import Stage
from node.cli.client import client_dht
from node.daemon.join import join_run, member_invite
from node.pipeline.trainer import StageRouter, TrainerError, TrainerSettings
from node.rpc.dht import SwarmDHT
from node.rpc.membership import read_invite
from protocol.ownership import check_run_id


def prompt_tokens(prompt: str, vocab_size: int) -> torch.Tensor:
    """The token ids (T,) of ``prompt``: its UTF-8 bytes. ``ValueError`` if it is empty or
    the model's vocabulary lacks a byte of it."""
    data = prompt.encode()
    if not data:
        raise ValueError("--prompt is empty: give some text to continue")
    if max(data) >= vocab_size:
        raise ValueError(f"the model's vocabulary has {vocab_size} tokens: too few for bytes")
    return torch.tensor(list(data), dtype=torch.long)


def sample_text(
    model_dir: Path, prompt: str, max_new_tokens: int, *, temperature: float = 1.0, seed: int = 0
) -> Iterator[bytes]:
    """The bytes an exported model (``swarmtrain export``) writes after ``prompt``, one
    token (a byte) at a time; the same ``seed`` gives the same text. Bad input raises
    here, before the first byte."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    config, state = load_hf(model_dir)
    model = Stage(config)
    model.load_state_dict(state)
    model.eval()
    tokens = sample(
        model.logits,
        prompt_tokens(prompt, config.vocab_size),
        max_new_tokens,
        block_size=config.block_size,
        temperature=temperature,
        generator=torch.Generator().manual_seed(seed),
    )
    return (bytes([token]) for token in tokens)


def sample_swarm(
    router: StageRouter,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    seed: int = 0,
) -> AsyncIterator[bytes]:
    """The bytes the run's stages write after ``prompt``, one token (a byte) at a time:
    each one inference forward through the pipeline (``StageRouter.logits``), drawn as
    ``sample_text`` draws. Bad input raises here, before the first byte; while it runs,
    ``TrainerError`` naming the stage when one has had no serving peer for the router's
    ``stage_wait_s``."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    model = router.spec.model
    sampler = Sampler(
        prompt_tokens(prompt, model.vocab_size),
        block_size=model.block_size,
        temperature=temperature,
        generator=torch.Generator().manual_seed(seed),
    )

    async def tokens() -> AsyncIterator[bytes]:
        for _ in range(max_new_tokens):
            logits = await router.logits(sampler.window())  # (1, vocab)
            yield bytes([sampler.draw(logits[0])])

    return tokens()


class _Text:
    """Drawn bytes to stdout as UTF-8 text: each character as soon as its last byte is
    drawn, and a byte that makes none as U+FFFD (a model's bytes need not be UTF-8)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, data: bytes, final: bool = False) -> None:
        out = sys.stdout.buffer  # UTF-8 whatever the locale says
        out.write(self._decoder.decode(data, final).encode())
        out.flush()  # a token is shown as soon as it is drawn

    def end(self) -> None:
        self.write(b"\n", final=True)


async def _generate(dht: SwarmDHT, args: argparse.Namespace) -> int:
    invite = member_invite(read_invite(args.invite), args.owner_key, dht.peer_id)
    joined = await join_run(dht, invite, spec_timeout_s=args.timeout)
    p2p = await dht.replicate_p2p()
    text = _Text()
    try:
        settings = TrainerSettings(stage_wait_s=args.timeout)
        router = StageRouter(dht, p2p, joined.spec, settings, membership=joined.membership)
        tokens = sample_swarm(
            router, args.prompt, args.max_new_tokens, temperature=args.temperature, seed=args.seed
        )
        text.write(args.prompt.encode())
        async for token in tokens:
            text.write(token)
        text.end()
    except TrainerError as e:
        text.end()
        print(f"swarmtrain generate: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        await p2p.shutdown()
    return 0


def _from_swarm(args: argparse.Namespace) -> int:
    import uvloop

    check_run_id(args.run)
    if not args.initial_peers:
        raise ValueError("--run needs --initial-peers: the address of a node of the run")
    with client_dht(args, args.run, identity=args.identity) as dht:
        return uvloop.run(_generate(dht, args))


def run(args: argparse.Namespace) -> int:
    if args.run is not None:
        return _from_swarm(args)
    if args.initial_peers or args.invite is not None:
        raise ValueError("--initial-peers and --invite go with --run, not --model")
    tokens: Iterable[bytes] = sample_text(
        args.model, args.prompt, args.max_new_tokens, temperature=args.temperature, seed=args.seed
    )
    text = _Text()
    text.write(args.prompt.encode())
    for token in tokens:
        text.write(token)
    text.end()
    return 0
