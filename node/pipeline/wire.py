"""How stage requests and responses travel: tensors split into chunks over a hivemind stream.

Shared by ``node.pipeline.server`` and ``node.pipeline.client``. A message is a stream of
``ExpertRequest`` (or ``ExpertResponse``) protobufs: the first carries the msgpack
metadata, and each carries one part of a tensor as cut by hivemind's
``split_for_streaming`` (a part with a ``dtype`` starts a tensor, the parts after it
continue its buffer). The receiver checks each tensor's declared header as soon as it
arrives and counts bytes as they come, so an oversized message is refused after at most
one chunk, not buffered whole.

A response's metadata is ``{"tensors": n}`` (msgpack): the caller stops reading once it
holds ``n`` complete tensors and closes the stream, and the server keeps its end open
until then: a hivemind stream whose server side closes right after its last write can
lose the tail of that write on the way to the caller (the caller reads part of a chunk,
then the end of the stream), and one that the caller closes first does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from node.pipeline import lowbit
from protocol.stage_messages import (
    FLOAT_COMPRESSIONS,
    LOWBIT_BITS,
    UNIFORM_8BIT_BINS,
    StageRequestError,
    token_dtype,
    wire_nbytes,
)

# Our own compressions (``node.pipeline.lowbit``) travel in the tensor's ``compression``
# field as values past hivemind's enum (a protobuf enum field carries any int32), far
# enough that a later hivemind adding its own values does not collide.
LOWBIT_CODES = {name: 100 + bits for name, bits in LOWBIT_BITS.items()}
_LOWBIT_NAMES = {code: name for name, code in LOWBIT_CODES.items()}
# Settings names (as in ``RunSpec.compression``) -> wire compression of float tensors.
COMPRESSIONS = {
    "none": runtime_pb2.CompressionType.NONE,
    "float16": runtime_pb2.CompressionType.FLOAT16,
    "uint8": runtime_pb2.CompressionType.UNIFORM_8BIT,
    "int4": LOWBIT_CODES["GROUPED_4BIT"],
    "int2": LOWBIT_CODES["GROUPED_2BIT"],
}
# Prefixes of the error a stage server raises, which the caller reads back from
# hivemind's ``P2PHandlerError`` (only the message text crosses the wire).
REFUSED = "stage refused the request: "  # the request is bad: any peer of the stage refuses it
FAILED = "stage failed: "  # the server could not serve it: another peer may
CHUNK_BYTES = 2**16  # hivemind's streaming chunk; larger chunks move a message no faster
MAX_CHUNK_BYTES = 2**20  # a receiver refuses bigger parts (a client after hivemind read them)
# A server refuses a bigger stream frame unread: a part, its header and the metadata.
MAX_FRAME_BYTES = MAX_CHUNK_BYTES + 2**12
MAX_RESPONSE_TENSORS = 8

Message = runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse
# Called with (tensor index, first part) before a tensor's buffer is read; returns the
# buffer's exact byte count or raises StageRequestError.
HeaderCheck = Callable[[int, runtime_pb2.Tensor], int]


def compression_name(value: int) -> str:
    """The name of a wire ``CompressionType`` value (or of one of ours), also for values
    this build lacks."""
    if value in _LOWBIT_NAMES:
        return _LOWBIT_NAMES[value]
    try:
        return runtime_pb2.CompressionType.Name(value)
    except ValueError:
        return f"unknown compression {value}"


def compression_type(name: str) -> int:
    try:
        return COMPRESSIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown compression {name!r}; choose one of {sorted(COMPRESSIONS)}"
        ) from None


def narrow_ids(ids: torch.Tensor) -> torch.Tensor:
    """Token ids (non-negative) in the narrowest integer dtype that holds them all
    (``protocol.stage_messages.TOKEN_DTYPES``): how a low-rank boundary's ``tokens`` travel."""
    return ids.to(getattr(torch, token_dtype(int(ids.max()) if ids.numel() else 0)))


@dataclass(frozen=True)
class Encoded:
    """Hidden states, or their gradient ((B, T, W) float), that a stage sent in a lossy
    encoding (grouped low-bit, 8-bit), kept as it came for a trainer to pass on to the
    next stage: ``serialize`` with the same compression sends these very bytes, so the
    trainer spends no CPU on decoding and encoding again, and the next stage gets exactly
    what this one sent. Made only by ``received`` (``keep_encoded``), which has checked
    that it decodes to finite values, as a stage server requires of what it is sent.
    ``shape`` and ``is_floating_point`` answer as the decoded tensor's would."""

    wire: runtime_pb2.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.wire.size)

    def is_floating_point(self) -> bool:
        return True

    def decode(self) -> torch.Tensor:
        return deserialize(self.wire)


def received(serialized: runtime_pb2.Tensor, keep_encoded: bool = False) -> torch.Tensor | Encoded:
    """A received tensor (an ``Assembler``'s output): decoded, or with ``keep_encoded``, if
    it is a three-dimensional float tensor (hidden states or their gradient, never a loss)
    in a lossy encoding, kept encoded (``Encoded``) once it is known to decode to finite
    values. ``StageRequestError`` if it does not."""
    if not keep_encoded or serialized.dtype != "float32" or len(serialized.size) != 3:
        return deserialize(serialized)
    numel = 1
    for s in serialized.size:
        numel *= s
    if serialized.compression in _LOWBIT_NAMES:
        bits = LOWBIT_BITS[_LOWBIT_NAMES[serialized.compression]]
        lowbit.check_decodes_finite(serialized.buffer, bits, numel)
        return Encoded(serialized)
    if serialized.compression == runtime_pb2.CompressionType.UNIFORM_8BIT:
        _codebook(serialized.buffer)  # every value decodes to an entry of it
        return Encoded(serialized)
    return deserialize(serialized)


def serialize(tensor: torch.Tensor | Encoded, compression: str = "none") -> runtime_pb2.Tensor:
    """Float tensors compressed as asked; integer tensors (token ids) always exact. An
    ``Encoded`` one goes as it came where its encoding is the one asked for."""
    if isinstance(tensor, Encoded):
        if tensor.wire.compression == compression_type(compression):
            return tensor.wire
        tensor = tensor.decode()
    tensor = tensor.detach().cpu()
    if not tensor.is_floating_point():
        return serialize_torch_tensor(tensor)
    code = compression_type(compression)
    if code in _LOWBIT_NAMES:
        bits = LOWBIT_BITS[_LOWBIT_NAMES[code]]
        return runtime_pb2.Tensor(
            buffer=lowbit.encode(tensor, bits),
            size=tensor.shape,
            dtype="float32",
            compression=code,
        )
    return serialize_torch_tensor(tensor, code)


def split_message(
    message_type: type[Message], metadata: bytes, tensors: list[runtime_pb2.Tensor]
) -> Iterator[Message]:
    """The stream of protobufs that carries ``metadata`` and ``tensors``."""
    parts = [p for t in tensors for p in split_for_streaming(t, CHUNK_BYTES)]
    if not parts:
        yield message_type(metadata=metadata)
        return
    yield message_type(metadata=metadata, tensors=parts[:1])
    for part in parts[1:]:
        yield message_type(tensors=[part])


def encode_response_meta(n_tensors: int) -> bytes:
    return msgpack.packb({"tensors": n_tensors})


def decode_response_meta(data: bytes) -> int:
    """The number of tensors a response announces."""
    try:
        raw = msgpack.unpackb(data, raw=False) if len(data) <= 64 else None
    except Exception:
        raw = None
    n = raw.get("tensors") if isinstance(raw, dict) and len(raw) == 1 else None
    if type(n) is not int or not 0 <= n <= MAX_RESPONSE_TENSORS:
        raise StageRequestError(f"malformed response metadata {data[:64]!r}")
    return n


def generic_header_check(max_bytes: int) -> HeaderCheck:
    """For a receiver that knows no layout (the client): known dtypes and compressions."""

    def check(_: int, header: runtime_pb2.Tensor) -> int:
        compression = compression_name(header.compression)
        if header.dtype not in ("int64", "float32"):
            raise StageRequestError(f"unexpected tensor dtype {header.dtype!r:.40}")
        if compression not in FLOAT_COMPRESSIONS or (
            header.dtype == "int64" and compression != "NONE"
        ):
            raise StageRequestError(f"unexpected compression {compression} of {header.dtype}")
        # One dimension at a time, stopping past the limit: a float product of many large
        # dimensions overflows to inf (and inf * 0 is NaN), an exact one of thousands of
        # them takes seconds. Zeros are skipped, as torch cannot even shape an empty
        # tensor whose other dimensions overflow its strides.
        bound = 1
        for s in header.size:
            bound *= max(s, 1)
            if bound > max_bytes:
                dims = ", ".join(map(str, header.size[:4])) + (", ..." * (len(header.size) > 4))
                raise StageRequestError(f"a tensor of shape ({dims}) exceeds {max_bytes} bytes")
        numel = 0 if 0 in header.size else bound
        return wire_nbytes(compression, header.dtype, numel)

    return check


class Assembler:
    """Collects the parts of a message's tensors, checking sizes before reading on."""

    def __init__(self, max_bytes: int, check_header: HeaderCheck) -> None:
        self.max_bytes = max_bytes
        self.check_header = check_header
        self.metadata = b""
        self.received = 0  # bytes of buffers and metadata so far
        self.declared = 0  # what the tensors seen so far will add up to
        self._headers: list[runtime_pb2.Tensor] = []
        self._buffers: list[list[bytes]] = []
        self._expected: list[int] = []
        self._filled: list[int] = []
        self._messages = 0

    def add(self, message: Message) -> None:
        if message.metadata:
            if self._messages:
                raise StageRequestError("metadata is only allowed in the first message")
            self.metadata = message.metadata
            self.received += len(message.metadata)
            self.declared += len(message.metadata)
        self._messages += 1
        for part in message.tensors:
            self._add_part(part)

    def _add_part(self, part: runtime_pb2.Tensor) -> None:
        n = len(part.buffer)
        if n > MAX_CHUNK_BYTES:
            raise StageRequestError(f"a chunk of {n} bytes exceeds {MAX_CHUNK_BYTES} bytes")
        if part.dtype:  # the first part of a new tensor
            self._finish_tensor()
            expected = self.check_header(len(self._headers), part)
            self.declared += expected
            if self.declared > self.max_bytes:
                raise StageRequestError(
                    f"request of {self.declared} bytes exceeds the limit of {self.max_bytes} bytes"
                )
            header = runtime_pb2.Tensor(
                size=part.size, dtype=part.dtype, compression=part.compression
            )
            self._headers.append(header)
            self._buffers.append([])
            self._expected.append(expected)
            self._filled.append(0)
        elif part.size or not self._headers:
            raise StageRequestError("a tensor chunk without a tensor header before it")
        self._filled[-1] += n
        self.received += n
        if self._filled[-1] > self._expected[-1]:
            raise StageRequestError(
                f"tensor {len(self._headers) - 1} has more than the "
                f"{self._expected[-1]} bytes its header declares"
            )
        self._buffers[-1].append(part.buffer)

    def complete(self, n_tensors: int) -> bool:
        """Whether ``n_tensors`` tensors have arrived whole."""
        if len(self._headers) > n_tensors:
            raise StageRequestError(f"more than the {n_tensors} tensors announced")
        return len(self._headers) == n_tensors and (
            not self._headers or self._filled[-1] == self._expected[-1]
        )

    def _finish_tensor(self) -> None:
        if self._headers and self._filled[-1] != self._expected[-1]:
            raise StageRequestError(
                f"tensor {len(self._headers) - 1} has {self._filled[-1]} bytes, "
                f"its header declares {self._expected[-1]}"
            )

    def tensors(self) -> list[runtime_pb2.Tensor]:
        """The complete serialized tensors (their headers and sizes already checked)."""
        self._finish_tensor()
        for header, chunks in zip(self._headers, self._buffers, strict=True):
            header.buffer = b"".join(chunks)
        return self._headers


def deserialize(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """A tensor from an ``Assembler``'s output (sizes already match the header)."""
    serialized.requires_grad = False
    if serialized.compression in _LOWBIT_NAMES:
        bits = LOWBIT_BITS[_LOWBIT_NAMES[serialized.compression]]
        return lowbit.decode(serialized.buffer, bits, tuple(serialized.size))
    if serialized.compression != runtime_pb2.CompressionType.UNIFORM_8BIT:
        return deserialize_torch_tensor(serialized)
    # hivemind 1.1.12's 8-bit extract calls int() on a 1-element array, which numpy 2.4
    # refuses; decode its layout here: int64 codebook size, float32 codebook, uint8 indices.
    codebook = torch.from_numpy(_codebook(serialized.buffer, finite=False))
    indices = np.frombuffer(serialized.buffer, dtype=np.uint8, offset=8 + 4 * UNIFORM_8BIT_BINS)
    return codebook[torch.from_numpy(indices.astype(np.int64))].reshape(tuple(serialized.size))


def _codebook(buffer: bytes, finite: bool = True) -> np.ndarray:
    """The codebook of an 8-bit buffer (a copy); ``StageRequestError`` if it has not
    ``UNIFORM_8BIT_BINS`` entries or, with ``finite``, holds a non-finite one."""
    bins = int(np.frombuffer(buffer, dtype=np.int64, count=1)[0])
    if bins != UNIFORM_8BIT_BINS:
        raise StageRequestError(f"8-bit codebook of {bins} entries, expected {UNIFORM_8BIT_BINS}")
    codebook = np.frombuffer(buffer, dtype=np.float32, offset=8, count=bins).copy()
    if finite and not np.isfinite(codebook).all():
        raise StageRequestError("8-bit codebook holds non-finite values")
    return codebook
