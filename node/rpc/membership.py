"""Membership at the RPC level: a caller shows its invite once, then its calls are served.

Stage RPCs carry no invite (their metadata is a few hundred bytes, checked before
anything else). Instead a caller *presents* its membership proof to each peer it calls
(``present``); the peer's ``MembershipGate`` checks it against the run's policy, for the
peer id that opened the connection, and remembers the caller until its invite expires.
A stage server asks the gate (``refusal``) before it reads a request. In a public run the
gate admits everyone and nobody needs to present anything. A caller admitted with a
bearer invite is refused again as soon as the policy learns of an earlier claim on it
(another peer used the token first: ``protocol.membership``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from node.rpc.service import MEMBERSHIP, NodeServicer
from protocol.membership import (
    Claim,
    InviteClaimed,
    MembershipError,
    MembershipPolicy,
    parse_invite_token,
)
from protocol.records import MAX_MEMBERSHIP_CHARS, RecordError
from protocol.routing import BanList

logger = logging.getLogger(__name__)

NOT_A_MEMBER = "not a member of this private run: "
MAX_ADMITTED = 10_000  # callers remembered at once; the oldest are forgotten first


class MembershipGate(NodeServicer):
    """Checks the proofs callers present and answers who is admitted right now."""

    service_name = "Membership"

    def __init__(
        self, policy: Callable[[], MembershipPolicy], callers: BanList | None = None
    ) -> None:
        self._policy = policy  # read on every check: revocations arrive while we run
        # peer id -> (invite id, expiry, claim on a bearer invite)
        self._admitted: dict[str, tuple[str, float, Claim | None]] = {}
        self.callers = callers  # refused proofs count against their caller

    @classmethod
    async def create(
        cls, p2p: P2P, policy: Callable[[], MembershipPolicy], callers: BanList | None = None
    ) -> MembershipGate:
        self = cls(policy, callers)
        await self.attach(p2p)
        return self

    async def shutdown(self) -> None:
        await self.detach()

    def refusal(self, peer_id: str) -> str | None:
        """Why ``peer_id``'s calls are refused now, or None if they are served."""
        policy = self._policy()
        if not policy.private:
            return None
        admitted = self._admitted.get(peer_id)
        if admitted is None:
            return f"{NOT_A_MEMBER}peer {peer_id} has not presented an invite"
        invite_id, expires, claim = admitted
        revoked = policy.revocations
        if get_dht_time() > expires or (
            revoked is not None and (peer_id in revoked.peers or invite_id in revoked.invites)
        ):
            del self._admitted[peer_id]
            return f"{NOT_A_MEMBER}the invite of peer {peer_id} expired or was revoked"
        winner = policy.beaten(claim) if claim is not None else None
        if winner is not None:
            del self._admitted[peer_id]
            return NOT_A_MEMBER + str(InviteClaimed(winner.peer_id, peer_id))
        return None

    async def rpc_present(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A membership proof in ``metadata`` -> admitted (empty answer) or an error."""
        caller = context.remote_id.to_base58()
        try:
            if len(request.metadata) > MAX_MEMBERSHIP_CHARS:
                raise MembershipError(f"a proof is at most {MAX_MEMBERSHIP_CHARS} bytes")
            proof = request.metadata.decode("ascii", errors="replace")
            invite, claim = self._policy().admit(caller, proof, get_dht_time())
        except RecordError as e:
            self.refused(context, "a membership proof", str(e), cause=MEMBERSHIP)
            raise MembershipError(NOT_A_MEMBER + str(e)) from None
        if invite is not None:
            if self.callers is not None:
                self.callers.forgive(caller, MEMBERSHIP)
            if len(self._admitted) >= MAX_ADMITTED:
                self._admitted.pop(next(iter(self._admitted)))
            self._admitted[caller] = (invite.invite_id, invite.expires, claim)
        return runtime_pb2.ExpertResponse()


async def present(p2p: P2P, peer: PeerID, proof: str, timeout: float = 10.0) -> None:
    """Show ``proof`` to ``peer``; raises (``P2PHandlerError`` naming the reason) if refused."""
    start = time.monotonic()
    stub = MembershipGate.get_stub(p2p, peer)
    await stub.rpc_present(runtime_pb2.ExpertRequest(metadata=proof.encode()), timeout=timeout)
    logger.debug("presented our invite to %s in %.3f s", peer, time.monotonic() - start)


def prove_membership(policy: MembershipPolicy, peer_id: str, token: str | None) -> str | None:
    """Our proof of an invite to a private run (None in a public run, where none is
    needed); ``MembershipError`` saying why we are not a member (among others: a bearer
    invite that ``policy`` knows another peer claimed first). For a bearer invite the
    proof is our claim on it, which ``SwarmDHT.claim_invite`` then publishes."""
    if not policy.private:
        if token:
            logger.info("run %s is public: the invite is not needed", policy.run)
        return None
    if token is None:
        raise MembershipError(
            f"run {policy.run!r} is private: start with --invite TOKEN (or --invite @FILE); "
            f"the run's owner makes one with `swarmtrain run invite --run {policy.run} "
            f"--peer {peer_id}` (or without --peer, for any one machine)"
        )
    proof = parse_invite_token(token, owner=policy.owner).proof(peer_id)
    policy.check(peer_id, proof, get_dht_time())
    return proof


def read_invite(value: str | None) -> str | None:
    """An invite given as the token itself or as @FILE."""
    if value is None or not value.startswith("@"):
        return value
    path = Path(value[1:]).expanduser()
    try:
        return path.read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the invite file {path}: {e.strerror}") from None
