"""Local state on disk, always written atomically: a crash leaves the old file or the new
one, never half of either."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.identity import IdentityError, decode_private_key, encode_private_key


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class KeyFileError(IdentityError):
    """A key file that cannot be read or used; the message names the file."""


def default_identity_path(run: str) -> Path:
    """Where a node of ``run`` (an id, ``NAME@FINGERPRINT``, or a name) keeps its identity
    unless told otherwise: one per run name."""
    return Path(f"~/.swarmtrain/{run.partition('@')[0]}/identity.key").expanduser()


def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 key at ``path``, created (mode 0600) if there is none: a node's identity
    or a run owner's key, in libp2p's encoding."""
    path = path.expanduser()
    try:
        if not path.exists():
            write_atomic(path, encode_private_key(Ed25519PrivateKey.generate()), mode=0o600)
        return decode_private_key(path.read_bytes())
    except IdentityError as e:
        raise KeyFileError(
            f"key file {path} is not usable: {e}; restore it, or move it aside and a new key "
            "is made (a new identity)"
        ) from None
    except OSError as e:
        raise KeyFileError(f"key file {path}: {e.strerror or e}") from None


class IdentityInUseError(RuntimeError):
    """Another running node holds this identity file."""


def load_or_create_identity(path: Path) -> tuple[Ed25519PrivateKey, int]:
    """The node's Ed25519 key at ``path`` (created, mode 0600, on first start), and an open
    file descriptor holding a lock on it: two nodes with one identity would fight over one
    peer id, so the second one is refused."""
    path = path.expanduser()
    key = load_or_create_key(path)
    lock_fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise IdentityInUseError(
            f"identity {path} is in use by another node on this machine; give this node its "
            "own with --identity PATH"
        ) from None
    return key, lock_fd


def write_run_spec(path: Path, key_file: Path, name: str, preset: str, stages: int, **settings):
    """A new run's spec (``protocol.run_spec.make_run_spec`` of ``name``, ``preset``,
    ``stages`` and ``settings``), owned by the key in ``key_file`` (made there if there is
    none), signed and written to ``path``; returns the spec."""
    from protocol.identity import peer_id_of  # the spec's modules import torch: not at start
    from protocol.run_spec import make_run_spec, sign_run_spec, spec_file_text

    key = load_or_create_key(key_file)
    spec = make_run_spec(name, preset, stages, owner=peer_id_of(key.public_key()), **settings)
    write_atomic(path, spec_file_text(sign_run_spec(spec, key)).encode())
    return spec
