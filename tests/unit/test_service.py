"""``swarmtrain service install``: the unit it writes (read back as systemd would group it),
where it goes, and what it refuses. ``tests/live/test_service.py`` has systemd-analyze
check the file."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

from node.cli import service
from node.cli.main import main
from node.cli.service import Unit, default_path, install

SWARMTRAIN = Path("/opt/swarm train/bin/swarmtrain")  # a space: quoted in ExecStart


def _read(text: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # keys are case-sensitive
    unit.read_string(text)
    return unit


def test_the_unit_runs_the_node_with_its_config_restarts_it_and_stops_it_with_sigterm():
    unit = _read(
        Unit(SWARMTRAIN, Path("/etc/swarm/50%.toml"), user_unit=False, run_as="ada").text()
    )
    s = unit["Service"]
    assert s["ExecStart"] == '"/opt/swarm train/bin/swarmtrain" node --config /etc/swarm/50%%.toml'
    assert (s["Restart"], s["KillSignal"], s["KillMode"]) == ("on-failure", "SIGTERM", "mixed")
    assert 10 <= int(s["TimeoutStopSec"]) <= 300
    assert s["RestartPreventExitStatus"] == "2"  # bad settings: no restart loop
    assert s["User"] == "ada" and s["WorkingDirectory"] == "/etc/swarm"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert unit["Unit"]["After"] == "network-online.target"


def test_a_user_unit_waits_for_no_system_target_and_names_no_user():
    unit = _read(Unit(SWARMTRAIN, Path("/home/ada/node.toml"), user_unit=True).text())
    assert unit["Install"]["WantedBy"] == "default.target"
    assert "After" not in unit["Unit"] and "User" not in unit["Service"]


def test_units_go_where_systemd_looks(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert default_path(user_unit=True) == tmp_path / "systemd/user/swarmtrain.service"
    assert default_path(user_unit=False) == Path("/etc/systemd/system/swarmtrain.service")


def test_an_existing_unit_is_replaced_only_when_forced(tmp_path):
    path = tmp_path / "units" / "swarmtrain.service"
    first = Unit(SWARMTRAIN, Path("/a.toml"), user_unit=True)
    install(first, path, force=False)
    second = Unit(SWARMTRAIN, Path("/b.toml"), user_unit=True)
    with pytest.raises(ValueError, match="exists: --force replaces it"):
        install(second, path, force=False)
    assert path.read_text() == first.text()
    install(second, path, force=True)
    assert path.read_text() == second.text()
    assert [p.name for p in path.parent.iterdir()] == ["swarmtrain.service"]


@pytest.fixture
def entry_point(monkeypatch):
    monkeypatch.setattr(service, "entry_point", lambda: SWARMTRAIN)


def test_install_writes_the_unit_and_prints_how_to_enable_it(tmp_path, entry_point, capsys):
    config = tmp_path / "node.toml"
    config.write_text('run = "myrun"\n')
    out = tmp_path / "swarmtrain.service"
    argv = ["service", "install", "--user", "--config", str(config), "--out", str(out)]
    assert main(argv) == 0
    assert _read(out.read_text())["Service"]["ExecStart"].endswith(f"--config {config}")
    printed = capsys.readouterr().out
    assert "systemctl --user enable --now swarmtrain.service" in printed
    assert "journalctl --user -u swarmtrain.service" in printed


def test_install_refuses_a_config_the_node_would_refuse(tmp_path, entry_point, capsys):
    config = tmp_path / "node.toml"
    config.write_text("stages = -1\n")
    out = tmp_path / "swarmtrain.service"
    assert main(["service", "install", "--config", str(config), "--out", str(out)]) == 2
    assert "line 1: stages: must be 1 or more" in capsys.readouterr().err
    assert not out.exists()
