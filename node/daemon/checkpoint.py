"""Checkpoints of the stages a node holds, on its own disk.

A checkpoint is one stage's training state exactly as a peer downloads it
(``node.averaging.state.capture``: parameters, AdamW state, step and epoch, DiLoCo's anchor and
momentum) in one safetensors file, ``<root>/stage<S>/<epoch>.safetensors``. Its header
names the run, a hash of the run's spec and the stage, and carries a SHA-256 of the
tensors' bytes, so a file from another run or spec is refused by name and a truncated or
corrupted one is detected; the newest readable checkpoint wins, and the last ``keep`` are
kept. A node's checkpoints also record where its trainer is in its data stream, so a
restarted node reads on instead of from the start. Each file is written beside its
place and renamed over it, so a crash mid-write leaves the previous checkpoints as they
were. The run's signed spec is kept in ``<root>/spec.json`` so that an export needs no
swarm.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from node.files import write_atomic
from protocol.run_spec import RunSpec, SignedSpec, read_spec_file, spec_file_text

logger = logging.getLogger(__name__)

SPEC_FILE = "spec.json"
KEEP = 3
MAX_HEADER_BYTES = 1 << 24  # a checkpoint's header is a tensor index and a few KiB of ours
_NAME = re.compile(r"^(\d{10})\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint that is not this run's, or cannot be read."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    stage: int
    epoch: int
    metadata: dict  # ``stage_state.capture``'s
    tensors: list[torch.Tensor]


@dataclass(frozen=True)
class DataPosition:
    """Where a node's trainer is in its data stream (``models.data.sample_batches``)."""

    stream: int
    position: int  # the next micro-batch it reads


def spec_hash(spec: RunSpec) -> str:
    """What a checkpoint records of the spec it was trained under."""
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:32]


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def stage_dir(root: Path, stage: int) -> Path:
    return root / f"stage{stage}"


def write_spec(root: Path, signed: SignedSpec) -> None:
    """Keep the run's signed spec beside its checkpoints (once: a spec never changes)."""
    path = root / SPEC_FILE
    if not path.exists():
        write_atomic(path, spec_file_text(signed).encode())


def read_spec(root: Path) -> SignedSpec:
    try:
        return read_spec_file((root / SPEC_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"no readable run spec in {root}: {e}") from None


def write(
    root: Path,
    spec: RunSpec,
    stage: int,
    metadata: dict,
    tensors: list[torch.Tensor],
    keep: int = KEEP,
    data: DataPosition | None = None,
) -> Path:
    """Write one stage's captured state (blocking: run it off the event loop) and drop
    all but the newest ``keep`` checkpoints of the stage. Returns the file written.
    ``data``: where the writing node's trainer is in its data stream."""
    epoch = int(metadata["epoch"])
    header = {
        "run": spec.run,
        "spec": spec_hash(spec),
        "stage": stage,
        "state": metadata,
        "sha256": _digest(tensors),
    }
    if data is not None:
        header["data"] = {"stream": data.stream, "position": data.position}
    directory = stage_dir(root, stage)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{epoch:010d}.safetensors"
    tmp = directory / f".{path.name}.tmp"
    named = {f"t{i:05d}": t.contiguous() for i, t in enumerate(tensors)}
    try:
        save_file(named, str(tmp), metadata={"swarmtrain": json.dumps(header)})
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for old in _files(directory)[keep:]:
        old.unlink(missing_ok=True)
    return path


def _files(directory: Path) -> list[Path]:
    """A stage's checkpoint files, newest first."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _NAME.match(p.name)), reverse=True)


def _header(path: Path) -> dict:
    """Our metadata from a checkpoint file's safetensors header, read without its tensors;
    ``ValueError`` for a header that declares more than ``MAX_HEADER_BYTES``."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"its header declares {size} bytes")
        header = json.loads(f.read(size))
    meta = json.loads(header["__metadata__"]["swarmtrain"])
    if not isinstance(meta, dict):
        raise ValueError(f"its metadata is a {type(meta).__name__}, not an object")
    return meta


def read(path: Path, spec: RunSpec, stage: int) -> Checkpoint:
    """One checkpoint file, checked against the run, its spec, the stage and its hash."""
    try:
        meta = _header(path)
        loaded = load_file(str(path))
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    if meta.get("run") != spec.run or meta.get("spec") != spec_hash(spec):
        raise CheckpointError(
            f"checkpoint {path} is of run {meta.get('run')!r} (spec {meta.get('spec')}), "
            f"not of {spec.run!r} (spec {spec_hash(spec)})"
        )
    if meta.get("stage") != stage:
        raise CheckpointError(f"checkpoint {path} holds stage {meta.get('stage')}, not {stage}")
    tensors = [loaded[k] for k in sorted(loaded)]
    if _digest(tensors) != meta.get("sha256"):
        raise CheckpointError(f"checkpoint {path} is corrupted: its tensors fail their hash")
    state = meta.get("state")
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} carries no state metadata")
    return Checkpoint(path, stage, int(state.get("epoch", 0)), state, tensors)


def kept_stages(root: Path, spec: RunSpec) -> list[int]:
    """The stages this node kept a checkpoint of (of this run and spec, by the newest
    file's header), the most recently written first."""
    found: list[tuple[float, int]] = []
    for stage in range(spec.n_stages):
        for path in _files(stage_dir(root, stage))[:1]:
            try:
                meta = _header(path)
                mtime = path.stat().st_mtime
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.warning("cannot read checkpoint %s: %s", path, e)
                continue
            if meta.get("run") == spec.run and meta.get("spec") == spec_hash(spec):
                found.append((mtime, stage))
    return [stage for _, stage in sorted(found, reverse=True)]


def newest(root: Path, spec: RunSpec, stage: int) -> Checkpoint | None:
    """The newest checkpoint of ``stage`` under ``root`` that reads and checks; older ones
    stand in for a corrupted newest (each refusal is logged)."""
    for path in _files(stage_dir(root, stage)):
        try:
            return read(path, spec, stage)
        except CheckpointError as e:
            logger.warning("%s; trying an older checkpoint", e)
    return None


def data_position(root: Path, spec: RunSpec, stream: int) -> int:
    """Where a trainer on ``stream`` goes on: the furthest position recorded in the
    newest checkpoint of each stage under ``root`` (headers only); 0 if none records one."""
    position = 0
    for stage in range(spec.n_stages):
        for path in _files(stage_dir(root, stage))[:1]:
            try:
                meta = _header(path)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # ``kept_stages`` and ``newest`` say why
            data = meta.get("data")
            if (
                meta.get("run") == spec.run
                and meta.get("spec") == spec_hash(spec)
                and isinstance(data, dict)
                and data.get("stream") == stream
                and isinstance(data.get("position"), int)
                and 0 <= data["position"] < 2**62
            ):
                position = max(position, data["position"])
    return position
