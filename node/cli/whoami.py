"""``swarmtrain id``: this machine's peer id in a run, from the identity file its node
uses (created if missing, as the node would), so that the owner of a private run can
invite it before it first joins."""

from __future__ import annotations

import argparse

from node.files import default_identity_path, load_or_create_key
from protocol.identity import peer_id_of
from protocol.records import check_run_name


def run(args: argparse.Namespace) -> int:
    check_run_name(args.run)
    key = load_or_create_key(args.identity or default_identity_path(args.run))
    print(peer_id_of(key.public_key()))
    return 0
