"""``RunSpec``: what every peer of a run must agree on (model, stage cut, optimizer, data,
who may join).

Immutable once published, and signed by the run's owner (``protocol.ownership``): the
run id carries the owner's fingerprint, so a spec under that id that the owner did not
sign is refused, wherever it comes from (the DHT or a file). Every node re-publishes the
owner's signed bytes as they are and builds exactly the same stages from them. A spec
carries the time it was ``created``: should an owner ever sign two different specs for
one id, every peer keeps the earliest (``earliest_spec``), so the run never splits.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from models.config import ModelConfig, OptimizerConfig, preset
from models.hf_format import FAMILY_OF
from models.stages import StageRange, even_boundaries, validate_boundaries
from protocol.identity import peer_id_of, sign, verify
from protocol.membership import MembershipPolicy
from protocol.ownership import check_owner, make_run_id
from protocol.records import (
    PROTOCOL_VERSION,
    PeerId,
    RecordError,
    RunName,
    first_error,
    unpack_signed,
)

_SPEC_DOMAIN = b"swarmtrain/run-spec"

# Of activations and gradients between stages: float16, hivemind's 8-bit codebook, or
# grouped 4- or 2-bit codes with stochastic rounding (``node.pipeline.lowbit``).
Compression = Literal["none", "float16", "uint8", "int4", "int2"]
# A new run's defaults (``swarmtrain run create`` and ``swarmtrain node`` name them too).
DEFAULT_COMPRESSION: Compression = "int4"
DEFAULT_AVERAGING_COMPRESSION: Literal["none", "float16", "uint8"] = "uint8"
Seconds = Annotated[float, Field(gt=0.0, le=3600.0, allow_inf_nan=False)]
# A checkpoint file's name: no directories, nothing hidden (read only inside the node's own
# copy of the checkpoint).
FileName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class PretrainedSpec(BaseModel):
    """The Hugging Face checkpoint a run starts from, pinned by its files' sha256. Where it
    is is not part of the run: every node has its own copy (``swarmtrain node --pretrained
    DIR``) and checks it against these hashes before loading its stage from it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: Literal["LlamaForCausalLM", "GPT2LMHeadModel"]
    # Its head is its embedding: the run unties them, the head starts from the embedding.
    tied: bool = False
    files: Annotated[dict[FileName, Sha256], Field(min_length=2, max_length=1024)]


class ShardSpec(BaseModel):
    """One data shard (``models.shards``): its file name, token count and sha256."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: FileName
    tokens: Annotated[int, Field(ge=1, le=2**40)]
    sha256: Sha256


class TokenizerSpec(BaseModel):
    """A Hugging Face ``tokenizer.json`` the run's shards were cut with, pinned by its
    sha256; it travels with the shards (``DATA_DIR/tokenizer.json``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sha256: Sha256
    vocab_size: Annotated[int, Field(ge=257, le=2**31)]


Shards = Annotated[tuple[ShardSpec, ...], Field(min_length=1, max_length=100_000)]


class DatasetSpec(BaseModel):
    """A run's data tokenized once into shards (``swarmtrain run create --data``), pinned
    by hash: every trainer points ``--data DIR`` at its own copy and checks it first.
    ``val`` are the shards held out for validation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: Literal["uint16", "uint32"]
    tokenizer: TokenizerSpec | None = None  # None: byte-level (vocabulary 256)
    train: Shards
    val: Shards

    def model_post_init(self, _context) -> None:
        names = [s.name for s in (*self.train, *self.val)]
        if len(set(names)) != len(names):
            raise ValueError("dataset: a shard is named twice")
        if self.vocab_size > 1 << 16 and self.dtype == "uint16":
            raise ValueError(f"dataset: {self.vocab_size} tokens do not fit uint16 shards")

    @property
    def vocab_size(self) -> int:
        return 256 if self.tokenizer is None else self.tokenizer.vocab_size


class AveragingSpec(BaseModel):
    """How the peers of a stage average (``node.averaging.averager``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # gradient: average gradients once the stage's swarm-wide samples reach the target
    # batch, then all copies take the same step. diloco: each peer steps alone
    # (``inner_steps`` AdamW steps of its own), then peers average their parameter deltas
    # and take one outer Nesterov step.
    mode: Literal["gradient", "diloco"] = "gradient"
    # Of the averaged tensors. uint8: 8-bit values with a power-of-two scale per block, the
    # rounding error kept in each copy's error-feedback residual (the default: a home
    # upload is what bounds a round; BENCHMARKS.md, "On a home link").
    compression: Literal["none", "float16", "uint8"] = DEFAULT_AVERAGING_COMPRESSION
    # diloco only: the fraction of the pseudo-gradient's coordinates a round sends (the same
    # coordinates for every groupmate, drawn per epoch: ``protocol.sparsify``); the rest
    # stays in each copy's residual. 1: all of them, uncompressed DiLoCo.
    density: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    matchmaking_s: Seconds = 2.0  # hivemind's min_matchmaking_time: how long a group forms
    round_timeout_s: Seconds = 15.0  # no group by then: step alone (or catch up)
    allreduce_timeout_s: Seconds = 30.0  # for the all-reduce once a group formed
    chunk_timeout_s: Seconds = 5.0  # a groupmate silent this long is dropped from the round
    report_period_s: Seconds = 0.5  # how often progress is published and read
    inner_steps: Annotated[int, Field(ge=1, le=100_000)] = 50  # diloco: H
    outer_lr: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 0.7
    outer_momentum: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = 0.9
    # diloco only: a copy goes on taking inner steps while its outer round runs, and applies
    # the round's outer step with the progress it made since the round took its delta
    # (``protocol.averaging.OuterRound``); false: it holds its micro-batches until the
    # round ends. Off by default: it trades a little loss per sample for rate (BENCHMARKS.md,
    # "Overlapped outer rounds").
    overlap: bool = False
    # gradient mode with optimizer max_staleness 1: at a round's start a copy steps on its
    # own gradients, serves the micro-batches that arrive during the round on those
    # parameters, and when the round ends goes back and takes the averaged step (every copy
    # the same step); off by default (BENCHMARKS.md, "Speculative steps").
    speculate: bool = False

    def model_post_init(self, _context) -> None:
        if self.mode != "diloco" and self.density < 1.0:
            raise ValueError(
                f"averaging.density ({self.density}) below 1 needs averaging.mode diloco, "
                f"got {self.mode!r}: it keeps what a round does not send in a residual of "
                "parameter deltas"
            )
        if self.overlap and self.mode != "diloco":
            raise ValueError(
                f"averaging.overlap needs averaging.mode diloco, got {self.mode!r}: in gradient "
                "mode a step computed during its round would take gradients one step stale "
                "(optimizer max_staleness 1 does that)"
            )
        if self.speculate and self.mode != "gradient":
            raise ValueError(
                f"averaging.speculate needs averaging.mode gradient, got {self.mode!r}: it "
                "steps on a copy's own gradients while their round runs"
            )
        if self.round_timeout_s < 2 * self.matchmaking_s:
            raise ValueError(
                f"averaging.round_timeout_s ({self.round_timeout_s}) must be at least twice "
                f"averaging.matchmaking_s ({self.matchmaking_s}): a round tries to form a "
                "group more than once before it gives up"
            )
        if self.matchmaking_s < 2 * self.report_period_s:
            raise ValueError(
                f"averaging.matchmaking_s ({self.matchmaking_s}) must be at least twice "
                f"averaging.report_period_s ({self.report_period_s}): peers see that a round "
                "is due up to a period apart and must still meet"
            )


class RunSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    run: RunName
    version: int = PROTOCOL_VERSION
    arch: dict[str, Any]  # ModelConfig fields
    optimizer: dict[str, Any]  # OptimizerConfig fields
    boundaries: Annotated[tuple[tuple[int, int], ...], Field(min_length=1, max_length=256)]
    # Of activations and gradients between stages. The default, int4, is for home links,
    # where the boundary's bytes bound the rate; "none" is faster on a LAN or loopback.
    compression: Compression = DEFAULT_COMPRESSION
    averaging: AveragingSpec = AveragingSpec()  # among the peers of a stage
    data: Annotated[str, Field(max_length=256)] = "stdlib"
    seed: Annotated[int, Field(ge=0, lt=2**32)] = 0
    owner: PeerId  # the owner's public key, written as a peer id
    private: bool = False  # only invited peers may take part
    # When the owner signed it (Unix time): of two specs for one run id, peers keep the
    # earlier. 0 for specs written before the field existed.
    created: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    # The checkpoint its initial weights come from; None: from ``arch.init_seed``. Left
    # out of the signed bytes when None, so specs without it read as they did before.
    pretrained: PretrainedSpec | None = None
    # The shards the run trains and validates on (``data`` is then ``"shards"``); None: the
    # bytes of ``data`` (stdlib or a folder). Left out of the signed bytes when None.
    dataset: DatasetSpec | None = None

    @field_validator("arch", "optimizer")
    @classmethod
    def _plain_json(cls, v: dict[str, Any]) -> dict[str, Any]:
        return json.loads(json.dumps(v))  # tuples become lists: equal after a round trip

    def model_post_init(self, _context) -> None:
        check_owner(self.run, self.owner)
        validate_boundaries(self.model, list(self.boundaries))  # also builds both configs
        self.optim  # noqa: B018  (builds and validates OptimizerConfig)
        if self.pretrained is not None:
            family = FAMILY_OF[self.pretrained.architecture]
            if self.model.family != family:
                raise ValueError(
                    f"a {self.pretrained.architecture} checkpoint needs family {family!r}, "
                    f"got arch.family {self.model.family!r}"
                )
            if self.model.boundary_rank is not None:
                raise ValueError(
                    "arch.boundary_rank fixes part of the embedding at its initial values, "
                    "which a pretrained checkpoint does not have: leave it unset"
                )
        if self.dataset is not None:
            check_vocabulary(self.dataset.vocab_size, self.model.vocab_size)
        if self.averaging.speculate and self.optim.max_staleness != 1:
            raise ValueError(
                "averaging.speculate needs optimizer max_staleness 1: with 0 a stage holds "
                "micro-batches during its round, so there is nothing to serve speculatively"
            )

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(**self.arch)

    @property
    def optim(self) -> OptimizerConfig:
        fields = dict(self.optimizer)
        if "betas" in fields:
            fields["betas"] = tuple(fields["betas"])
        return OptimizerConfig(**fields)

    @property
    def membership(self) -> MembershipPolicy:
        """Who may take part (revocations are added as the owner publishes them)."""
        return MembershipPolicy(self.run, self.owner, self.private)

    @property
    def n_stages(self) -> int:
        return len(self.boundaries)

    def stage_range(self, stage: int) -> StageRange:
        if not 0 <= stage < self.n_stages:
            raise ValueError(f"stage {stage} out of range: the run has {self.n_stages} stages")
        return StageRange(*self.boundaries[stage])


def check_vocabulary(tokens: int, embedding: int) -> None:
    """``ValueError`` unless a tokenizer of ``tokens`` ids suits a model embedding
    ``embedding`` of them: equal, or byte-level (256) into any larger embedding."""
    if tokens == embedding or (tokens == 256 and embedding > 256):
        return
    raise ValueError(
        f"the tokenizer has {tokens} tokens but the model's embedding has {embedding}: "
        f"train the tokenizer with --vocab-size {embedding} or choose a preset that matches"
    )


# Fields added after specs were first signed: left out of the signed bytes when None, so a
# spec without them is the same bytes as before they existed.
_OPTIONAL_FIELDS = ("pretrained", "dataset")
# ``AveragingSpec`` fields added after specs were first signed, with the value that means
# what a spec without them meant: left out of the signed bytes at that value.
_AVERAGING_ADDED = {"density": 1.0, "overlap": False, "speculate": False}


def make_run_spec(
    name: str,
    preset_name: str,
    n_stages: int,
    *,
    owner: str,
    model: ModelConfig | None = None,
    optim: OptimizerConfig | None = None,
    **settings: Any,
) -> RunSpec:
    """A spec of run ``name`` (its id: ``NAME@FINGERPRINT`` of ``owner``) from a model
    preset (``model`` and ``optim`` replace its settings) cut evenly into ``n_stages``
    stages, ``created`` now unless given. Settings that are ``OptimizerConfig`` fields
    replace the optimizer's; the rest are ``RunSpec`` fields."""
    settings.setdefault("created", time.time())
    preset_model, preset_optim = preset(preset_name)
    model, optim = model or preset_model, optim or preset_optim
    optim_overrides = {k: settings.pop(k) for k in list(settings) if hasattr(optim, k)}
    optim = dataclasses.replace(optim, **optim_overrides)
    return RunSpec(
        run=make_run_id(name, owner),
        arch=model.to_dict(),
        optimizer=dataclasses.asdict(optim),
        boundaries=tuple((r.start, r.end) for r in even_boundaries(model, n_stages)),
        owner=owner,
        **settings,
    )


def spec_differences(old: RunSpec, new: RunSpec) -> list[str]:
    """What ``new`` changes from ``old``, one phrase per setting (e.g. ``"2 -> 3 stages"``);
    empty if they describe the same run (when each was created does not count)."""
    a, b = old.model_dump(exclude={"created"}), new.model_dump(exclude={"created"})
    changes = []
    if a["boundaries"] != b["boundaries"]:
        changes.append(f"{old.n_stages} -> {new.n_stages} stages")
    for name in a:
        if name != "boundaries" and a[name] != b[name]:
            if isinstance(a[name], dict):
                changed = sorted(k for k in a[name].keys() | b[name].keys()
                                 if a[name].get(k) != b[name].get(k))  # fmt: skip
                changes.append(f"{name} ({', '.join(changed)})")
            else:
                changes.append(f"{name} {a[name]!r} -> {b[name]!r}")
    return changes


@dataclass(frozen=True)
class SignedSpec:
    """A spec with the owner's signature: ``raw`` is what travels and is re-published."""

    spec: RunSpec
    raw: bytes


def earliest_spec(specs: list[SignedSpec]) -> SignedSpec:
    """The spec every peer keeps of several validly signed ones for one run id: the
    earliest ``created``, ties broken by the signed bytes (the same choice everywhere)."""
    return min(specs, key=lambda s: (s.spec.created, s.raw))


def sign_run_spec(spec: RunSpec, owner_key: Ed25519PrivateKey) -> SignedSpec:
    if peer_id_of(owner_key.public_key()) != spec.owner:
        raise ValueError(f"this key is not the owner ({spec.owner}) of run {spec.run!r}")
    omitted: dict[str, object] = {n: True for n in _OPTIONAL_FIELDS if getattr(spec, n) is None}
    at_default = {n for n, v in _AVERAGING_ADDED.items() if getattr(spec.averaging, n) == v}
    if at_default:
        omitted["averaging"] = at_default
    payload = spec.model_dump_json(exclude=omitted).encode()
    raw = msgpack.packb({"spec": payload, "sig": sign(owner_key, _SPEC_DOMAIN, payload)})
    return SignedSpec(spec, raw)


def decode_run_spec(raw: bytes, *, run: str) -> SignedSpec:
    """Validate a signed spec from the DHT or a file; ``RecordError`` if it is not the
    owner-signed spec of ``run``."""
    fields = unpack_signed(raw, ("spec", "sig"), "run spec")
    try:
        spec = RunSpec.model_validate_json(fields["spec"])
    except ValidationError as e:
        raise RecordError(f"malformed run spec: {first_error(e, 'spec')}") from None
    except (ValueError, TypeError, ArithmeticError) as e:
        # Raised by the model's own checks on settings pydantic let through as Any (e.g.
        # 10**400 % 1.5 overflows): malformed all the same.
        raise RecordError(f"malformed run spec: {type(e).__name__}: {e}") from None
    if spec.version != PROTOCOL_VERSION:
        raise RecordError(
            f"run {run!r} uses protocol version {spec.version}, we speak {PROTOCOL_VERSION}"
        )
    if spec.run != run:
        raise RecordError(f"spec is for run {spec.run!r}, not {run!r}")
    if not verify(spec.owner, _SPEC_DOMAIN, fields["spec"], fields["sig"]):
        raise RecordError(f"the spec of run {run!r} is not signed by its owner")
    return SignedSpec(spec, raw)


def spec_file_text(signed: SignedSpec) -> str:
    """A spec file's contents: the signed bytes, with the spec readable."""
    fields = msgpack.unpackb(signed.raw)
    return (
        json.dumps({"spec": fields["spec"].decode(), "signature": fields["sig"].hex()}, indent=1)
        + "\n"
    )


def read_spec_file(text: str) -> SignedSpec:
    """The signed spec in a spec file (``spec_file_text``), checked as from the network."""
    try:
        fields = json.loads(text)
        payload, sig = fields["spec"].encode(), bytes.fromhex(fields["signature"])
        run = json.loads(payload)["run"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RecordError(f"not a swarmtrain spec file ({type(e).__name__}: {e})") from None
    return decode_run_spec(msgpack.packb({"spec": payload, "sig": sig}), run=str(run))
