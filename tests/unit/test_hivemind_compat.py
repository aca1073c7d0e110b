"""``node.rpc.hivemind_compat`` against the installed hivemind: for each patch, that
hivemind's side is still what the patch was written for (its source, byte for byte, where
the patch copies or replaces hivemind code) and that the patched behaviour holds."""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import contextlib
import hashlib
import importlib
import inspect
import os
import time
import types

# hivemind recognises stream handlers by typing.AsyncIterator, not collections.abc's.
from typing import AsyncIterator  # noqa: UP035

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionBase, serialization, serialize_torch_tensor
from hivemind.dht.routing import DHTID, RoutingTable
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.servicer import RPCHandler
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.multiaddr import Multiaddr

from node.rpc import hivemind_compat as compat

# sha256 of the source of each hivemind function a patch replaces, wraps, copies or relies
# on, as in hivemind 1.1.12. A mismatch means hivemind changed there: re-read that function
# against the patch that names it in hivemind_compat's docstring, then update the hash.
FINGERPRINTS = {
    "hivemind.averaging.allreduce.AllReduceRunner.__init__": "4d7c804548973da9",
    # the reducer returns its means compressed as the sender's part was (by type)
    "hivemind.averaging.allreduce.AllReduceRunner._accumulate_parts_streaming": (
        "8203964eb06f03a8"
    ),
    "hivemind.compression.serialization.deserialize_torch_tensor": "226f64d59f861276",
    "hivemind.averaging.averager.DecentralizedAverager.__init__": "75d089f9ba0e822f",
    "hivemind.averaging.averager.DecentralizedAverager._load_state_from_peers": "db5f94b8ebb56fc1",
    "hivemind.averaging.averager.DecentralizedAverager._run_allreduce_inplace_": "1e8649d70494d9d1",
    "hivemind.averaging.averager.DecentralizedAverager._run_internal": "49c04c0695ad197a",
    "hivemind.averaging.averager.DecentralizedAverager._shutdown": "8420eecefef0bfe1",
    "hivemind.averaging.averager.DecentralizedAverager.rpc_aggregate_part": "4ec1953cb9ebbe5b",
    "hivemind.averaging.averager.DecentralizedAverager.rpc_download_state": "78bff186c77eabed",
    "hivemind.averaging.averager.DecentralizedAverager.rpc_join_group": "bdfd9d174d5e3456",
    "hivemind.averaging.averager.DecentralizedAverager.run": "9a68e33f2471f2aa",
    "hivemind.averaging.matchmaking.Matchmaking.__init__": "abb7e5e417d66c38",
    "hivemind.averaging.matchmaking.PotentialLeaders.__init__": "c80fa9c5a940ad1e",
    "hivemind.averaging.partition.TensorPartContainer.register_processed_part": "ada41c49d4f49886",
    "hivemind.averaging.partition.TensorPartReducer.accumulate_part": "9e7690629be6676e",
    "hivemind.averaging.partition.TensorPartReducer.check_current_part_finished": (
        "c7ecebe5aa2eeb6c"
    ),
    "hivemind.averaging.partition.TensorPartReducer.reset_accumulators": "58865dc0c6b2f39a",
    "hivemind.dht.dht.DHT.__init__": "3ef29c766f3207d1",
    "hivemind.dht.dht.DHT._shutdown": "90c3e4df7fd9a0bb",
    "hivemind.dht.dht.DHT.client_mode": "e9c4f01ebe1e9ff8",
    "hivemind.dht.dht.DHT.replicate_p2p": "92dd5f8c394be059",
    "hivemind.dht.node.DHTNode.create": "3b804c3d7ac1aefa",
    "hivemind.dht.protocol.DHTProtocol.create": "782b2e347d983c37",
    "hivemind.p2p.p2p_daemon.P2P._make_process_args": "a58a4c6b4eacec22",
    "hivemind.p2p.p2p_daemon.P2P.create": "505b1be984fa2a65",
    "hivemind.p2p.p2p_daemon.P2P.receive_protobuf": "cd42d387fbb3b053",
    "hivemind.p2p.p2p_daemon.P2P.receive_raw_data": "7632c4d3462433ea",
    "hivemind.p2p.p2p_daemon.P2P.replicate": "1d212de7c438651a",
    "hivemind.p2p.p2p_daemon_bindings.p2pclient.Client.connect": "64c525c0e43935eb",
    "hivemind.p2p.servicer.ServicerBase._collect_rpc_handlers": "420cdc249473cc36",
    "hivemind.p2p.servicer.ServicerBase._get_handle_name": "2460e1e66c820ba3",
    "hivemind.p2p.servicer.ServicerBase._make_rpc_caller": "80e69f7ae687230e",
}


def _source(qualified: str) -> str:
    """The source of ``module.Class.function`` as written in hivemind's file (read from the
    file, so that a patch applied in this process does not hide hivemind's own)."""
    parts = qualified.split(".")
    for split in range(len(parts) - 1, 0, -1):
        with contextlib.suppress(ModuleNotFoundError):
            module = importlib.import_module(".".join(parts[:split]))
            break
    text = inspect.getsource(module)
    node: ast.AST = ast.parse(text)
    for name in parts[split:]:
        node = next(
            n
            for n in ast.iter_child_nodes(node)
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name == name
        )
    return ast.get_source_segment(text, node)


def _fingerprint(qualified: str) -> str:
    return hashlib.sha256(_source(qualified).encode()).hexdigest()[:16]


@pytest.mark.parametrize("qualified", sorted(FINGERPRINTS))
def test_hivemind_is_unchanged_where_a_patch_relies_on_it(qualified):
    assert _fingerprint(qualified) == FINGERPRINTS[qualified], (
        f"hivemind's {qualified} changed: check the patch of hivemind_compat that relies on it"
    )


def test_install_refuses_another_hivemind_version(monkeypatch):
    compat.install()  # the installed hivemind is the one the patches were written for
    compat.install()  # and installing again changes nothing
    assert P2P._make_process_args("p2pd", tls=True) == ["p2pd", "-tls=1"]  # hivemind's
    monkeypatch.setattr(hivemind, "__version__", "1.2.0")
    with pytest.raises(
        compat.HivemindVersionError, match="1.1.12's internals.* 1.2.0 is installed"
    ):
        compat.install()


class _Writer:
    """Collects what hivemind writes to a stream."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += bytes(data)

    async def drain(self) -> None:
        pass


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


@pytest.fixture
def cap_frames():
    yield compat.cap_frames
    compat.cap_frames(None)


def test_hiveminds_stream_reads_refuse_a_frame_over_the_cap_unread(cap_frames):
    message = runtime_pb2.ExpertRequest(uid="x" * 100)
    size = message.ByteSize()

    async def main() -> None:
        writer = _Writer()
        await P2P.send_protobuf(message, writer)  # hivemind's framing, as a peer sends it
        frame = bytes(writer.data)
        cap_frames(None)
        assert await P2P.receive_protobuf(runtime_pb2.ExpertRequest, _reader(frame)) == (
            message,
            None,
        )
        cap_frames(size)
        assert (await P2P.receive_protobuf(runtime_pb2.ExpertRequest, _reader(frame)))[0] == message
        cap_frames(size - 1)
        reader = _reader(frame)
        with pytest.raises(
            compat.FrameTooLarge, match=f"{size} bytes exceeds the limit of {size - 1}"
        ):
            await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader)
        assert len(await reader.read()) == size  # the body was left unread

    asyncio.run(main())
    with pytest.raises(ValueError, match="max_bytes must be >= 1"):
        cap_frames(0)


def test_p2pd_options_reach_the_daemon_command_line_and_socket_paths(tmp_path):
    flags = ("-pubsub", "-pubsubRouter=gossipsub")
    plain, prefix = P2P._make_process_args("p2pd", tls=True), P2P._UNIX_SOCKET_PREFIX
    with compat.p2pd_options(extra_args=flags, socket_dir=str(tmp_path)):
        assert P2P._make_process_args("p2pd", tls=True) == plain + list(flags)
        with compat.p2pd_options(extra_args=["-x"]):
            assert P2P._make_process_args("p2pd", tls=True) == [*plain, *flags, "-x"]
        assert P2P._make_process_args("p2pd", tls=True) == plain + list(flags)
        assert (
            Multiaddr(P2P._UNIX_SOCKET_PREFIX + "p2pd-a.sock")["unix"] == f"{tmp_path}/p2pd-a.sock"
        )
    assert P2P._make_process_args("p2pd", tls=True) == plain
    assert prefix == P2P._UNIX_SOCKET_PREFIX
    create = _source("hivemind.p2p.p2p_daemon.P2P.create")  # where hivemind reads both
    assert "self._make_process_args(" in create
    assert 'cls._UNIX_SOCKET_PREFIX + f"p2pd-' in create


class _Echo(compat.PinnedHandleNames):
    service_name = "Echo"

    async def rpc_echo(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse()

    async def rpc_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        yield runtime_pb2.ExpertResponse()


class _FaultyEcho(_Echo):
    """A subclass, as a fault injector is."""


class _PlainEcho(ServicerBase):
    async def rpc_echo(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse()


class _Recorder:
    """A P2P that records the handler names it serves and calls."""

    def __init__(self, peer_id: PeerID | None = None) -> None:
        self.peer_id = peer_id
        self.names: list[str] = []

    async def add_protobuf_handler(self, name: str, *args, **kwargs) -> None:
        self.names.append(name)

    async def call_protobuf_handler(self, peer, name: str, request, response_type):
        self.names.append(name)
        return response_type()


def test_a_subclass_serves_and_is_called_under_the_pinned_name():
    assert _PlainEcho._get_handle_name("ns", "rpc_echo") == "ns::_PlainEcho.rpc_echo"  # hivemind's
    assert _FaultyEcho.handle_name("ns", "rpc_echo") == "ns::Echo.rpc_echo"
    assert _FaultyEcho.handle_name(None, "rpc_echo") == "Echo.rpc_echo"
    p2p = _Recorder()

    async def main() -> None:
        await _FaultyEcho().add_p2p_handlers(p2p, namespace="ns")
        await _FaultyEcho.get_stub(p2p, PeerID(b"peer"), namespace="ns").rpc_echo(
            runtime_pb2.ExpertRequest()
        )

    asyncio.run(main())
    assert p2p.names == ["ns::Echo.rpc_echo", "ns::Echo.rpc_stream", "ns::Echo.rpc_echo"]


def test_rpc_handlers_are_hiveminds_reading_of_the_type_hints():
    handlers = {h.method_name: h for h in _Echo.rpc_handlers()}
    expert = (runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)
    assert handlers == {
        "rpc_echo": RPCHandler("rpc_echo", *expert, stream_input=False, stream_output=False),
        "rpc_stream": RPCHandler("rpc_stream", *expert, stream_input=True, stream_output=True),
    }


def test_dht_shutdown_skips_a_daemon_already_gone_and_never_hangs(tmp_path, monkeypatch):
    dht = compat.DHTCompat(start=False)
    assert dht.parent_pid == os.getpid()
    calls: list[str] = []
    socket = tmp_path / "p2pd.sock"

    async def record(what: str, forever: bool = False) -> None:
        calls.append(what)
        if forever:
            await asyncio.Event().wait()

    p2p = types.SimpleNamespace(daemon_listen_maddr={"unix": str(socket)})
    p2p.shutdown = lambda: record("p2p")
    dht._node = types.SimpleNamespace(p2p=p2p, shutdown=lambda: record("node", forever=True))
    asyncio.run(dht._shutdown())  # p2pd gone: only our own socket is cleaned up
    assert calls == ["p2p"]
    socket.touch()
    monkeypatch.setattr(compat, "DETACH_TIMEOUT_S", 0.05)
    asyncio.run(dht._shutdown())  # hivemind's, cut short when it hangs
    assert calls == ["p2p", "node"]


def test_routing_table_size_counts_the_peers_hivemind_keeps():
    table = RoutingTable(DHTID.generate(), bucket_size=20, depth_modulo=5)
    node = types.SimpleNamespace(protocol=types.SimpleNamespace(routing_table=table))
    assert asyncio.run(compat.routing_table_size(None, node)) == 0
    for i in range(3):
        table.add_or_update_node(DHTID.generate(), PeerID(bytes([i]) * 8))
    assert asyncio.run(compat.routing_table_size(None, node)) == 3


ME, FRIEND, STRANGER = (PeerID(name.encode()) for name in ("me", "friend", "stranger"))


class _Stage(compat.AveragerCompat):
    service_name = "Stage"

    async def admits(self, peer: PeerID) -> bool:
        return peer != STRANGER


def _averager(cls: type[compat.AveragerCompat] = _Stage, **kwargs) -> compat.AveragerCompat:
    dht = types.SimpleNamespace(client_mode=False, peer_id=ME, **kwargs)
    return cls([torch.zeros(4)], dht, start=False, prefix="p")


def test_the_averager_child_disowns_the_parents_p2p_replica(tmp_path, monkeypatch):
    socket = tmp_path / "p2pclient.sock"
    socket.touch()
    replica = P2P()  # as the parent's DHT.replicate_p2p left it: its socket is the parent's
    replica._client_listen_maddr = Multiaddr(f"/unix{socket}")
    averager = _averager(_p2p_replica=replica)
    assert averager.parent_pid == os.getpid()
    monkeypatch.setattr(DecentralizedAverager, "run", lambda self: None)
    averager.run()
    replica._terminate()  # what hivemind's P2P.__del__ does when the child collects it
    assert socket.exists()
    replica._client_listen_maddr = Multiaddr(f"/unix{socket}")
    replica._terminate()  # hivemind's behaviour that the averager guards against
    assert not socket.exists()


def test_set_matchmaking_sets_the_group_key_and_size_in_the_averager_process():
    averager = _averager()
    with pytest.raises(ValueError, match="group bits must be 0s and 1s"):
        averager.set_matchmaking("012", 2)
    averager.set_matchmaking("0101", 3)
    while (message := averager._inner_pipe.recv())[0] != "_set_matchmaking":
        pass  # hivemind's own, sent at construction
    method, args, kwargs = message  # as hivemind's control loop reads it

    async def main() -> Matchmaking:
        averager._matchmaking = Matchmaking(
            types.SimpleNamespace(peer_id=ME),
            b"schema",
            averager.dht,
            servicer_type=_Stage,
            prefix="p",
            target_group_size=None,
            min_group_size=2,
            min_matchmaking_time=5.0,
            request_timeout=3.0,
            client_mode=False,
        )
        await getattr(averager, method)(*args, **kwargs)  # as hivemind's control loop calls it
        return averager._matchmaking

    matchmaking = asyncio.run(main())
    assert matchmaking.group_key_manager.current_key == "p.0b0101"
    assert matchmaking.target_group_size == 3
    assert matchmaking.potential_leaders.target_group_size == 3
    assert "getattr(self, method)(*args, **kwargs)" in _source(
        "hivemind.averaging.averager.DecentralizedAverager._run_internal"
    )


def _hints(function) -> tuple:
    signature = inspect.signature(function)
    kinds = [(p.kind, p.annotation) for p in signature.parameters.values()]
    return kinds, signature.return_annotation


async def _collect(stream) -> list:
    return [message async for message in stream]


def test_a_peer_the_averager_refuses_gets_nothing_from_its_handlers():
    averager = _averager()
    accepted = averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)

    async def join(request, context):
        yield accepted

    averager._matchmaking = types.SimpleNamespace(rpc_join_group=join)
    refused = averaging_pb2.PROTOCOL_VIOLATION

    def context(peer: PeerID) -> P2PContext:
        return P2PContext(handle_name="h", local_id=ME, remote_id=peer)

    async def main() -> None:
        request = averaging_pb2.JoinRequest()
        assert await _collect(averager.rpc_join_group(request, context(FRIEND))) == [accepted]
        answer = await _collect(averager.rpc_join_group(request, context(STRANGER)))
        assert [m.code for m in answer] == [refused]
        answer = await _collect(averager.rpc_aggregate_part(as_aiter(), context(STRANGER)))
        assert [m.code for m in answer] == [refused]
        request = averaging_pb2.DownloadRequest()
        assert await _collect(averager.rpc_download_state(request, context(STRANGER))) == []

    asyncio.run(main())
    for name in ("rpc_join_group", "rpc_aggregate_part", "rpc_download_state"):
        ours, theirs = getattr(compat.AveragerCompat, name), getattr(DecentralizedAverager, name)
        assert _hints(ours) == _hints(theirs), name


class _StateServer(_Recorder):
    """Serves a state download (metadata and one tensor) to whoever asks."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(ME)
        self.tensor = tensor
        self.asked: list[tuple[PeerID, str]] = []

    async def iterate_protobuf_handler(self, peer, name, request, response_type):
        self.asked.append((peer, name))
        part = serialize_torch_tensor(self.tensor)
        metadata = DecentralizedAverager.serializer.dumps({"from": peer.to_bytes()})
        return as_aiter(response_type(tensor_part=part, metadata=metadata))


class _Picky(_Stage):
    async def state_sources(self) -> set[PeerID]:
        return {FRIEND}


def _state_download(cls: type) -> tuple[compat.AveragerCompat, _StateServer]:
    """An averager of ``cls`` whose DHT lists a stranger (priority 2) and a friend (1) as
    state sources, both served by the returned server."""
    expires = get_dht_time() + 60
    priorities = {STRANGER.to_bytes(): 2.0, FRIEND.to_bytes(): 1.0}  # the stranger first
    declared = {k: ValueWithExpiration(v, expires) for k, v in priorities.items()}
    averager = _averager(cls, get=lambda key, latest: ValueWithExpiration(declared, expires))
    averager._p2p = server = _StateServer(torch.arange(3.0))
    averager._matchmaking = types.SimpleNamespace(
        group_key_manager=types.SimpleNamespace(prefix="p")
    )
    return averager, server


@pytest.mark.parametrize(("cls", "asked"), [(_Stage, STRANGER), (_Picky, FRIEND)])
def test_a_state_download_tries_only_the_state_sources(cls, asked):
    averager, server = _state_download(cls)
    future: concurrent.futures.Future = concurrent.futures.Future()
    asyncio.run(averager._load_state_from_peers(future))
    metadata, tensors, source = future.result()
    assert server.asked == [(asked, "p::Stage.rpc_download_state")]
    assert source == asked.to_base58()  # the peer the transport asked, whatever it says
    assert metadata == {"from": asked.to_bytes()} and torch.equal(tensors[0], torch.arange(3.0))
    assert "get_stub" not in vars(averager)  # the screen was for that download only


def test_a_state_download_asks_only_the_peers_named():
    averager, server = _state_download(_Stage)
    for only, asked in (([FRIEND.to_base58()], [FRIEND]), ([], [])):
        server.asked.clear()
        future: concurrent.futures.Future = concurrent.futures.Future()
        asyncio.run(averager._load_state_from_peers(future, only=only))
        assert [peer for peer, _ in server.asked] == asked
        assert (future.result() is None) == (not asked)
        if asked:
            assert future.result()[2] == FRIEND.to_base58()


class _Screen:
    """Refuses parts above 100 and reduces by the element-wise maximum."""

    def check_part(self, part: torch.Tensor, weight: float) -> str | None:
        return "above 100" if float(part.max()) > 100 else None

    def reduce_parts(self, parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        return torch.stack(parts).amax(0)


def test_the_reducer_screens_groupmates_parts_and_reduces_as_the_averager_says():
    parts = [torch.tensor([1.0, 500.0]), torch.tensor([3.0, 0.0]), torch.tensor([2.0, 4.0])]

    reducers: list[compat.ScreenedReducer] = []

    async def reduce(bad: torch.Tensor | None = None) -> list[torch.Tensor]:
        reducer = compat.ScreenedReducer([torch.Size([2])], 3, local=0, screen=_Screen())
        reducers.append(reducer)
        sent = parts if bad is None else [*parts[:2], bad]
        return await asyncio.gather(
            *(reducer.accumulate_part(i, 0, p, weight=i + 1.0) for i, p in enumerate(sent))
        )

    for result in asyncio.run(reduce()):  # our own part is not screened
        assert torch.equal(result, torch.tensor([3.0, 500.0]))
    assert reducers[-1].declared == {1: 2.0, 2: 3.0}  # the groupmates' weights, not ours
    with pytest.raises(AllreduceException, match="sender 2, part 0: above 100"):
        asyncio.run(reduce(bad=torch.tensor([200.0, 0.0])))
    assert reducers[-1].declared == {1: 2.0}  # a refused part's weight does not count
    with pytest.raises(AllreduceException, match=r"sender 2, part 0: shape \(3,\)"):
        asyncio.run(reduce(bad=torch.tensor([1.0, 2.0, 3.0])))
    assert "self.accumulator.add_(tensor_part, alpha=weight)" in _source(
        "hivemind.averaging.partition.TensorPartReducer.accumulate_part"
    )


class _PlusOne(_Stage):
    def reduce_parts(self, parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        return parts[0] + 1


def test_an_all_reduce_runs_with_the_screened_reducer_and_refuses_a_refused_groupmate():
    tensor = torch.zeros(4)
    averager = _averager(_PlusOne)
    averager._p2p = _Recorder(ME)

    async def main(peers: tuple[PeerID, ...]) -> None:
        # What each groupmate declared, as hivemind gathers it: [bandwidth, mode, user data].
        declared = DecentralizedAverager.serializer.dumps([None, AveragingMode.NODE.value, b""])
        group = GroupInfo(b"group", peers, gathered=tuple(declared for _ in peers))
        averager._running_groups[group.group_id] = asyncio.get_running_loop().create_future()
        await averager._run_allreduce_inplace_([tensor], group, peer_fractions=(1.0,) * len(peers))
        runner = averager._running_groups[group.group_id].result()
        assert isinstance(runner.tensor_part_reducer, compat.ScreenedReducer)
        assert isinstance(runner, AllReduceRunner) and runner.tensor_part_container.failed_size == 0

    assert averager.allreduce_began == 0.0
    before = time.monotonic()
    asyncio.run(main((ME,)))  # alone: our part, reduced by reduce_parts, comes back
    assert torch.equal(tensor, torch.ones(4))
    assert before <= averager.allreduce_began <= time.monotonic()  # where matchmaking ended
    with pytest.raises(AllreduceException, match=f"includes {STRANGER}, which this averager"):
        asyncio.run(main((ME, STRANGER)))
    assert "self._running_groups[group_id].set_result(runner)" in _source(
        "hivemind.averaging.averager.DecentralizedAverager._run_allreduce_inplace_"
    )


class _Doubling(CompressionBase):
    compression_type = runtime_pb2.MEANSTD_16BIT

    def compress(self, tensor, info, allow_inplace=False):
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=(tensor * 2).numpy().tobytes(),
            size=tensor.shape,
            dtype="float32",
        )

    def extract(self, serialized_tensor):
        return torch.frombuffer(bytearray(serialized_tensor.buffer), dtype=torch.float32) / 4

    def estimate_compression_ratio(self, info):
        return 1.0


def test_use_compression_makes_a_codec_of_ours_decode_its_type():
    kept = serialization._BASE_COMPRESSION_TYPES["MEANSTD_16BIT"]
    try:
        compat.use_compression(_Doubling())
        wire = serialization.serialize_torch_tensor(torch.ones(2), runtime_pb2.MEANSTD_16BIT)
        assert torch.equal(serialization.deserialize_torch_tensor(wire), torch.full((2,), 0.5))
    finally:
        serialization._BASE_COMPRESSION_TYPES["MEANSTD_16BIT"] = kept
