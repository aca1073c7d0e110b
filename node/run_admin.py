"""``swarmtrain run create|invite|revoke``: what a run's owner does, with the owner key.

``create`` writes the run's signed spec to a file (nodes start from it with ``--spec``);
``invite`` prints an invite token for a private run; ``revoke`` publishes, through a
node of the run, the owner's signed list of revoked peers and invites.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path

from hivemind.utils import get_dht_time

from node.dht import SwarmDHT
from node.files import load_or_create_key, write_atomic
from protocol.identity import peer_id_of
from protocol.membership import Revocations, issue_invite, parse_invite_token, sign_revocations
from protocol.ownership import check_owner
from protocol.run_spec import AveragingSpec, make_run_spec, sign_run_spec, spec_file_text

DEFAULT_OWNER_KEY = Path("~/.swarmtrain/owner.key")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``30m``, ``12h`` or ``7d``."""
    m = _DURATION.match(text.strip())
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"duration {text!r}: write e.g. 3600, 30m, 12h or 7d")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="write a new run's signed spec")
    create.add_argument("name", help="the run's name; its id adds the owner's fingerprint")
    create.add_argument("--preset", default="tiny", help="model preset (tiny, small, base)")
    create.add_argument("--stages", type=int, default=2, help="pipeline stages")
    create.add_argument("--private", action="store_true", help="only invited peers may join")
    create.add_argument("--compression", default="none", choices=["none", "float16", "uint8"])
    create.add_argument("--averaging", default="gradient", choices=["gradient", "diloco"])
    create.add_argument("--inner-steps", type=int, default=50, help="diloco: local steps")
    create.add_argument("--out", type=Path, help="spec file (default NAME.spec.json)")
    _owner_key(create)

    invite = actions.add_parser("invite", help="print an invite token for a private run")
    invite.add_argument("--run", required=True, help="the run's id")
    invite.add_argument("--peer", help="bind the invite to this peer id (default: bearer)")
    invite.add_argument("--expires", default="7d", help="valid for (e.g. 12h, 7d; default 7d)")
    invite.add_argument("--out", type=Path, help="also write the token to this file (0600)")
    _owner_key(invite)

    revoke = actions.add_parser("revoke", help="revoke peers or invites of a private run")
    revoke.add_argument("--run", required=True, help="the run's id")
    revoke.add_argument("--peer", nargs="*", default=[], metavar="PEER_ID")
    revoke.add_argument("--invite-id", nargs="*", default=[], metavar="ID")
    revoke.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR")
    revoke.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"])
    _owner_key(revoke)


def _owner_key(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--owner-key",
        type=Path,
        default=DEFAULT_OWNER_KEY,
        help=f"the owner's key file (default {DEFAULT_OWNER_KEY}; created if missing)",
    )


def run(args: argparse.Namespace) -> int:
    return {"create": _create, "invite": _invite, "revoke": _revoke}[args.action](args)


def _create(args: argparse.Namespace) -> int:
    key = load_or_create_key(args.owner_key)
    averaging = AveragingSpec(mode=args.averaging, inner_steps=args.inner_steps)
    spec = make_run_spec(
        args.name,
        args.preset,
        args.stages,
        owner=peer_id_of(key.public_key()),
        compression=args.compression,
        averaging=averaging,
        private=args.private,
    )
    out = args.out or Path(f"{args.name}.spec.json")
    write_atomic(out, spec_file_text(sign_run_spec(spec, key)).encode())
    kind = "private" if spec.private else "public"
    print(f"created {kind} run {spec.run} ({args.preset}, {spec.n_stages} stages): {out}")
    print(f"start its first node with: swarmtrain node --spec {out} --owner-key {args.owner_key}")
    if spec.private:
        print(f"invite a machine with:    swarmtrain run invite --run {spec.run} --peer PEER_ID")
    return 0


def _invite(args: argparse.Namespace) -> int:
    key = load_or_create_key(args.owner_key)
    check_owner(args.run, key.public_key())
    expires = time.time() + parse_duration(args.expires)
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


def _revoke(args: argparse.Namespace) -> int:
    key = load_or_create_key(args.owner_key)
    check_owner(args.run, key.public_key())
    if not args.peer and not args.invite_id:
        raise ValueError("say what to revoke: --peer PEER_ID ... and/or --invite-id ID ...")
    dht = SwarmDHT.start(
        args.run, initial_peers=args.initial_peers, host_maddrs=args.host_maddrs, client_mode=True
    )
    try:
        return asyncio.run(_publish_revocations(dht, key, args))
    finally:
        dht.shutdown()


async def _publish_revocations(dht: SwarmDHT, key, args: argparse.Namespace) -> int:
    found = await dht.revocations()
    old = found[0] if found else None
    revocations = Revocations(
        run=args.run,
        owner=peer_id_of(key.public_key()),
        peers=tuple(sorted({*(old.peers if old else ()), *args.peer})),
        invites=tuple(sorted({*(old.invites if old else ()), *args.invite_id})),
        issued=max(get_dht_time(), old.issued + 1e-3 if old else 0.0),
    )
    if not await dht.publish_revocations(revocations, sign_revocations(key, revocations)):
        raise RuntimeError("no peer of the run stored the revocations; is a node reachable?")
    print(f"revoked {len(revocations.peers)} peers and {len(revocations.invites)} invites "
          f"of run {args.run}")  # fmt: skip
    return 0
