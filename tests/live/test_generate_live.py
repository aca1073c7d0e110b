"""Generation through a live swarm's stages, and export of a live private run.

Two nodes serve a run's two stages without training (``--no-train``); a ``swarmtrain
train`` moves their weights off the initial ones for two steps and stops, so the weights
then stay as they are. ``swarmtrain generate --run`` at temperature 0 writes the same
text twice, and the text that ``generate --model`` writes from the model exported from
the swarm then; with a stage's only peer gone it stops with one line naming that stage.
On a private run's owner's machine, the run's key alone lets ``train`` and ``generate``
in; a member exports it with an invite; a machine with neither is refused in one line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from node.files import load_or_create_key
from protocol.membership import issue_invite
from tests.swarm import LOCAL, cli_error, launch_node, stop_all, wait_until

PROMPT = "def "
NEW_TOKENS = 12
STEPS = 2  # optimizer steps the short training takes (tiny: 4 micro-batches a step)
# A command's deadline: a few seconds idle; at load 20 on two cores, train took over 120 s.
COMMAND_TIMEOUT_S = 300


def _start(home: Path, *args: object) -> subprocess.Popen:
    """``swarmtrain ARGS`` started with HOME ``home`` (no owner key there unless a test puts
    one); ``_done`` waits for it. Commands that do not depend on each other run at once."""
    return subprocess.Popen(
        [sys.executable, "-m", "node.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, HOME=str(home), OMP_NUM_THREADS="1"),
    )


def _done(proc: subprocess.Popen, ok: bool = True) -> subprocess.CompletedProcess:
    """What ``proc`` (``_start``) wrote, as bytes (UTF-8: an untrained model's bytes that
    make no character show as U+FFFD), once it exited; killed past ``COMMAND_TIMEOUT_S``."""
    try:
        out, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    if ok:
        assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _cli(home: Path, *args: object, ok: bool = True) -> subprocess.CompletedProcess:
    """``swarmtrain ARGS`` with HOME ``home``, waited for (``_start``, ``_done``)."""
    return _done(_start(home, *args), ok)


def _swarm_args(run: str, maddr: str) -> list[str]:
    return ["--run", run, "--initial-peers", maddr, "--host-maddrs", LOCAL]


def _start_sample(home: Path, *source: str) -> subprocess.Popen:
    """``generate`` at temperature 0 from ``source`` (--run or --model), started."""
    return _start(home, "generate", *source, "--prompt", PROMPT,
                  "--max-new-tokens", NEW_TOKENS, "--temperature", 0)  # fmt: skip


def _sample(home: Path, *source: str, started: subprocess.Popen | None = None) -> bytes:
    """What ``generate`` writes at temperature 0 from ``source`` (--run or --model), or
    what ``started`` (``_start_sample``) wrote."""
    out = _done(started or _start_sample(home, *source)).stdout
    text = out.decode()  # what generate writes is UTF-8, whatever the model drew
    drawn = len(text) - len(PROMPT) - 1  # a character for one to four bytes drawn
    assert text.startswith(PROMPT) and text.endswith("\n"), out
    assert -(-NEW_TOKENS // 4) <= drawn <= NEW_TOKENS, out
    return out


def _stepped(node, steps: int) -> bool:
    rounds = node.events("averaging.round")
    return bool(rounds) and rounds[-1]["epoch"] >= steps


def test_generate_through_the_swarm_writes_what_its_export_writes(tmp_path: Path) -> None:
    nodes = []
    try:
        a = launch_node(tmp_path, "a", "gen", extra=["--stage", "0"])
        nodes.append(a)
        run = wait_until(lambda: a.events("node.started") and a.run_id, 30, "a's run id")
        b = launch_node(tmp_path, "b", run, initial_peers=[a.maddr], extra=["--stage", "1"])
        nodes.append(b)
        assert a.wait_serving() == 0 and b.wait_serving() == 1
        swarm = _swarm_args(run, a.maddr)

        _cli(tmp_path, "train", *swarm, "--micro-batches", 4 * STEPS)
        wait_until(lambda: _stepped(a, STEPS) and _stepped(b, STEPS), 30, "both stages' steps")

        # Two generations and the export, at once: nothing changes the weights now.
        samples = [_start_sample(tmp_path, *swarm) for _ in range(2)]
        export = _start(tmp_path, "export", *swarm, "--out", tmp_path / "model")
        first, second = (_sample(tmp_path, started=p) for p in samples)
        assert second == first, "temperature 0 is deterministic"
        out = _done(export).stdout.decode()
        assert re.findall(r"stage (\d): step (\d+) from peer", out) == [("0", "2"), ("1", "2")]
        assert _sample(tmp_path, "--model", str(tmp_path / "model")) == first

        # The stage-1 peer leaves: generation stops, naming the stage.
        assert b.stop() == 0
        failed = _cli(tmp_path, "generate", *swarm, "--prompt", PROMPT, "--timeout", 3, ok=False)
        stderr = failed.stderr.decode()
        assert failed.returncode == 1, stderr
        assert cli_error(stderr) == ("generate", "stage 1 has had no serving peer for 3 s")
    finally:
        stop_all(nodes)


def test_a_private_run_exports_to_its_members_only(tmp_path: Path) -> None:
    owner_key, spec = tmp_path / "owner.key", tmp_path / "lab.spec.json"
    created = _cli(tmp_path, "run", "create", "lab", "--private", "--stages", 2,
                   "--owner-key", owner_key, "--out", spec).stdout.decode()  # fmt: skip
    run = re.search(r"created private run (\S+)", created).group(1)
    key, expires = load_or_create_key(owner_key), time.time() + 3600
    guest = tmp_path / "guest"  # a member's machine: an invite, no owner key
    guest.mkdir()
    (guest / "invite").write_text(issue_invite(key, run, expires=expires))
    nodes = []
    try:
        owner = ["--spec", spec, "--owner-key", owner_key, "--stage", "0"]
        a = launch_node(tmp_path, "a", run, extra=owner)
        nodes.append(a)
        invited = ["--invite", issue_invite(key, run, expires=expires), "--stage", "1"]
        b = launch_node(tmp_path, "b", run, initial_peers=[a.maddr], extra=invited)
        nodes.append(b)
        assert a.wait_serving() == 0 and b.wait_serving() == 1
        swarm = _swarm_args(run, a.maddr)

        # A machine that is no member is refused, in one line, before it downloads anything
        # (while the owner's machine trains: see below).
        refusing = _start(guest, "export", *swarm, "--out", guest / "model")
        training = _start(tmp_path, "train", *swarm, "--owner-key", owner_key,
                          "--micro-batches", 4)  # fmt: skip
        refused = _done(refusing, ok=False)
        assert refused.returncode == 2
        command, message = cli_error(refused.stderr.decode())
        assert command == "export" and "is private: start with --invite" in message
        assert not (guest / "model").exists()

        # The owner's machine trains a step with the run's key and no invite; a member
        # with an invite exports the result, and the owner generates through the stages
        # what that export writes.
        _done(training)
        wait_until(lambda: _stepped(a, 1) and _stepped(b, 1), 30, "both stages' step")
        exporting = _start(guest, "export", *swarm, "--invite", f"@{guest / 'invite'}",
                           "--out", guest / "model")  # fmt: skip
        through = _sample(tmp_path, *swarm, "--owner-key", str(owner_key))
        out = _done(exporting).stdout.decode()
        assert f"stage 0: step 1 from peer {a.peer_id}" in out
        assert f"stage 1: step 1 from peer {b.peer_id}" in out
        assert through == _sample(tmp_path, "--model", str(guest / "model"))
    finally:
        stop_all(nodes)


def test_a_low_rank_run_trains_generates_and_exports_a_plain_model(tmp_path: Path) -> None:
    """A run whose stage boundary carries 16 of tiny's 64 values per token (``run create
    --boundary-rank 16``) trains through the wire's low-rank requests; its exported model
    is a plain GPT-2 that writes what generation through the stages writes."""
    spec = tmp_path / "narrow.spec.json"
    key = tmp_path / "owner.key"
    created = _cli(tmp_path, "run", "create", "narrow", "--boundary-rank", 16, "--stages", 2,
                   "--owner-key", key, "--out", spec).stdout.decode()  # fmt: skip
    run = re.search(r"created public run (\S+)", created).group(1)
    nodes = []
    try:
        a = launch_node(tmp_path, "a", run, extra=["--spec", spec, "--stage", "0"])
        nodes.append(a)
        b = launch_node(tmp_path, "b", run, initial_peers=[a.maddr],
                        extra=["--spec", spec, "--stage", "1"])  # fmt: skip
        nodes.append(b)
        assert a.wait_serving() == 0 and b.wait_serving() == 1
        swarm = _swarm_args(run, a.maddr)

        _cli(tmp_path, "train", *swarm, "--micro-batches", 4 * STEPS)
        wait_until(lambda: _stepped(a, STEPS) and _stepped(b, STEPS), 30, "both stages' steps")
        export = _start(tmp_path, "export", *swarm, "--out", tmp_path / "model")
        through = _sample(tmp_path, *swarm)
        _done(export)
        config = json.loads((tmp_path / "model" / "config.json").read_text())
        assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_embd"] == 64
        assert _sample(tmp_path, "--model", str(tmp_path / "model")) == through
    finally:
        stop_all(nodes)
