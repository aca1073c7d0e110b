"""``swarmtrain service install`` as a person runs it, and systemd's own check of the unit
it writes (``systemd-analyze verify``: the syntax, every directive known, the command
there to run). Skipped with a reason where systemd-analyze is not installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def _verify(unit: Path) -> subprocess.CompletedProcess:
    # System mode: it needs no running user manager (XDG_RUNTIME_DIR), which CI lacks.
    return subprocess.run(
        [ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )


@needs_systemd
@pytest.mark.parametrize("scope", [["--user"], []], ids=["user", "system"])
def test_systemd_analyze_accepts_the_unit(scope, tmp_path: Path):
    config = tmp_path / "node.toml"
    out = tmp_path / "swarmtrain.service"
    init = subprocess.run(
        [sys.executable, "-m", "node.cli", "config", "init"],
        capture_output=True, text=True, timeout=60, check=True, cwd=ROOT,
    )  # fmt: skip
    config.write_text(init.stdout.replace('# run = "RUN"', 'run = "myrun"'))
    install = subprocess.run(
        [sys.executable, "-m", "node.cli", "service", "install", *scope,
         "--config", config, "--out", out],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    assert "enable --now swarmtrain.service" in install.stdout
    verified = _verify(out)
    assert verified.returncode == 0, verified.stderr
    assert verified.stderr.strip() == "", verified.stderr  # no warning either


@needs_systemd
def test_systemd_analyze_refuses_a_unit_whose_command_is_missing(tmp_path: Path):
    """The check above can fail: the same unit with its command gone is refused."""
    config = tmp_path / "node.toml"
    config.write_text('run = "myrun"\n')
    out = tmp_path / "swarmtrain.service"
    subprocess.run(
        [sys.executable, "-m", "node.cli", "service", "install", "--config", config, "--out", out],
        capture_output=True, text=True, timeout=60, check=True, cwd=ROOT,
    )  # fmt: skip
    gone = tmp_path / "gone" / "swarmtrain"
    text = out.read_text()
    command = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    executable = command.removeprefix("ExecStart=").split()[0]
    out.write_text(text.replace(executable, str(gone)))
    assert _verify(out).returncode != 0
