"""The ``swarmtrain`` parser and the arguments of its light subcommands.

Light on purpose: ``swarmtrain --help`` and ``swarmtrain node --help`` build their parser
from this module alone, so it imports neither torch nor hivemind (a subcommand's module
is imported only to run it). Values are checked as they are parsed: bad input gets one
line and exit status 2 before anything starts.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from node.dashboard.address import DEFAULT as DEFAULT_DASHBOARD
from node.dashboard.address import parse_address

# ``protocol.run_spec.Compression``, spelled out here so this module stays light
# protocol.routing's WINDOW: micro-batches in flight (that module imports numpy, a third of
# a second; tests/unit/test_cli.py checks that the two agree).
WINDOW = 5
COMPRESSIONS = ["none", "float16", "uint8", "int4", "int2"]
# protocol.run_spec's DEFAULT_COMPRESSION and DEFAULT_AVERAGING_COMPRESSION (that module
# imports torch; tests/unit/test_cli.py checks that the two agree).
DEFAULT_COMPRESSION = "int4"
DEFAULT_AVERAGING_COMPRESSION = "uint8"

STDLIB = "stdlib"  # models.data.STDLIB: Python's standard library as a corpus
DEFAULT_OWNER_KEY = Path("~/.swarmtrain/owner.key")  # the node and run_admin read it here
DEFAULT_PRESET = "tiny"
PRESET_NAMES = "tiny, small, base, llama-tiny, llama-20m, llama-125m, llama-350m, llama-1b"


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default, unless it has none worth showing or the help text
    says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, "", argparse.SUPPRESS)
            or default == []
            or not action.option_strings
            or isinstance(action, argparse._VersionAction | argparse._HelpAction)
        ):
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else default
        return f"{text} (default: {shown})".lstrip()


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage dump), exit status 2,
    and whose help shows defaults. Subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_verbose(p: argparse.ArgumentParser, default=False) -> None:
    """``-v``, accepted before and after the subcommand (a subcommand's own ``-v`` has no
    default, so that it does not undo one given before it)."""
    p.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logging")


# Argument types: argparse shows their ArgumentTypeError's text as it is.


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _at_least(kind: type, low: float, *, equal_ok: bool, why: str):
    """An argument type: a finite ``kind`` at least ``low`` (above it unless ``equal_ok``)."""

    def parse(text: str):
        value = _number(text, kind)
        if value < low or (value == low and not equal_ok):
            raise argparse.ArgumentTypeError(f"{why}, got {text}")
        return value

    return parse


positive_float = _at_least(float, 0, equal_ok=False, why="must be more than 0")
non_negative_float = _at_least(float, 0, equal_ok=True, why="must be 0 or more")
positive_int = _at_least(int, 1, equal_ok=True, why="must be 1 or more")
non_negative_int = _at_least(int, 0, equal_ok=True, why="must be 0 or more")
stage_number = _at_least(int, 0, equal_ok=True, why="stages are numbered from 0")


def _within(kind: type, low: float, high: float):
    """An argument type: a finite ``kind`` in [``low``, ``high``]."""

    def parse(text: str):
        value = _number(text, kind)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {text}")
        return value

    return parse


MAX_RESUME_HOLD_S = 86400.0  # a day: a swarm stopped as a whole is back within it, or gone
resume_hold_seconds = _within(float, 0.0, MAX_RESUME_HOLD_S)


def _maddr(check: str, text: str) -> str:
    import node.cli.maddrs  # multiaddr's parser: only when there is an address to check

    try:
        return getattr(node.cli.maddrs, check)(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def peer_maddr(text: str) -> str:
    return _maddr("check_peer_maddr", text)


def listen_maddr(text: str) -> str:
    return _maddr("check_listen_maddr", text)


def announce_maddr(text: str) -> str:
    return _maddr("check_announce_maddr", text)


def dashboard_address(text: str) -> str:
    """``--dashboard``: checked here, parsed again by the node (``node.dashboard.address``)."""
    try:
        parse_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


_MEMORY_UNITS = {"": None, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_memory(text: str) -> int:
    """Bytes from a size with a binary unit: ``8G``, ``8GiB``, ``512M``, ``1.5T`` (K, M,
    G, T: powers of 1024; a trailing ``B`` or ``iB`` is allowed). ``ValueError`` naming
    the problem otherwise."""
    raw = text.strip()
    number = raw.rstrip("BbIi").rstrip()
    unit = number[-1:].upper() if number[-1:].isalpha() else ""
    number = number[: len(number) - len(unit)].strip()
    scale = _MEMORY_UNITS.get(unit)
    if scale is None:
        raise ValueError(f"{text!r}: give a size with its unit, e.g. 8G or 512M")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (e.g. 8G or 512M)") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r}: a size must be more than 0")
    return int(value * scale)


def memory_size(text: str) -> str:
    """``--max-memory``: checked here (``parse_memory``), parsed again by the command."""
    try:
        parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def limit_arguments(p: argparse.ArgumentParser) -> None:
    """What a volunteer lets the node take from the machine and the link."""
    p.add_argument(
        "--max-upload-mbps",
        type=positive_float,
        metavar="MBPS",
        help="send at most this many Mbit/s (stage calls, averaging, state for joiners); "
        "the node's record advertises at most this (default: no limit)",
    )
    p.add_argument(
        "--max-download-mbps",
        type=positive_float,
        metavar="MBPS",
        help="receive at most this many Mbit/s, likewise (default: no limit)",
    )
    p.add_argument(
        "--max-memory",
        type=memory_size,
        metavar="SIZE",
        help='memory the node\'s stages may take, e.g. 8G or 512M ("8G" in a settings '
        "file; GPU memory on CUDA, else RAM): it takes only stages that fit, a second stage "
        "only if both do, and refuses to start when no stage of the run fits (default: no "
        "limit; a second stage only if it fits in what is free)",
    )


def listen_argument(p: argparse.ArgumentParser, text: str) -> None:
    """``--host-maddrs``: where this process's libp2p daemon listens."""
    p.add_argument(
        "--host-maddrs",
        nargs="*",
        default=["/ip4/0.0.0.0/tcp/0"],
        type=listen_maddr,
        metavar="MADDR",
        help=text,
    )


def initial_peers_argument(p: argparse.ArgumentParser, *, required: bool, text: str) -> None:
    """``--initial-peers MADDR...``, each a peer's multiaddr checked as it is parsed;
    ``required``: at least one, else none by default."""
    if required:
        p.add_argument(
            "--initial-peers", nargs="+", required=True, type=peer_maddr, metavar="MADDR", help=text
        )
    else:
        p.add_argument(
            "--initial-peers", nargs="*", default=[], type=peer_maddr, metavar="MADDR", help=text
        )


def node_arguments(p: argparse.ArgumentParser) -> None:
    """``swarmtrain node``."""
    p.add_argument(
        "--run",
        default="",
        help="the run's id (NAME@FINGERPRINT); a bare NAME with no --initial-peers starts a "
        "new public run owned by --owner-key",
    )
    p.add_argument("--spec", type=Path, help="the run's signed spec file (swarmtrain run create)")
    p.add_argument(
        "--invite", help="private runs: the invite token from the run's owner, or @FILE holding it"
    )
    p.add_argument(
        "--pretrained",
        type=Path,
        metavar="DIR",
        help="runs started from a Hugging Face checkpoint: this machine's copy of it (its "
        "files are checked against the hashes in the run's spec before a stage is loaded)",
    )
    p.add_argument(
        "--data",
        type=Path,
        metavar="DIR",
        help="runs with sharded data (run create --data): this machine's copy of the shards "
        "(checked against the hashes in the run's spec before training)",
    )
    p.add_argument(
        "--owner-key",
        type=Path,
        help="the run owner's key (default ~/.swarmtrain/owner.key): signs a new run's spec; "
        "the owner's own node needs no invite",
    )
    initial_peers_argument(
        p,
        required=False,
        text="multiaddrs of nodes of the run (/ip4/HOST/tcp/PORT/p2p/PEER_ID, as a node "
        "prints at start); none: start a new run",
    )
    listen_argument(p, "where to listen (default: every interface, a free TCP port)")
    p.add_argument(
        "--announce-maddrs",
        nargs="*",
        default=[],
        type=announce_maddr,
        metavar="MADDR",
        help="addresses others should dial, e.g. behind port forwarding",
    )
    relay_arguments(p)
    p.add_argument(
        "--identity", type=Path, help="key file (default ~/.swarmtrain/RUN/identity.key)"
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda", "mps"],
        help="auto: CUDA, else MPS, else the CPU",
    )
    p.add_argument(
        "--stage",
        type=stage_number,
        help="serve this stage instead of choosing one (and never move)",
    )
    p.add_argument(
        "--second-stage",
        type=stage_number,
        help="with --stage: serve this stage as well (a two-stage node never moves)",
    )
    p.add_argument(
        "--one-stage",
        action="store_true",
        help="never take a second stage (a node that chooses its stage takes one when the "
        "swarm needs more two-stage peers: that needs memory for two stages)",
    )
    p.add_argument(
        "--rebalance-period",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="mean time between checks whether moving to another stage would raise the "
        "swarm's bottleneck (randomised around it)",
    )
    p.add_argument(
        "--no-rebalance", action="store_true", help="keep the stage taken at join; never move"
    )
    p.add_argument("--preset", default="tiny", help="new run only: model preset")
    p.add_argument("--stages", type=positive_int, default=2, help="new run only: number of stages")
    p.add_argument(
        "--compression",
        choices=COMPRESSIONS,
        help="new run only: compression of activations and gradients between stages "
        f"(default {DEFAULT_COMPRESSION}, for home links; none is faster on a LAN)",
    )
    p.add_argument(
        "--throughput",
        type=positive_float,
        metavar="SAMPLES_PER_S",
        help="declare samples/s instead of measuring",
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="measure throughput again instead of using the cached figure (it is measured "
        "again anyway when a quick check finds it more than 3x off)",
    )
    p.add_argument(
        "--bandwidth-mbps",
        type=positive_float,
        metavar="MBPS",
        help="declare up/down bandwidth in Mbit/s instead of measuring",
    )
    p.add_argument(
        "--max-requests-per-peer",
        type=positive_int,
        default=16,
        metavar="N",
        help="stage requests one peer may have in flight here; more are refused as busy",
    )
    p.add_argument(
        "--max-requests",
        type=positive_int,
        default=64,
        metavar="N",
        help="stage requests all peers together may have in flight here (memory: each "
        "holds up to a stage's largest message)",
    )
    p.add_argument(
        "--request-start-timeout",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
        help="how long a stage request's stream may stay silent after it opens",
    )
    p.add_argument(
        "--update-period",
        type=positive_float,
        default=5.0,
        metavar="SECONDS",
        help="seconds between record refreshes (records expire after 3)",
    )
    limit_arguments(p)
    p.add_argument("--no-train", action="store_true", help="serve only; run no trainer loop")
    p.add_argument(
        "--heartbeat",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="log a line saying the node is alive, and what it did, this often",
    )
    p.add_argument(
        "--stuck-after",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="stop (exit status 2, for a service manager to restart) once the node's DHT "
        "process has not answered for this long; its averagers get 4x, its event loop 2x",
    )
    p.add_argument(
        "--checkpoint-every",
        type=non_negative_float,
        default=300.0,
        metavar="SECONDS",
        help="checkpoint the stages held this often (0: only when the node stops)",
    )
    p.add_argument(
        "--resume-hold",
        type=resume_hold_seconds,
        default=300.0,
        metavar="SECONDS",
        help="a node restarted on the stage of its checkpoint holds it this long (no move), "
        "and waits as long for a peer with a stage nobody serves before taking it from scratch",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        metavar="DIR",
        help="where checkpoints go (default: ~/.swarmtrain/NAME/checkpoints/PEER_ID)",
    )
    p.add_argument(
        "--archive",
        type=Path,
        metavar="DIR",
        help="serve no stage: keep checkpoints of every stage in DIR, pulled from their "
        "peers every --checkpoint-every seconds, for joiners of a stage no peer holds",
    )
    p.add_argument("--maddrs-file", type=Path, help="also write the join multiaddrs here")
    p.add_argument(
        "--dashboard",
        type=dashboard_address,
        default=DEFAULT_DASHBOARD,
        metavar="ADDR",
        help="serve the dashboard page, its JSON API and Prometheus /metrics on HOST:PORT "
        "(an address other machines reach only if you name it); auto: a free port on "
        "127.0.0.1; off: none",
    )
    p.add_argument(
        "--events",
        type=Path,
        metavar="FILE",
        help="the JSON-lines event log (default: ~/.swarmtrain/NAME/events/PEER_ID.jsonl)",
    )


def relay_arguments(p: argparse.ArgumentParser) -> None:
    """The circuit relay a node offers, and whether it serves through one (node.rpc.relay)."""
    from node.rpc.relay import RelaySettings  # light: no hivemind

    d = RelaySettings()
    p.add_argument(
        "--reachable",
        choices=("auto", "yes", "no"),
        default="auto",
        help="whether peers can dial this node: auto asks a few of them to dial it back; "
        "yes and no take your word for it (a port forward you know works, a node that "
        "should only train)",
    )
    p.add_argument(
        "--no-relay",
        action="store_true",
        help="neither offer a relay to peers behind NAT nor serve through one when not "
        "reachable (then such a node only trains)",
    )
    g = p.add_argument_group("relay limits (what this node relays for peers behind NAT)")
    g.add_argument("--relay-max-reservations", type=positive_int, default=d.max_reservations,
                   help="peers that may hold a slot at once")  # fmt: skip
    g.add_argument("--relay-max-circuits", type=positive_int, default=d.max_circuits,
                   help="relayed connections open at once per peer")  # fmt: skip
    g.add_argument("--relay-data-limit-mib", type=positive_int, default=d.data_limit_bytes >> 20,
                   help="MiB each way before a relayed connection is reset")  # fmt: skip
    g.add_argument("--relay-time-limit", type=positive_int, default=d.time_limit_s,
                   metavar="SECONDS", help="lifetime of a relayed connection")  # fmt: skip


def baseline_arguments(p: argparse.ArgumentParser) -> None:
    """``swarmtrain baseline``."""
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"model preset: {PRESET_NAMES}")
    p.add_argument("--steps", type=positive_int, default=200, help="optimizer steps to take")
    p.add_argument(
        "--stages", type=positive_int, default=1, help="cut the model into this many stages"
    )
    p.add_argument("--data", default=STDLIB, help="'stdlib', a text file or a directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    p.add_argument("--eval-every", type=positive_int, default=50, help="steps between validations")
    p.add_argument("--csv", type=Path, help="write the loss curve to this CSV file")


def demo_arguments(p: argparse.ArgumentParser) -> None:
    """``swarmtrain demo``."""
    p.add_argument("--stages", type=positive_int, default=2, help="pipeline stages")
    p.add_argument("--peers", type=positive_int, default=2, help="peers per stage")
    p.add_argument("--preset", default="tiny", help="model preset")
    p.add_argument("--micro-batches", type=positive_int, default=800, help="micro-batches to train")
    p.add_argument(
        "--in-flight", type=positive_int, default=WINDOW, help="micro-batches in flight at once"
    )
    p.add_argument(
        "--kill-at", type=float, default=0.25, help="fraction of training: SIGKILL a peer"
    )
    p.add_argument("--replace-at", type=float, default=0.45, help="fraction: start a replacement")
    p.add_argument("--out", type=Path, default=Path("demo-out"), help="logs, CSV and PNG go here")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also train the single-process baseline on the same samples and compare",
    )


def id_arguments(p: argparse.ArgumentParser) -> None:
    """``swarmtrain id``."""
    p.add_argument(
        "--run",
        required=True,
        help="the run's id (NAME@FINGERPRINT) or name: each run has its own identity",
    )
    p.add_argument(
        "--identity",
        type=Path,
        help="key file (default ~/.swarmtrain/NAME/identity.key, as the node uses; created "
        "if missing)",
    )


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("swarmtrain")
    except PackageNotFoundError:
        return "unknown (not installed)"


def run_peer_arguments(p: argparse.ArgumentParser) -> None:
    """The run to reach and how: for the commands that join a run without serving."""
    p.add_argument("--run", required=True, help="the run's id (NAME@FINGERPRINT)")
    initial_peers_argument(
        p, required=True, text="multiaddrs of nodes of the run (/ip4/HOST/tcp/PORT/p2p/PEER_ID)"
    )
    listen_argument(p, "where to listen")


def status_arguments(p: argparse.ArgumentParser) -> None:
    run_peer_arguments(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="machine-readable output (with --watch: one JSON object per line)",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=5.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 5) until Ctrl-C",
    )


def runs_arguments(p: argparse.ArgumentParser) -> None:
    """``swarmtrain runs``."""
    initial_peers_argument(
        p,
        required=True,
        text="multiaddrs of nodes of any public run (/ip4/HOST/tcp/PORT/p2p/PEER_ID), e.g. "
        "a community's published list",
    )
    listen_argument(p, "where to listen")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=20.0,
        metavar="SECONDS",
        help="give up reaching the DHT, and checking the runs announced, after this long",
    )


def train_arguments(p: argparse.ArgumentParser) -> None:
    run_peer_arguments(p)
    p.add_argument(
        "--micro-batches", type=positive_int, default=1000, help="micro-batches to train"
    )
    p.add_argument(
        "--in-flight", type=positive_int, default=WINDOW, help="micro-batches in flight at once"
    )
    p.add_argument("--stream", type=int, default=0, help="which data stream of the run to read")
    p.add_argument(
        "--data",
        type=Path,
        metavar="DIR",
        help="runs with sharded data: this machine's copy of the shards (checked first)",
    )
    p.add_argument("--csv", type=Path, help="write the loss curve to this CSV file")
    member_arguments(p)


def run_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="write a new run's signed spec")
    create.add_argument("name", help="the run's name; its id adds the owner's fingerprint")
    create.add_argument("--preset", help=f"model preset ({PRESET_NAMES}; default {DEFAULT_PRESET})")
    create.add_argument(
        "--from-pretrained",
        type=Path,
        metavar="DIR",
        help="start from a local Hugging Face checkpoint (config.json and *.safetensors; "
        "LlamaForCausalLM or GPT2LMHeadModel): the spec pins its files' sha256, and every "
        "node needs its own copy (swarmtrain node --pretrained DIR)",
    )
    create.add_argument("--stages", type=int, default=2, help="pipeline stages")
    text_sources_arguments(
        create,
        required=False,
        purpose="train on them, tokenized once into shards that the spec pins by sha256 "
        "(default: the stdlib's sources, read as bytes)",
    )
    create.add_argument(
        "--tokenizer",
        type=Path,
        metavar="FILE",
        help="with --data: a tokenizer.json (swarmtrain tokenizer train) to cut the data with; "
        "its vocabulary must be the model's (default: --from-pretrained's own, else bytes)",
    )
    create.add_argument(
        "--data-out",
        type=Path,
        metavar="DIR",
        help="with --data: where the shards go (default: NAME-data beside the spec file)",
    )
    create.add_argument(
        "--dry-run",
        action="store_true",
        help="write nothing; print each stage's memory (weights, gradients, AdamW state)",
    )
    create.add_argument("--private", action="store_true", help="only invited peers may join")
    create.add_argument(
        "--compression",
        default=DEFAULT_COMPRESSION,
        choices=COMPRESSIONS,
        help="of activations and gradients between stages (default %(default)s: 4-bit groups, "
        "for home links; none is faster on a LAN)",
    )
    create.add_argument(
        "--boundary-rank",
        type=positive_int,
        metavar="K",
        help="send K values per token across each stage boundary instead of the model's "
        "width: blocks write only K coordinates of the residual stream, the rest hold a "
        "fixed embedding of the tokens (default: the full width)",
    )
    create.add_argument("--averaging", default="gradient", choices=["gradient", "diloco"])
    create.add_argument("--inner-steps", type=int, default=50, help="diloco: local steps")
    create.add_argument(
        "--averaging-compression",
        default=DEFAULT_AVERAGING_COMPRESSION,
        choices=["none", "float16", "uint8"],
        help="of the averaged tensors (default %(default)s: 8 bits a value, with error feedback)",
    )
    create.add_argument(
        "--averaging-density",
        type=float,
        default=1.0,
        help="diloco: the share of each delta's coordinates a round sends (the rest waits "
        "in each peer's residual); 0.1 with --averaging-compression uint8 sends about 30x "
        "fewer bytes a round (BENCHMARKS.md, 'Compressed DiLoCo')",
    )
    create.add_argument(
        "--averaging-overlap",
        action="store_true",
        help="diloco: peers keep training while an outer round runs, and apply its step "
        "with the progress made meanwhile (BENCHMARKS.md, 'Overlapped outer rounds')",
    )
    create.add_argument(
        "--averaging-speculate",
        action="store_true",
        help="gradient mode with --max-staleness 1: a stage steps on its own gradients "
        "while its round runs, then takes the averaged step (BENCHMARKS.md, 'Speculative "
        "steps')",
    )
    create.add_argument(
        "--max-staleness",
        type=int,
        choices=[0, 1],
        default=0,
        help="0: a stage holds new micro-batches while its step is pending, so every step "
        "uses fresh gradients (the loss per sample of one process); 1: it never holds them "
        "(more samples/s, a worse loss per sample: BENCHMARKS.md, 'Loss per sample')",
    )
    create.add_argument("--out", type=Path, help="spec file (default NAME.spec.json)")
    _owner_key(create)

    invite = actions.add_parser("invite", help="print an invite token for a private run")
    invite.add_argument("--run", required=True, help="the run's id")
    invite.add_argument("--peer", help="bind the invite to this peer id (default: bearer)")
    invite.add_argument(
        "--expires", default="7d", help="valid for, with a unit: 90s, 30m, 12h, 7d (default 7d)"
    )
    invite.add_argument("--out", type=Path, help="also write the token to this file (0600)")
    _owner_key(invite)

    revoke = actions.add_parser("revoke", help="revoke peers or invites of a private run")
    revoke.add_argument("--run", required=True, help="the run's id")
    revoke.add_argument(
        "--peer",
        nargs="*",
        default=[],
        metavar="PEER_ID",
        help="peer ids to revoke, or unique prefixes of them (as swarmtrain status shows them)",
    )
    revoke.add_argument("--invite-id", nargs="*", default=[], metavar="ID")
    initial_peers_argument(revoke, required=True, text="multiaddrs of nodes of the run")
    listen_argument(revoke, "where to listen")
    _owner_key(revoke)


def _owner_key(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--owner-key",
        type=Path,
        default=DEFAULT_OWNER_KEY,
        help=f"the owner's key file (default {DEFAULT_OWNER_KEY}; `create` makes it if missing)",
    )


def text_sources_arguments(p: argparse.ArgumentParser, *, required: bool, purpose: str) -> None:
    """``--data PATH...`` (text, JSONL and Parquet files, and directories of them) and
    ``--text-field``, for the commands that read a user's text (``run create``,
    ``tokenizer train``)."""
    p.add_argument(
        "--data",
        nargs="+",
        required=required,
        type=Path,
        metavar="PATH",
        help="text files, JSONL (*.jsonl) and Parquet (*.parquet) files, and directories of "
        f"them: {purpose}",
    )
    p.add_argument(
        "--text-field", default="text", help="with --data: the JSONL field holding the text"
    )


def tokenizer_arguments(p: argparse.ArgumentParser) -> None:
    """``swarmtrain tokenizer``."""
    actions = p.add_subparsers(dest="action", required=True)
    train = actions.add_parser("train", help="train a BPE tokenizer on local text")
    text_sources_arguments(train, required=True, purpose="the text to train it on")
    train.add_argument(
        "--vocab-size",
        type=positive_int,
        required=True,
        help="tokens in the vocabulary (the model's vocab_size: 32000 for the llama presets)",
    )
    train.add_argument("--out", type=Path, required=True, help="writes DIR/tokenizer.json")


def member_arguments(p: argparse.ArgumentParser) -> None:
    """How a command that joins a run without serving a stage (``train``, ``export``,
    ``generate``) proves membership of a private run: an invite, or the run's owner key."""
    p.add_argument(
        "--invite",
        help="private runs: the invite token from the run's owner, or @FILE holding it (the "
        "owner's machine needs none: see --owner-key)",
    )
    p.add_argument(
        "--owner-key",
        type=Path,
        default=DEFAULT_OWNER_KEY.expanduser(),  # as a settings file's "~" reads
        help=f"private runs: the run owner's key file, if this machine has it (default "
        f"{DEFAULT_OWNER_KEY}): it proves membership without an invite",
    )
    p.add_argument(
        "--identity",
        type=Path,
        help="key file, for an invite bound to a peer id (default: a new identity; a bearer "
        "invite is then claimed by it)",
    )


def export_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--run",
        help="a live run's id: download its stages from peers (a private run's as a member: "
        "--invite, or on the owner's machine its key)",
    )
    initial_peers_argument(p, required=False, text="with --run: its nodes")
    listen_argument(p, "with --run: where to listen")
    member_arguments(p)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each stage")
    source.add_argument(
        "--checkpoint",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="nodes' checkpoint directories (each holds spec.json and stage<S>/), or folders "
        "above them (e.g. ~/.swarmtrain/RUN/checkpoints): the newest checkpoint of each stage "
        "among them is used",
    )
    p.add_argument("--out", required=True, type=Path, help="the directory to write")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def generate_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="a directory `export` wrote")
    source.add_argument(
        "--run",
        help="a live run's id: generate through its stages' peers, one forward through the "
        "pipeline per token (nothing is trained)",
    )
    initial_peers_argument(p, required=False, text="with --run: multiaddrs of nodes of the run")
    listen_argument(p, "with --run: where to listen")
    member_arguments(p)
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="with --run: how long to look for the run, and to wait for a stage with no "
        "serving peer",
    )
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=non_negative_int, default=200, help="bytes to generate")
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.8,
        help="0: always the most likely byte (deterministic)",
    )
    p.add_argument("--seed", type=int, default=0, help="of the draws (temperature > 0)")
