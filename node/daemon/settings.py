"""What a person sets for one node (``swarmtrain node``'s flags), and the paths derived
from it: the identity key, checkpoints, the event log and the log file of a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from node.cli.args import DEFAULT_OWNER_KEY
from node.dashboard.address import DEFAULT as DEFAULT_DASHBOARD
from node.files import default_identity_path
from node.pipeline.trainer import TrainerSettings
from node.rpc.relay import RelaySettings
from protocol.admission import AdmissionLimits
from protocol.assignment import DEFAULT_PARAMS, Params

HEARTBEAT_S = 60.0  # a serving node logs that it is alive, and what it did, this often
STUCK_AFTER_S = 30.0  # the node's DHT process unanswered this long: stuck, the node stops


@dataclass(frozen=True)
class NodeSettings:
    run: str  # a run id (NAME@FINGERPRINT), or a new public run's NAME
    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    # Whether peers can dial this node: "auto" asks them; "yes" and "no" take the
    # operator's word (a forwarded port known to work; a host behind a local proxy, where
    # peers see every connection come from the proxy).
    reachable: Literal["auto", "yes", "no"] = "auto"
    # The relay this node offers, and whether it serves through one when not reachable.
    relay: RelaySettings = RelaySettings()
    identity: Path | None = None  # default: ~/.swarmtrain/<run>/identity.key
    device: str = "auto"
    stage: int | None = None  # pin a stage instead of choosing one (a pinned node never moves)
    second_stage: int | None = None  # with ``stage``: pin a second stage it serves as well
    # A node that chooses its stage also takes a second one when the run's rule asks for
    # more two-stage peers (protocol.assignment.second_stage); False: never (it needs the
    # memory of two stages, and trains and averages both).
    two_stage: bool = True
    rebalance: bool = True  # move to another stage when that raises the swarm's bottleneck
    rebalance_period_s: float = 60.0  # mean time between rebalancing checks
    # How long a node restarted on the stage of its checkpoint holds it (``Params``).
    resume_hold_s: float = DEFAULT_PARAMS.resume_hold_s
    spec_file: Path | None = None  # the run's signed spec (``swarmtrain run create``)
    invite: str | None = None  # private runs: the invite token from the run's owner
    # Runs started from a Hugging Face checkpoint: this machine's copy of it.
    pretrained: Path | None = None
    # Runs with sharded data (``RunSpec.dataset``): this machine's copy of the shards.
    data: Path | None = None
    owner_key: Path | None = None  # default: ~/.swarmtrain/owner.key
    # Used only by the node that starts a new public run by name: the run's spec.
    preset: str = "tiny"
    n_stages: int = 2
    # A new run's boundary compression; None: the spec's default, or a restarted run's own.
    compression: str | None = None
    update_period_s: float = 5.0  # records expire after 3 periods without a refresh
    throughput: float | None = None  # declared samples/s for every stage (skips measuring)
    remeasure: bool = False  # measure throughput again instead of using the cached figures
    bandwidth_mbps: float | None = None  # declared up and down
    # What the volunteer lets the node take (None: no limit): Mbit/s sent and received
    # (``node.limits``; the record advertises no more), and bytes of memory for its stages.
    max_upload_mbps: float | None = None
    max_download_mbps: float | None = None
    max_memory: int | None = None
    cache_dir: Path | None = field(default_factory=lambda: Path("~/.cache/swarmtrain").expanduser())
    spec_timeout_s: float = 30.0
    train: bool = True  # run a trainer loop alongside the stage
    # Where the held stages are checkpointed (default: beside the identity key, per peer
    # id), and how often; 0: never (a clean stop still writes one).
    checkpoint_dir: Path | None = None
    checkpoint_every_s: float = 300.0
    archive: Path | None = None  # an archive node: serves no stage, keeps all of them here
    events: Path | None = None  # the structured event log (default: in the run's folder)
    dashboard: str = DEFAULT_DASHBOARD  # HOST:PORT, PORT, "auto" or "off" (node.dashboard)
    heartbeat_s: float = HEARTBEAT_S
    # How long the node's DHT process may leave a question unanswered before the node stops
    # as stuck; its averager processes get longer, its own event loop twice this
    # (``Node._watch_children``).
    stuck_after_s: float = STUCK_AFTER_S
    trainer: TrainerSettings = field(default_factory=lambda: TrainerSettings(in_flight=2))
    # Caps on stage requests in flight and how fast they must arrive (protocol.admission).
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)

    @property
    def placement_params(self) -> Params:
        """The assignment rule's settings for this node: the rule's defaults, with the
        node's own timing (``--rebalance-period``, ``--resume-hold``)."""
        return Params(mean_period_s=self.rebalance_period_s, resume_hold_s=self.resume_hold_s)

    @property
    def record_ttl_s(self) -> float:
        return 3 * self.update_period_s

    def identity_path(self) -> Path:
        return self.identity or default_identity_path(self.run)

    def checkpoint_root(self, peer_id: str) -> Path:
        """Beside the run's default identity, a folder per peer id (nodes that share a
        home keep their checkpoints apart)."""
        root = default_identity_path(self.run).parent / "checkpoints" / peer_id
        return self.checkpoint_dir or root

    def events_path(self, peer_id: str) -> Path:
        """The node's JSON-lines event log (``node.events``): ``--events``, or beside the
        run's default identity, one file per peer id."""
        root = default_identity_path(self.run).parent / "events"
        return self.events or root / f"{peer_id}.jsonl"

    def log_path(self, peer_id: str) -> Path:
        """The node's rotating log file (``node.logs``): beside ``--events`` when that is
        given, else in the run's folder, one file per peer id."""
        if self.events is not None:
            return self.events.with_suffix(".log")
        return default_identity_path(self.run).parent / "logs" / f"{peer_id}.log"

    def owner_key_path(self) -> Path:
        return (self.owner_key or DEFAULT_OWNER_KEY).expanduser()
