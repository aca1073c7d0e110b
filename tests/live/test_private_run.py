"""A private run on a real local swarm: invited nodes serve and train; an uninvited node,
an expired invite, a forged spec and a stranger's calls are refused; a revoked peer leaves."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2PHandlerError, PeerID
from hivemind.utils import get_dht_time

from node.cli.train import open_trainer
from node.daemon.join import NodeError
from node.files import load_or_create_key
from node.pipeline import client as stage_client
from node.pipeline.client import StageRefused
from node.pipeline.trainer import TrainerSettings
from node.rpc.dht import SwarmDHT
from node.rpc.membership import present, prove_membership
from protocol.identity import peer_id_of, sign
from protocol.keys import spec_key
from protocol.membership import InviteClaimed, issue_invite
from protocol.records import PeerState
from protocol.run_spec import (
    _SPEC_DOMAIN,
    SignedSpec,
    make_run_spec,
    read_spec_file,
    sign_run_spec,
)
from tests.records import peer_info
from tests.swarm import LOCAL, StatusWatch, cli_error, launch_node, stop_all, wait_until

# A command's deadline: run create and run invite take seconds idle, and ran past 60 s at
# load 20-25 on two cores; the deadline only bounds a hung command.
CLI_TIMEOUT_S = 300


def _cli(*args, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "node.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _peers(view: dict) -> dict[str, dict]:
    return {p["peer_id"]: p for p in view["peers"]}


def _stopped_saying(node, reason: str) -> None:
    """``node`` exits 2 and its one-line error (what the person who started it reads)
    says ``reason``."""
    assert node.proc.wait(120) == 2, node.output()
    error = cli_error(node.output())
    assert error and error[0] == "node" and reason in error[1], node.output()


def test_a_private_run_admits_its_invited_peers_only(tmp_path):
    owner_key, spec_file = tmp_path / "owner.key", tmp_path / "lab.spec.json"
    created = _cli("run", "create", "lab", "--private", "--stages", "2",
                   "--owner-key", owner_key, "--out", spec_file)  # fmt: skip
    run = re.search(r"created private run (\S+)", created.stdout).group(1)
    assert oct(owner_key.stat().st_mode & 0o777) == "0o600"

    b_id = peer_id_of(load_or_create_key(tmp_path / "b.key").public_key())
    invite_b = _cli("run", "invite", "--run", run, "--owner-key", owner_key, "--peer", b_id)
    bearer = _cli("run", "invite", "--run", run, "--owner-key", owner_key, "--expires", "1h")
    key = load_or_create_key(owner_key)
    expired = issue_invite(key, run, expires=time.time() - 60)

    nodes = []
    watch = None
    try:
        # The owner's node starts from the spec file and needs no invite.
        a = launch_node(tmp_path, "a", run, extra=["--spec", spec_file, "--owner-key", owner_key,
                                                    "--stage", "0"])  # fmt: skip
        nodes.append(a)
        b = launch_node(tmp_path, "b", run, initial_peers=[a.maddr],
                        extra=["--invite", invite_b.stdout.strip(), "--stage", "1"])  # fmt: skip
        nodes.append(b)
        assert a.wait_serving() == 0
        watch = StatusWatch(run, a.maddr)
        assert b.wait_serving() == 1

        # Nodes that are not members are refused, with the reason, before they serve; and
        # a spec for this run id signed by anyone but the owner is refused. All start at
        # once: they wait on I/O at start.
        forged = tmp_path / "forged.spec.json"
        forged.write_text(_forged_spec_text(spec_file))
        uninvited = launch_node(tmp_path, "c", run, initial_peers=[a.maddr], wait=False)
        late = launch_node(tmp_path, "d", run, initial_peers=[a.maddr], wait=False,
                           extra=["--invite", expired])  # fmt: skip
        stolen = launch_node(tmp_path, "e", run, initial_peers=[a.maddr], wait=False,
                             extra=["--invite", invite_b.stdout.strip()])  # fmt: skip
        impostor = launch_node(tmp_path, "f", run, wait=False, extra=["--spec", forged])
        nodes += [uninvited, late, stolen, impostor]
        _stopped_saying(uninvited, "is private: start with --invite")
        _stopped_saying(late, "expired")
        _stopped_saying(stolen, "this invite is for peer")
        _stopped_saying(impostor, "does not belong to owner")

        asyncio.run(_stranger_and_member(run, a, b, bearer.stdout.strip()))
        peers = _peers(watch.view())
        assert set(peers) == {a.peer_id, b.peer_id}, "only members are listed"

        # The owner revokes b: b stops, saying why, and drops out of the run's view.
        _cli("run", "revoke", "--run", run, "--owner-key", owner_key, "--peer", b_id,
             "--initial-peers", a.maddr, "--host-maddrs", LOCAL)  # fmt: skip
        _stopped_saying(b, "no longer a member")
        assert "revoked" in cli_error(b.output())[1]
        watch.wait(lambda v: b.peer_id not in _peers(v), 30, "b to leave the view")
    finally:
        if watch is not None:
            watch.close()
        stop_all(nodes)


async def _stranger_and_member(run: str, a, b, bearer: str) -> None:
    """From one uninvited client: every path refused; then, with a bearer invite, served."""
    dht = SwarmDHT.start(run, initial_peers=[a.maddr], host_maddrs=[LOCAL], client_mode=True)
    try:
        p2p = await dht.replicate_p2p()
        signed: SignedSpec = await dht.wait_for_spec(30)
        assert signed.spec.private
        dht.use_spec(signed.spec)
        tokens = torch.randint(signed.spec.model.vocab_size, (2, 16))

        # A forged spec and its own record, claiming to serve stage 1: stored nowhere or
        # believed by nobody.
        forged = _forged_spec_raw(signed)
        expires = get_dht_time() + 60
        await dht.dht.store(spec_key(run), forged, expiration_time=expires, return_future=True)
        assert (await dht.spec()).raw == signed.raw
        me = Ed25519PrivateKey.generate()
        info = peer_info(run, peer_id_of(me.public_key()))
        assert info.state is PeerState.SERVING and info.membership is None
        assert await dht.publish_peer(info, me, ttl_s=60), "stored: peers read it, and drop it"
        assert {p.peer_id for p in await dht.peers()} == {a.peer_id, b.peer_id}

        with pytest.raises(StageRefused, match="not a member"):
            await stage_client.forward(p2p, PeerID.from_base58(a.peer_id), tokens,
                                       run_id=run, stage=0)  # fmt: skip
        # b's proof, read from its record, is bound to b: useless to anyone else.
        b_record = next(p for p in await dht.peers() if p.peer_id == b.peer_id)
        with pytest.raises(P2PHandlerError, match="shows an invite for another peer"):
            await present(p2p, PeerID.from_base58(a.peer_id), b_record.membership)
        with pytest.raises(P2PHandlerError, match="not base64"):
            await present(p2p, PeerID.from_base58(a.peer_id), "%%%")

        # The control: the same client with a bearer invite trains through both stages.
        trainer = await open_trainer(dht, TrainerSettings(in_flight=2, call_timeout_s=20),
                                     invite=bearer)  # fmt: skip
        await trainer.train(4)
        assert trainer.stats.micro_batches == 4
        assert trainer.stats.calls[(0, a.peer_id)] >= 4 and trainer.stats.calls[(1, b.peer_id)] >= 4
        await trainer.p2p.shutdown()
        await p2p.shutdown()
    finally:
        dht.shutdown()


def _forged_spec_raw(signed: SignedSpec) -> bytes:
    """The run's spec made public, owned and signed by a stranger, under the same run id."""
    fields = json.loads(msgpack.unpackb(signed.raw)["spec"])
    stranger = Ed25519PrivateKey.generate()
    fields.update(private=False, owner=peer_id_of(stranger.public_key()))
    payload = json.dumps(fields).encode()
    return msgpack.packb({"spec": payload, "sig": sign(stranger, _SPEC_DOMAIN, payload)})


def _forged_spec_text(spec_file) -> str:
    fields = msgpack.unpackb(_forged_spec_raw(read_spec_file(spec_file.read_text())))
    return json.dumps({"spec": fields["spec"].decode(), "signature": fields["sig"].hex()})


def _home(tmp_path, name: str):
    """A machine of its own: a HOME directory, and a wrap that runs a command in it."""
    home = tmp_path / f"home-{name}"
    home.mkdir(parents=True, exist_ok=True)
    return home, lambda command: ["env", f"HOME={home}", *command]


def test_a_bearer_invite_admits_one_peer_even_when_two_use_it_at_once(tmp_path):
    """Two default nodes (training on) start with one bearer token at the same moment: one
    serves, the other stops (exit 2) and is not listed; a third identity is refused later.
    The owner's node finds its key at the default path (no --owner-key)."""
    owner_home, as_owner = _home(tmp_path, "owner")
    created = _cli_in(owner_home, "run", "create", "lab", "--private", "--stages", "2",
                      "--out", owner_home / "lab.spec.json")  # fmt: skip
    run = re.search(r"created private run (\S+)", created.stdout).group(1)
    bearer = _cli_in(owner_home, "run", "invite", "--run", run, "--expires", "1h")
    token = tmp_path / "bearer.invite"
    token.write_text(bearer.stdout)

    nodes = []
    watch = None
    try:
        owner = launch_node(tmp_path, "a", run, train=True, two_stage=True, wrap=as_owner,
                            extra=["--spec", owner_home / "lab.spec.json"])  # fmt: skip
        nodes.append(owner)
        owner.wait_serving(120)
        watch = StatusWatch(run, owner.maddr)
        pair = [
            launch_node(
                tmp_path,
                name,
                run,
                initial_peers=[owner.maddr],
                train=True,
                two_stage=True,
                wait=False,
                wrap=_home(tmp_path, name)[1],
                extra=["--invite", f"@{token}"],
            )  # fmt: skip
            for name in ("x", "y")
        ]
        nodes += pair
        # One of them stops (at start, or once it sees the other's earlier claim) ...
        loser = wait_until(lambda: next((n for n in pair if not n.alive()), None), 180,
                           "one of the two nodes with the same bearer token to stop")  # fmt: skip
        winner = next(n for n in pair if n is not loser)
        _stopped_saying(loser, "already used by peer")
        # Later (the winner's claim is out: the loser read it), a third identity with the
        # same token is refused before it serves; it starts while the winner loads.
        late = launch_node(tmp_path, "z", run, initial_peers=[owner.maddr], train=True,
                           two_stage=True, wait=False, wrap=_home(tmp_path, "z")[1],
                           extra=["--invite", f"@{token}"])  # fmt: skip
        nodes.append(late)
        # ... and the other serves, admitted by the owner's node (listed in the run).
        winner.wait_serving(180)
        view = watch.wait(lambda v: winner.peer_id in _peers(v) and v, 60, "the winner listed")
        assert loser.peer_id not in _peers(view) if loser.maddrs_file.exists() else True

        assert late.proc.wait(120) == 2, late.output()
        assert late.stage() is None and winner.alive() and owner.alive()
        assert set(_peers(watch.view())) == {owner.peer_id, winner.peer_id}
    finally:
        if watch is not None:
            watch.close()
        stop_all(nodes)


def _cli_in(home, *args, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``swarmtrain ARGS`` as run by the user whose HOME is ``home``."""
    proc = subprocess.run(
        [sys.executable, "-m", "node.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=home,
        env=dict(os.environ, OMP_NUM_THREADS="1", HOME=str(home)),
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_two_peers_claiming_one_bearer_invite_at_the_same_moment_one_holds(tmp_path):
    """The race itself, through a real DHT: two clients that both found the token unused
    publish their claims at once; exactly one (the lower time, then peer id) holds, the
    owner's side admits that one only, and a trainer with the token later is refused."""
    key = load_or_create_key(tmp_path / "owner.key")
    spec = make_run_spec("race", "tiny", 2, owner=peer_id_of(key.public_key()), private=True)
    token = issue_invite(key, spec.run, expires=time.time() + 600)
    host = SwarmDHT.start(spec.run, host_maddrs=[LOCAL])
    clients: list[SwarmDHT] = []
    try:
        for _ in range(3):
            clients.append(SwarmDHT.start(spec.run, initial_peers=host.visible_maddrs(),
                                          host_maddrs=[LOCAL], client_mode=True))  # fmt: skip
        asyncio.run(_race(host, clients[:2], clients[2], sign_run_spec(spec, key), token))
    finally:
        for dht in (*clients, host):
            dht.shutdown()


async def _race(
    host: SwarmDHT, pair: list[SwarmDHT], late: SwarmDHT, signed: SignedSpec, token: str
) -> None:
    assert await host.publish_spec(signed)
    for dht in (host, *pair):
        dht.use_spec(signed.spec)
        await dht.refresh_revocations()
    proofs = [prove_membership(c.policy, c.peer_id, token) for c in pair]
    results = await asyncio.gather(
        *(c.claim_invite(c.peer_id, p) for c, p in zip(pair, proofs, strict=True)),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(refused) == 1 and isinstance(refused[0], InviteClaimed), results
    claims = [c.policy.verify(c.peer_id, p)[1] for c, p in zip(pair, proofs, strict=True)]
    first = min(claims, key=lambda c: c.order)
    assert results[claims.index(first)] is None, "the earlier claim holds"
    assert refused[0].winner == first.peer_id
    # The owner's side learns both claims and admits the winner only.
    await host.refresh_revocations(restore=True)
    now = time.time()
    for c, p in zip(pair, proofs, strict=True):
        if c.peer_id == first.peer_id:
            assert host.policy.check(c.peer_id, p, now)
        else:
            with pytest.raises(InviteClaimed):
                host.policy.check(c.peer_id, p, now)
    # Later, a trainer with the same token is refused before it trains.
    with pytest.raises(NodeError, match=f"already used by peer {first.peer_id}"):
        await open_trainer(late, TrainerSettings(), spec_timeout_s=10, invite=token)
