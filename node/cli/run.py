"""``swarmtrain run create|invite|revoke``: what a run's owner does, with the owner key.

``create`` writes the run's signed spec to a file (nodes start from it with ``--spec``)
and records it beside the owner key (``runs/RUN_ID.spec.json``): a run's spec never
changes, so creating it again with other settings is refused. Its model is a preset, or
a local Hugging Face checkpoint (``--from-pretrained DIR``: the spec pins its files'
hashes; every node needs its own copy, ``swarmtrain node --pretrained DIR``).
``--dry-run`` writes nothing and prints what each stage needs in memory. ``invite`` prints an
invite token for a private run; ``revoke`` publishes, through a node of the run, the
owner's signed list of revoked peers and invites. Both need the owner's existing key.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import get_dht_time

from models.config import ModelConfig
from models.stages import StageRange, even_boundaries
from node.cli.args import DEFAULT_OWNER_KEY, DEFAULT_PRESET
from node.cli.client import client_dht
from node.daemon.join import owned_spec
from node.files import load_or_create_key, write_atomic
from node.rpc.dht import SwarmDHT
from protocol.identity import decode_private_key, peer_id_of, resolve_peer_prefix
from protocol.membership import Revocations, issue_invite, parse_invite_token, sign_revocations
from protocol.ownership import check_owner
from protocol.records import RecordError, check_peer_id
from protocol.run_spec import (
    AveragingSpec,
    PretrainedSpec,
    make_run_spec,
    spec_file_text,
)

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``30m``, ``12h`` or ``7d``; ``ValueError`` for anything else,
    a bare number included (it would be ambiguous)."""
    m = _DURATION.match(text.strip())
    if m is None or float(m.group(1)) <= 0:
        hint = (
            f" (did you mean {text.strip()}h or {text.strip()}d?)" if text.strip().isdigit() else ""
        )
        raise ValueError(f"duration {text!r} needs a unit: e.g. 90s, 30m, 12h or 7d{hint}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def load_owner_key(path: Path, action: str) -> Ed25519PrivateKey:
    """The owner's existing key at ``path``, to ``action`` (e.g. "invite"); ``ValueError``
    if there is none (only the run's owner may: no key is created here) or it does not
    parse."""
    path = path.expanduser()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(
            f"no owner key at {path}: only the run's owner can {action} (give its key with "
            "--owner-key)"
        ) from None
    except OSError as e:
        raise ValueError(f"cannot read the owner key {path}: {e.strerror}") from None
    try:
        return decode_private_key(raw)
    except ValueError as e:
        raise ValueError(f"the owner key {path} is not a valid key: {e}") from None


def run(args: argparse.Namespace) -> int:
    return {"create": _create, "invite": _invite, "revoke": _revoke}[args.action](args)


def _create(args: argparse.Namespace) -> int:
    model, optim, pretrained = None, None, None
    what = args.preset or DEFAULT_PRESET
    if args.from_pretrained is not None:
        if args.preset is not None:
            raise ValueError("--preset and --from-pretrained both give the model: choose one")
        from models.config import finetune
        from models.pretrained import read_checkpoint

        checkpoint = read_checkpoint(args.from_pretrained)
        model, optim = checkpoint.config, finetune()
        pretrained = PretrainedSpec(
            architecture=checkpoint.architecture, tied=checkpoint.tied, files=checkpoint.files
        )
        what = f"{checkpoint.architecture} from {args.from_pretrained}"
    if args.boundary_rank is not None:
        from models.config import preset

        if args.from_pretrained is not None:
            raise ValueError("--boundary-rank trains a model from its initial weights, not "
                             "from --from-pretrained")  # fmt: skip
        model = dataclasses.replace(model or preset(what)[0], boundary_rank=args.boundary_rank)
    if args.dry_run:
        from models.config import preset

        model = model or preset(what)[0]
        for line in memory_table(model, even_boundaries(model, args.stages)):
            print(line)
        return 0
    if args.data is None and (args.tokenizer is not None or args.data_out is not None):
        raise ValueError("--tokenizer and --data-out go with --data PATH...")
    key = load_or_create_key(args.owner_key)
    out = args.out or Path(f"{args.name}.spec.json")
    data = {} if args.data is None else _shards(args, model, out)
    averaging = AveragingSpec(
        mode=args.averaging,
        inner_steps=args.inner_steps,
        compression=args.averaging_compression,
        density=args.averaging_density,
        overlap=args.averaging_overlap,
        speculate=args.averaging_speculate,
    )
    spec = make_run_spec(
        args.name,
        args.preset or DEFAULT_PRESET,
        args.stages,
        owner=peer_id_of(key.public_key()),
        model=model,
        optim=optim,
        pretrained=pretrained,
        compression=args.compression,
        averaging=averaging,
        private=args.private,
        max_staleness=args.max_staleness,
        **data,
    )
    signed = owned_spec(args.owner_key, key, spec)
    write_atomic(out, spec_file_text(signed).encode())
    kind = "private" if spec.private else "public"
    again = "" if signed.spec.created == spec.created else " (it existed: the same spec)"
    print(f"created {kind} run {spec.run} ({what}, {spec.n_stages} stages){again}: {out}")
    key_flag = "" if args.owner_key == DEFAULT_OWNER_KEY else f" --owner-key {args.owner_key}"
    copy = "" if pretrained is None else f" --pretrained {args.from_pretrained}"
    if spec.dataset is not None:
        copy += f" --data {_data_dir(args, out)}"
    print(f"start its first node with: swarmtrain node --spec {out}{key_flag}{copy}")
    if pretrained is not None:
        print("every node needs its own copy of the checkpoint (--pretrained DIR): its files")
        print(f"are checked against the run's hashes ({', '.join(sorted(pretrained.files))})")
    if spec.dataset is not None:
        shards = len(spec.dataset.train) + len(spec.dataset.val)
        print(f"every trainer needs its own copy of the {shards} data shards (--data DIR): they")
        print("are checked against the run's hashes before training")
    if spec.private:
        print(f"invite a machine with:    swarmtrain run invite --run {spec.run} --peer PEER_ID")
    return 0


def _data_dir(args: argparse.Namespace, spec_file: Path) -> Path:
    """Where ``--data``'s shards go: ``--data-out``, or ``NAME-data`` beside the spec file."""
    return args.data_out or spec_file.parent / f"{args.name}-data"


def _shards(args: argparse.Namespace, model: ModelConfig | None, spec_file: Path) -> dict:
    """Tokenize ``--data`` into shards (``node.data.write_dataset``) with ``--tokenizer``,
    else a ``--from-pretrained`` checkpoint's own, else bytes, after checking it suits the
    model; the ``RunSpec`` fields that record them."""
    from models.config import preset
    from models.tokenizer import TOKENIZER_FILE, load_tokenizer
    from node.data import SHARDS, write_dataset
    from protocol.run_spec import check_vocabulary

    model = model or preset(args.preset or DEFAULT_PRESET)[0]
    tokenizer = args.tokenizer
    if tokenizer is None and args.from_pretrained is not None:
        tokenizer = args.from_pretrained / TOKENIZER_FILE  # its own, unless told otherwise
        if not tokenizer.is_file():
            raise ValueError(
                f"the checkpoint {args.from_pretrained} has no {TOKENIZER_FILE}: give the "
                "tokenizer its data is cut with (--tokenizer FILE)"
            )
    check_vocabulary(load_tokenizer(tokenizer).vocab_size, model.vocab_size)
    where = _data_dir(args, spec_file)
    dataset = write_dataset(
        args.data,
        where,
        text_field=args.text_field,
        tokenizer=tokenizer,
        min_tokens=model.block_size + 2,
    )
    tokens = sum(s.tokens for s in dataset.train)
    print(f"wrote {len(dataset.train)} training and {len(dataset.val)} validation shards "
          f"({tokens:,} training tokens) to {where}")  # fmt: skip
    return {"data": SHARDS, "dataset": dataset}


def memory_table(model: ModelConfig, stages: Sequence[StageRange]) -> list[str]:
    """Lines showing what training each stage holds (float32 weights, gradients, AdamW's
    two moments), and what that leaves out (activations)."""
    from models.memory import GIB, stage_memory

    rows = [("stage", "blocks", "parameters", "weights", "gradients", "AdamW", "total", "bytes")]
    for i, r in enumerate(stages):
        m = stage_memory(model, r)
        gib = [f"{b / GIB:.2f} GiB" for b in (m.weights, m.gradients, m.optimizer, m.total)]
        rows.append((str(i), f"{r.start}-{r.end - 1}", f"{m.parameters:,}", *gib, f"{m.total:,}"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return [
        *lines,
        f"float32, per peer of a stage (block 0: the embedding; {model.n_blocks - 1}: the head).",
        "Activations come on top: they grow with the micro-batch and the context (bf16",
        "autocast on CUDA halves them). Nothing was written.",
    ]


def _invite(args: argparse.Namespace) -> int:
    expires = time.time() + parse_duration(args.expires)
    if args.peer is not None:
        try:
            check_peer_id(args.peer)
        except ValueError as e:
            raise ValueError(
                f"--peer {args.peer!r} is not a peer id ({e}): a node prints its id "
                "(12D3KooW...) when it starts"
            ) from None
    key = load_owner_key(args.owner_key, args.action)
    _check_owner(args.run, key, args.action)
    token = issue_invite(key, args.run, expires=expires, peer_id=args.peer)
    if args.out is not None:
        write_atomic(args.out, (token + "\n").encode(), mode=0o600)
    invite = parse_invite_token(token, owner=peer_id_of(key.public_key())).invite
    until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(invite.expires))
    holder = args.peer or "any one machine (bearer)"
    print(
        f"invite {invite.invite_id} for {holder}, valid until {until}; "
        f"revoke with --invite-id {invite.invite_id}",
        file=sys.stderr,
    )
    print(token)
    return 0


def _check_owner(run: str, key: Ed25519PrivateKey, action: str) -> None:
    try:
        check_owner(run, key.public_key())
    except RecordError as e:
        raise ValueError(f"{e}: only the run's owner can {action}") from None


def _revoke(args: argparse.Namespace) -> int:
    key = load_owner_key(args.owner_key, args.action)
    _check_owner(args.run, key, args.action)
    if not args.peer and not args.invite_id:
        raise ValueError("say what to revoke: --peer PEER_ID ... and/or --invite-id ID ...")
    with client_dht(args, args.run) as dht:
        return asyncio.run(_publish_revocations(dht, key, args))


async def _full_peer_ids(dht: SwarmDHT, given: list[str]) -> list[str]:
    """``--peer`` values as whole peer ids: a unique prefix (as ``status`` shows ids) is
    completed from the run's peers in the DHT; ``ValueError`` if none or several match."""
    result, known = [], None
    for peer in given:
        try:
            check_peer_id(peer)
        except ValueError:  # RecordError, IdentityError: not a whole peer id
            if known is None:
                known = [p.peer_id for p in await dht.peers()]
            peer = resolve_peer_prefix(peer, known)
        result.append(peer)
    return result


async def _publish_revocations(dht: SwarmDHT, key, args: argparse.Namespace) -> int:
    found = await dht.revocations()
    old = found[0] if found else None
    peers = await _full_peer_ids(dht, args.peer)
    revocations = Revocations(
        run=args.run,
        owner=peer_id_of(key.public_key()),
        peers=tuple(sorted({*(old.peers if old else ()), *peers})),
        invites=tuple(sorted({*(old.invites if old else ()), *args.invite_id})),
        issued=max(get_dht_time(), old.issued + 1e-3 if old else 0.0),
    )
    if not await dht.publish_revocations(revocations, sign_revocations(key, revocations)):
        raise RuntimeError("no peer of the run stored the revocations; is a node reachable?")
    print(f"revoked {len(revocations.peers)} peers and {len(revocations.invites)} invites "
          f"of run {args.run}")  # fmt: skip
    return 0
