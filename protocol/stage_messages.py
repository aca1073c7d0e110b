"""What a stage accepts: checks of a request's metadata and tensors before they are used.

No networking here. A stage server decodes a request in two steps and calls these checks
at each: first what each serialized tensor *declares* (dtype, shape, compression, hence
the exact byte count its buffer must have), before the buffer is read; then the decoded
tensors themselves (dtypes, shapes, token ranges, finiteness). Every violation raises
``StageRequestError`` with the numbers in its message.

Request layout (tensors by position, after the metadata):

- forward, stage 0 and middle stages: ``[inputs]``
- forward, last stage: ``[inputs, targets]``
- backward (not at the last stage, whose backward is its ``train=True`` forward):
  ``[inputs, grad_outputs]``
- inference forward (``infer=True``, generation), last stage: ``[inputs]``; it returns
  the logits of each sequence's last position ``(B, vocab)`` instead of a loss
- with a low-rank boundary (``ModelConfig.boundary_rank``), every request to a stage that
  takes hidden states ends with the sequences' token ids: ``[..., tokens]``

``inputs`` are token ids ``(B, T)`` int64 at stage 0 and hidden states ``(B, T, W)``
float32 elsewhere, W the model's ``boundary_width`` (``n_embd``, or the boundary's rank);
``targets`` and ``tokens`` are token ids ``(B, T)``; ``grad_outputs`` has the shape of the
stage's outputs, ``(B, T, W)``. Token ids always travel uncompressed, as int64, except
``tokens``, which may come in any of ``TOKEN_DTYPES`` (they are widened on receipt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import torch

from models.config import ModelConfig
from models.stages import StageRange

INPUTS, TARGETS, GRAD_OUTPUTS, TOKENS = "inputs", "targets", "grad_outputs", "tokens"
FORWARD, BACKWARD = "forward", "backward"

# Grouped low-bit quantization (swarmtrain's own, ``node.pipeline.lowbit``): wire name ->
# bits per value. Each group of ``LOWBIT_GROUP`` consecutive values (the flattened tensor,
# zero-padded to whole groups) carries a float32 minimum and a float32 step, then its codes.
LOWBIT_BITS = {"GROUPED_4BIT": 4, "GROUPED_2BIT": 2}
LOWBIT_GROUP = 64  # divides most presets' hidden sizes: a group then holds one token's values
# Compression of float tensors, by their hivemind ``CompressionType`` names and ours.
FLOAT_COMPRESSIONS = frozenset({"NONE", "FLOAT16", "UNIFORM_8BIT", *LOWBIT_BITS})
UNIFORM_8BIT_BINS = 256  # codebook entries of hivemind's Uniform8BitQuantization

MAX_METADATA_BYTES = 256
# A run id: a name of up to 64 characters, '@', the owner's 24-character fingerprint
# (``protocol.records.check_run_name``).
MAX_RUN_ID_CHARS = 64 + 1 + 24
MAX_STAGES = 2**16
MAX_MICRO_BATCH_ID = 2**63 - 1

_ITEMSIZE = {"int64": 8, "float32": 4, "int32": 4, "int16": 2, "uint8": 1}
# The ``tokens`` of a low-rank boundary travel in the narrowest of these that holds them
# (``node.pipeline.wire.narrow_ids``): one byte a token for a byte-level vocabulary.
TOKEN_DTYPES = ("uint8", "int16", "int32", "int64")


def token_dtype(top: int) -> str:
    """The narrowest of ``TOKEN_DTYPES`` that holds the ids 0..``top``."""
    for dtype, limit in (("uint8", 2**8), ("int16", 2**15), ("int32", 2**31)):
        if top < limit:
            return dtype
    return "int64"


WRONG_STAGE = "this server serves stage "  # a peer that moved: the caller's view is stale


class StageRequestError(ValueError):
    """A request a stage refuses: the same request would be refused by any peer of the stage."""


@dataclass(frozen=True)
class StageContract:
    """The shapes and limits of one stage's requests."""

    stage_index: int
    blocks: StageRange
    n_blocks: int
    vocab_size: int
    block_size: int
    width: int  # values per token of the hidden states it takes and returns
    max_tokens: int  # B * T per request
    max_message_bytes: int  # metadata + tensor buffers of one request, as sent
    # A low-rank boundary: requests that carry hidden states also carry the token ids.
    tokens_with_hidden: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.stage_index < MAX_STAGES:
            raise ValueError(f"stage_index must be in [0, {MAX_STAGES}), got {self.stage_index}")
        if not 0 <= self.blocks.start < self.blocks.end <= self.n_blocks:
            raise ValueError(f"blocks {self.blocks} out of range [0, {self.n_blocks})")
        if self.max_tokens < 1 or self.max_message_bytes < 1:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) and max_message_bytes "
                f"({self.max_message_bytes}) must be >= 1"
            )

    @classmethod
    def for_stage(
        cls,
        config: ModelConfig,
        blocks: StageRange,
        stage_index: int,
        *,
        max_tokens: int | None = None,
        max_message_bytes: int | None = None,
    ) -> StageContract:
        """The contract of stage ``stage_index`` (blocks ``blocks``) of ``config``.

        By default a request may carry 32 full-length sequences, and the byte limit is the
        size of the largest request that fits the token limit uncompressed (a backward:
        hidden states and their gradients; or the last stage's forward: hidden states and
        targets; either with the token ids across a low-rank boundary), so the token limit
        binds.
        """
        max_tokens = max_tokens or 32 * config.block_size
        if max_message_bytes is None:
            width, ids = config.boundary_width, 8 if config.boundary_rank else 0
            per_token = max(2 * width * 4, width * 4 + 8) + ids
            max_message_bytes = MAX_METADATA_BYTES + max_tokens * per_token
        return cls(
            stage_index=stage_index,
            blocks=blocks,
            n_blocks=config.n_blocks,
            vocab_size=config.vocab_size,
            block_size=config.block_size,
            width=config.boundary_width,
            max_tokens=max_tokens,
            max_message_bytes=max_message_bytes,
            tokens_with_hidden=config.boundary_rank is not None and blocks.start > 0,
        )

    @property
    def takes_tokens(self) -> bool:
        return self.blocks.start == 0

    @property
    def returns_loss(self) -> bool:
        return self.blocks.end == self.n_blocks

    def roles(self, kind: str, *, infer: bool = False) -> tuple[str, ...]:
        """The tensors a request of ``kind`` carries, in order (``infer``: an inference
        forward, which carries no targets)."""
        tokens = (TOKENS,) if self.tokens_with_hidden else ()
        if kind == FORWARD:
            with_targets = self.returns_loss and not infer
            return (INPUTS, TARGETS, *tokens) if with_targets else (INPUTS, *tokens)
        if kind == BACKWARD:
            if self.returns_loss:
                raise StageRequestError(
                    f"stage {self.stage_index} is the last stage: its backward is a forward "
                    "with train=True, not a backward request"
                )
            return (INPUTS, GRAD_OUTPUTS, *tokens)
        raise StageRequestError(f"unknown request kind {kind!r}")


@dataclass(frozen=True)
class StageMeta:
    """The metadata of a stage request, msgpack-encoded on the wire."""

    run_id: str
    stage: int
    kind: str  # FORWARD or BACKWARD
    micro_batch: int  # chosen by the trainer; echoed in logs
    train: bool = False  # at the last stage's forward: also back-propagate
    # An inference-only forward (generation): nothing kept for a backward, no samples
    # counted toward a step, never held by admission; the last stage takes no targets
    # and returns the logits of each sequence's last position.
    infer: bool = False

    def __post_init__(self) -> None:
        if type(self.run_id) is not str or not 1 <= len(self.run_id) <= MAX_RUN_ID_CHARS:
            raise StageRequestError(
                f"run id must be a string of 1-{MAX_RUN_ID_CHARS} characters, "
                f"got {self.run_id!r:.80}"
            )
        if type(self.stage) is not int or not 0 <= self.stage < MAX_STAGES:
            raise StageRequestError(
                f"stage must be an integer in [0, {MAX_STAGES}), got {self.stage!r:.40}"
            )
        if self.kind not in (FORWARD, BACKWARD):
            raise StageRequestError(
                f"kind must be {FORWARD!r} or {BACKWARD!r}, got {self.kind!r:.40}"
            )
        if type(self.micro_batch) is not int or not 0 <= self.micro_batch <= MAX_MICRO_BATCH_ID:
            raise StageRequestError(
                f"micro-batch id must be an integer in [0, 2**63), got {self.micro_batch!r:.40}"
            )
        if type(self.train) is not bool:
            raise StageRequestError(f"train must be a boolean, got {self.train!r:.40}")
        if self.train and self.kind != FORWARD:
            raise StageRequestError("train=True is only meaningful for a forward request")
        if type(self.infer) is not bool:
            raise StageRequestError(f"infer must be a boolean, got {self.infer!r:.40}")
        if self.infer and (self.kind != FORWARD or self.train):
            raise StageRequestError("infer=True is only meaningful for a forward without train")

    # Wire key -> attribute; the flags ("train", "infer") are sent only when True.
    _FLAGS: ClassVar[tuple[str, ...]] = ("train", "infer")
    _WIRE: ClassVar[dict[str, str]] = {
        "run": "run_id",
        "stage": "stage",
        "kind": "kind",
        "mb": "micro_batch",
    }

    def encode(self) -> bytes:
        fields_ = {key: getattr(self, attr) for key, attr in self._WIRE.items()}
        fields_.update((flag, True) for flag in self._FLAGS if getattr(self, flag))
        return msgpack.packb(fields_)

    @classmethod
    def decode(cls, data: bytes) -> StageMeta:
        if len(data) > MAX_METADATA_BYTES:
            raise StageRequestError(
                f"metadata of {len(data)} bytes exceeds the limit of {MAX_METADATA_BYTES}"
            )
        try:
            raw: Any = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several types for malformed input
            detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise StageRequestError(f"malformed metadata ({detail})") from None
        if not isinstance(raw, dict):
            raise StageRequestError(f"metadata must be a map, got {type(raw).__name__}")
        unknown = set(raw) - set(cls._WIRE) - set(cls._FLAGS)
        if unknown:
            raise StageRequestError(f"unknown metadata keys {sorted(map(str, unknown))}")
        missing = set(cls._WIRE) - set(raw)
        if missing:
            raise StageRequestError(f"metadata lacks keys {sorted(missing)}")
        flags = {flag: raw.get(flag, False) for flag in cls._FLAGS}
        return cls(**{attr: raw[key] for key, attr in cls._WIRE.items()}, **flags)


def check_meta(contract: StageContract, meta: StageMeta, *, run_id: str, kind: str) -> None:
    """Check that ``meta`` addresses this run, this stage and this kind of request."""
    if meta.run_id != run_id:
        raise StageRequestError(f"request for run {meta.run_id!r}, this server serves {run_id!r}")
    if meta.stage != contract.stage_index:
        raise StageRequestError(
            f"request for stage {meta.stage}, {WRONG_STAGE}{contract.stage_index}"
        )
    if meta.kind != kind:
        raise StageRequestError(f"a {meta.kind} request sent to the {kind} handler")
    contract.roles(kind)  # refuses a backward at the last stage


def wire_nbytes(compression: str, dtype: str, numel: int) -> int:
    """The exact byte count of a serialized tensor's buffer."""
    if compression == "NONE":
        return numel * _ITEMSIZE[dtype]
    if compression == "FLOAT16":
        return 2 * numel
    if compression == "UNIFORM_8BIT":  # int64 codebook size, float32 codebook, uint8 indices
        return 8 + 4 * UNIFORM_8BIT_BINS + numel
    if compression in LOWBIT_BITS:  # per group: float32 minimum and step, packed codes
        groups = -(-numel // LOWBIT_GROUP)
        return groups * (8 + LOWBIT_GROUP * LOWBIT_BITS[compression] // 8)
    raise StageRequestError(f"unsupported compression {compression}")


def _describe(role: str, contract: StageContract) -> tuple[str, str, int]:
    """What a role holds: (name for messages, dtype name, number of dims)."""
    if role in (TARGETS, TOKENS) or (role == INPUTS and contract.takes_tokens):
        return ("targets" if role == TARGETS else "token ids"), "int64", 2
    return ("hidden states" if role == INPUTS else "grad_outputs"), "float32", 3


def check_layout(
    contract: StageContract,
    role: str,
    dtype: str,
    shape: Sequence[int],
    batch: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Check the dtype and shape of tensor ``role``; return its ``(B, T)``.

    ``batch`` is the inputs' ``(B, T)``, which the other tensors of a request must match.
    """
    name, want_dtype, ndim = _describe(role, contract)
    shape = tuple(int(s) for s in shape)
    pattern = "(B, T)" if ndim == 2 else f"(B, T, {contract.width})"
    if len(shape) != ndim or (ndim == 3 and shape[2] != contract.width):
        got = str(shape) if len(shape) <= 4 else f"{len(shape)} dimensions {shape[:4]}..."
        raise StageRequestError(f"expected {name} {pattern}, got {got}")  # bounded: it is logged
    if dtype != want_dtype and not (role == TOKENS and dtype in TOKEN_DTYPES):
        raise StageRequestError(f"expected {name} of dtype {want_dtype}, got {dtype}")
    b, t = shape[0], shape[1]
    if batch is not None:
        if (b, t) != batch:
            raise StageRequestError(f"{name} {shape} do not match the inputs' (B, T) = {batch}")
        return batch
    if b < 1 or t < 1:
        raise StageRequestError(f"expected {name} with B >= 1 and T >= 1, got {shape}")
    if t > contract.block_size:
        raise StageRequestError(
            f"sequence length T = {t} exceeds the block size {contract.block_size}"
        )
    if b * t > contract.max_tokens:
        raise StageRequestError(
            f"{b} x {t} = {b * t} tokens exceed the limit of {contract.max_tokens} per request"
        )
    return b, t


def check_header(
    contract: StageContract,
    role: str,
    *,
    dtype: str,
    shape: Sequence[int],
    compression: str,
    batch: tuple[int, int] | None = None,
) -> tuple[tuple[int, int], int]:
    """Check what a serialized tensor declares, before its buffer is read.

    Returns its ``(B, T)`` and the exact byte count its buffer must have.
    """
    name, want_dtype, _ = _describe(role, contract)
    allowed = FLOAT_COMPRESSIONS if want_dtype == "float32" else {"NONE"}
    if compression not in allowed:
        raise StageRequestError(
            f"{name} may be sent with compression {sorted(allowed)}, got {compression}"
        )
    bt = check_layout(contract, role, dtype, shape, batch)
    numel = 1
    for s in shape:
        numel *= int(s)
    return bt, wire_nbytes(compression, dtype, numel)


def check_tensor(
    contract: StageContract,
    role: str,
    tensor: torch.Tensor,
    batch: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Check a decoded tensor: dtype, shape, token range or finiteness. Returns its (B, T)."""
    name, _, _ = _describe(role, contract)
    dtype = str(tensor.dtype).removeprefix("torch.")
    bt = check_layout(contract, role, dtype, tuple(tensor.shape), batch)
    if not tensor.is_floating_point():
        lo, hi = int(tensor.min()), int(tensor.max())
        if lo < 0 or hi >= contract.vocab_size:
            bad = lo if lo < 0 else hi
            raise StageRequestError(
                f"{name} contain id {bad}, out of range [0, {contract.vocab_size})"
            )
    else:
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            n_bad = int((~finite).sum())
            raise StageRequestError(f"{name} contain {n_bad} non-finite values (NaN or Inf)")
    return bt


@dataclass(frozen=True)
class ForwardRequest:
    meta: StageMeta
    inputs: torch.Tensor  # token ids (B, T) or hidden states (B, T, W)
    targets: torch.Tensor | None  # (B, T), at the last stage only, and not with infer
    tokens: torch.Tensor | None = None  # (B, T), with hidden states across a low-rank boundary


@dataclass(frozen=True)
class BackwardRequest:
    meta: StageMeta
    inputs: torch.Tensor  # as sent to the forward
    grad_outputs: torch.Tensor  # (B, T, W): d(loss * B) / d(outputs)
    tokens: torch.Tensor | None = None  # as sent to the forward


def parse_request(
    contract: StageContract, meta: StageMeta, tensors: Sequence[torch.Tensor]
) -> ForwardRequest | BackwardRequest:
    """Check decoded tensors against the layout of ``meta.kind`` and bundle them."""
    roles = contract.roles(meta.kind, infer=meta.infer)
    if len(tensors) != len(roles):
        raise StageRequestError(
            f"a {meta.kind} request to stage {contract.stage_index} carries {len(roles)} "
            f"tensors {list(roles)}, got {len(tensors)}"
        )
    batch = check_tensor(contract, roles[0], tensors[0])
    for role, tensor in zip(roles[1:], tensors[1:], strict=True):
        check_tensor(contract, role, tensor, batch)
    by_role = dict(zip(roles, tensors, strict=True))
    if TOKENS in by_role:
        by_role[TOKENS] = by_role[TOKENS].long()  # what embeddings index with
    if meta.kind == FORWARD:
        return ForwardRequest(meta, tensors[0], by_role.get(TARGETS), by_role.get(TOKENS))
    return BackwardRequest(meta, tensors[0], tensors[1], by_role.get(TOKENS))
