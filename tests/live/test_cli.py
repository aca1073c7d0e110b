"""The ``swarmtrain`` command line as a person meets it: help, version, bad input and
network errors. Commands run as subprocesses; bad input must give one line on stderr,
exit status 2, and leave nothing behind (no daemon socket, no key written)."""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.unit.test_cli import PEER

ROOT = Path(__file__).resolve().parents[2]


RUN_ID = "x@abcdefghijklmnopqrstuvwx"


@pytest.fixture
def home(tmp_path):
    """A fresh HOME, and a short private TMPDIR where the daemon sockets go."""
    tmp = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))  # socket paths must stay short
    (tmp_path / "home").mkdir()
    yield tmp_path / "home", tmp
    shutil.rmtree(tmp)


def _env(home: Path, tmp: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, HOME=str(home), TMPDIR=str(tmp), OMP_NUM_THREADS="1", **extra)


def _swarmtrain(home, *args, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    home, tmp = home
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(home, tmp, **env),
        cwd=ROOT,
    )


def _refused(home, *args, says: str, **env) -> str:
    """Run a command that must refuse in one line with exit status 2, leaving no daemon
    socket behind; its stderr."""
    proc = _swarmtrain(home, *args, **env)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert says.lower() in proc.stderr.lower(), proc.stderr
    # The daemon's sockets go to a private directory in TMPDIR (a fresh one here: /tmp is
    # shared with whatever else runs on the machine, so it is not compared).
    assert not list(home[1].glob("hivemind-*")), list(home[1].iterdir())
    return proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_time(*args: str) -> float:
    """The CPU time a command takes: what its wall time is on an idle machine (the
    wall time of a test run next to live swarms says more about them than about it)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


COMMANDS = ["baseline", "node", "run", "status", "train", "export", "generate", "demo", "id",
            "config", "service"]  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [["--help"], *([c, "--help"] for c in COMMANDS), ["run", "invite", "--help"],
     ["config", "init"], ["service", "install", "--help"]],
    ids=" ".join,
)  # fmt: skip
def test_help_takes_under_a_second(args):
    """No torch, no hivemind: the parser comes from a light module (0.05 s of CPU; torch's
    import alone takes seconds)."""
    assert min(_cpu_time(*args) for _ in range(3)) < 0.5


def test_version_defaults_and_help_of_every_option(home):
    version = _swarmtrain(home, "--version")
    assert version.returncode == 0 and re.match(r"swarmtrain \S+", version.stdout)
    node = _swarmtrain(home, "node", "--help").stdout
    assert "(default: 5.0)" in node and "(default: auto)" in node  # --update-period, --device
    for command in ("status", "train"):
        text = _swarmtrain(home, command, "--help").stdout
        for option in ("--run RUN ", "--initial-peers MADDR [MADDR ...]"):
            # the option's line, and its help: on the same line, or on the next
            after = text.split(f"  {option}", 1)[1].split("\n  --", 1)[0]
            assert after.strip(), f"{command} {option} has no help:\n{text}"


def test_id_prints_the_peer_id_of_the_nodes_identity(home):
    """``swarmtrain id`` creates the identity the node would use (0600) and prints its
    peer id; the node then runs under that same peer id."""
    first = _swarmtrain(home, "id", "--run", "lab")
    assert first.returncode == 0, first.stderr
    peer_id = first.stdout.strip()
    assert re.fullmatch(r"12D3KooW\w+", peer_id), first.stdout
    key = home[0] / ".swarmtrain" / "lab" / "identity.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    by_id = _swarmtrain(home, "id", "--run", "lab@abcdefghijklmnopqrstuvwx")
    assert by_id.stdout.strip() == peer_id  # one identity per run name
    other = _swarmtrain(home, "id", "--run", "lab", "--identity", home[0] / "other.key")
    assert other.returncode == 0 and other.stdout.strip() not in ("", peer_id)

    node = subprocess.Popen(
        [sys.executable, "-m", "node.cli", "node", "--run", "lab", "--no-train",
         "--throughput", "5", "--bandwidth-mbps", "100", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
         "--dashboard", "auto"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(*home), cwd=ROOT,
    )  # fmt: skip
    try:
        line = node.stdout.readline()  # "node PEER_ID in run ..."
        assert line.startswith(f"node {peer_id} in run"), line
    finally:
        node.send_signal(signal.SIGINT)
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:  # how fast a node stops is tested elsewhere
            node.kill()
            node.wait()


def test_id_refuses_a_bad_run_name(home):
    _refused(home, "id", "--run", "no/slashes", says="run name")


def test_unreachable_initial_peer(home):
    maddr = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{PEER}"
    _refused(home, "node", "--run", RUN_ID, "--initial-peers", maddr, "--throughput", "5",
             says="cannot reach")  # fmt: skip


def test_host_and_port_given_as_a_multiaddr(home):
    _refused(home, "node", "--run", RUN_ID, "--initial-peers", "127.0.0.1:31337",
             says="/ip4/HOST/tcp/PORT/p2p/PEER_ID")  # fmt: skip


def test_multiaddr_without_its_peer_id(home):
    _refused(home, "node", "--run", RUN_ID, "--initial-peers", "/ip4/127.0.0.1/tcp/31337",
             says="/p2p/")  # fmt: skip


def test_listen_port_in_use(home):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _refused(home, "node", "--run", "lab", "--throughput", "5",
                 "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", says="in use")  # fmt: skip
    assert not (home[0] / ".swarmtrain").exists()  # refused before any key was written


def test_status_of_a_dead_peer(home):
    maddr = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{PEER}"
    _refused(home, "status", "--run", RUN_ID, "--initial-peers", maddr, says="cannot reach")


def test_status_with_a_bad_multiaddr(home):
    _refused(home, "status", "--run", RUN_ID, "--initial-peers", "127.0.0.1:31337",
             says="not a multiaddr")  # fmt: skip


def test_maddr_checks():
    from node.cli.maddrs import check_can_listen, check_peer_maddr

    assert check_peer_maddr(f"/ip4/10.0.0.1/tcp/5/p2p/{PEER}")
    assert check_peer_maddr(f"/dns4/example.org/tcp/5/p2p/{PEER}")
    for bad in ("127.0.0.1:31337", "/ip4/10.0.0.1/tcp/5", f"/ip4/1.2.3/tcp/5/p2p/{PEER}", ""):
        with pytest.raises(ValueError):
            check_peer_maddr(bad)
    check_can_listen("/ip4/127.0.0.1/tcp/0")  # any free port: nothing to check
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ValueError, match="in use"):
            check_can_listen(f"/ip4/127.0.0.1/tcp/{busy.getsockname()[1]}")


def test_dht_sockets_are_removed_at_shutdown(monkeypatch):
    """A DHT's daemon sockets live in a private directory, gone after shutdown."""
    from node.rpc.dht import SwarmDHT

    tmp = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    try:
        dht = SwarmDHT.start("lab", host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            [sockets] = tmp.glob("hivemind-*")
            assert stat.S_IMODE(sockets.stat().st_mode) == 0o700
            assert list(sockets.glob("p2pd-*.sock"))
        finally:
            dht.shutdown()
        assert not list(tmp.iterdir())
    finally:
        tmp.rmdir()


@pytest.mark.parametrize(
    "args",
    [
        ["--throughput", "-5"],
        ["--throughput", "0"],
        ["--bandwidth-mbps", "-1"],
        ["--update-period", "0"],
        ["--stage", "-1"],
        ["--stages", "0"],
    ],
    ids=" ".join,
)
def test_bad_numbers_are_refused_when_parsed(home, args):
    _refused(home, "node", "--run", "lab", *args, says=args[0])
    assert not (home[0] / ".swarmtrain").exists()


def test_stage_outside_a_new_run_is_refused_before_anything_starts(home):
    _refused(home, "node", "--run", "lab", "--stages", "2", "--stage", "5", says="--stage 5")
    assert not (home[0] / ".swarmtrain").exists()  # no owner key, no identity, no daemon


def test_stage_outside_a_spec_file_is_refused_before_anything_starts(home, tmp_path):
    spec = tmp_path / "lab.spec.json"
    created = _swarmtrain(home, "run", "create", "lab", "--stages", "2", "--out", spec,
                          "--owner-key", tmp_path / "owner.key")  # fmt: skip
    assert created.returncode == 0, created.stderr
    _refused(home, "node", "--spec", spec, "--second-stage", "7", "--stage", "0",
             says="--second-stage 7")  # fmt: skip
    assert not (home[0] / ".swarmtrain" / "lab").exists()  # no identity: nothing started


def test_cuda_without_cuda_is_refused_at_once(home):
    _refused(home, "node", "--run", "lab", "--device", "cuda", says="--device cuda",
             CUDA_VISIBLE_DEVICES="")  # fmt: skip
    assert not (home[0] / ".swarmtrain").exists()


@pytest.mark.parametrize("which", ["identity", "owner"])
def test_a_corrupt_key_file_is_named(home, which):
    path = home[0] / ".swarmtrain" / ("lab/identity.key" if which == "identity" else "owner.key")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a key\n")
    _refused(home, "node", "--run", "lab", "--throughput", "5", says=str(path))
    assert path.read_bytes() == b"not a key\n"  # left as it was, for its owner to look at


def test_readme_writes_secrets_privately_and_links_what_exists(home, tmp_path):
    readme = (ROOT / "README.md").read_text()
    invites = [line for line in readme.splitlines() if line.startswith("swarmtrain run invite")]
    assert invites
    for line in invites:  # a shell redirection creates the file readable by all
        assert ">" not in line and "--out " in line, f"token file readable by all: {line}"
    for name in set(re.findall(r"[\w./-]+\.md\b", readme)):
        assert (ROOT / name).exists(), f"README names {name}, which is not in the repository"

    # as the README does it
    owner_key, spec = tmp_path / "owner.key", tmp_path / "lab.spec.json"
    created = _swarmtrain(home, "run", "create", "lab", "--private", "--out", spec,
                          "--owner-key", owner_key)  # fmt: skip
    assert created.returncode == 0, created.stderr
    run = re.search(r"run (lab@\w+)", created.stdout).group(1)
    token = tmp_path / "bearer.invite"
    invited = _swarmtrain(home, "run", "invite", "--run", run, "--expires", "12h",
                          "--out", token, "--owner-key", owner_key)  # fmt: skip
    assert invited.returncode == 0, invited.stderr
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
