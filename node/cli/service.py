"""``swarmtrain service install``: a systemd unit that runs ``swarmtrain node --config FILE``.

It writes the unit and prints the ``systemctl`` commands that enable it; it runs none
of them itself. The unit restarts the node when it fails (not when it exits 2: a bad
setting needs a person, not a restart loop), and stops it with SIGTERM sent to the node
alone (``KillMode=mixed``), so that the node announces its departure through its own
libp2p daemon and checkpoints before it stops that daemon.

Light, like ``node.cli.args``: the standard library only.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

UNIT_NAME = "swarmtrain.service"
SYSTEM_DIR = Path("/etc/systemd/system")
# Stopping announces the departure (within 5 s), lets a round whose group formed end (at
# most ``averager.FINISH_ROUND_S``) and checkpoints each stage held; past this, systemd
# sends SIGKILL.
STOP_TIMEOUT_S = 60
RESTART_DELAY_S = 10
BAD_INPUT_STATUS = 2  # node.cli.main: one-line errors about settings


@dataclass(frozen=True)
class Unit:
    """What a unit file says: the command it runs and how systemd treats it."""

    executable: Path  # the swarmtrain entry point
    config: Path  # absolute
    user_unit: bool  # under the user's own systemd manager (systemctl --user)
    run_as: str | None = None  # system units: the account the node runs as

    def text(self) -> str:
        """The unit file."""
        command = " ".join(
            _quote(str(a)) for a in (self.executable, "node", "--config", self.config)
        )
        service = [
            "Type=exec",
            f"ExecStart={command}",
            # What the file names relative to the working directory (--invite @FILE) is
            # found beside it, as its path settings are.
            f"WorkingDirectory={_escape(str(self.config.parent))}",
            *([f"User={_escape(self.run_as)}"] if self.run_as else []),
            "Environment=PYTHONUNBUFFERED=1",
            "Restart=on-failure",
            f"RestartSec={RESTART_DELAY_S}",
            f"RestartPreventExitStatus={BAD_INPUT_STATUS}",
            "KillSignal=SIGTERM",
            "KillMode=mixed",
            f"TimeoutStopSec={STOP_TIMEOUT_S}",
        ]
        return "\n".join(
            [
                "# Written by `swarmtrain service install`; the node's settings are in its",
                "# --config file: edit that, then restart the service.",
                "[Unit]",
                f"Description=swarmtrain node ({_escape(str(self.config))})",
                # The system's network; a user's manager has no such target to wait for.
                *([] if self.user_unit else ["Wants=network-online.target"]),
                *([] if self.user_unit else ["After=network-online.target"]),
                "",
                "[Service]",
                *service,
                "",
                "[Install]",
                f"WantedBy={'default.target' if self.user_unit else 'multi-user.target'}",
                "",
            ]
        )

    def instructions(self, path: Path) -> str:
        """What a person runs next: systemctl to enable and start the unit at ``path``,
        and where its log is."""
        ctl = "systemctl --user" if self.user_unit else "sudo systemctl"
        journal = "journalctl --user" if self.user_unit else "journalctl"
        name = path.name
        lines = [
            f"wrote {path}; to start the node now and at every boot:",
            f"  {ctl} daemon-reload",
            f"  {ctl} enable --now {name}",
        ]
        if self.user_unit:
            lines.append(
                f"  loginctl enable-linger {getpass.getuser()}  # keep it when you log out"
            )
        lines += [
            f"its log: {journal} -u {name} -f",
            f"stop it: {ctl} stop {name} (the node announces that it leaves)",
        ]
        return "\n".join(lines) + "\n"


def entry_point() -> Path:
    """The ``swarmtrain`` script beside the running interpreter (its environment's)."""
    path = Path(sysconfig.get_path("scripts")) / "swarmtrain"
    if not os.access(path, os.X_OK):
        raise ValueError(
            f"no swarmtrain command at {path}: install the package in this environment "
            "(pip install swarmtrain, or pip install -e . in a checkout)"
        )
    return path


def default_path(user_unit: bool) -> Path:
    """Where systemd looks for the unit: the user's own units, or the system's."""
    if not user_unit:
        return SYSTEM_DIR / UNIT_NAME
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "systemd" / "user" / UNIT_NAME


def system_account() -> str | None:
    """Whom a system unit runs the node as: the person who ran ``sudo``, or the current
    account unless it is root (None: systemd's default, root)."""
    name = os.environ.get("SUDO_USER") or getpass.getuser()
    return None if name == "root" else name


def install(unit: Unit, path: Path, force: bool) -> None:
    """Write ``unit`` at ``path``; an existing file is replaced only with ``force``."""
    if path.exists() and not force:
        raise ValueError(f"{path} exists: --force replaces it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(unit.text(), encoding="utf-8")
    tmp.chmod(0o644)
    tmp.replace(path)


def _escape(text: str) -> str:
    """Text systemd takes as written: ``%`` starts a specifier and ``$`` a variable."""
    return text.replace("%", "%%").replace("$", "$$")


def _quote(word: str) -> str:
    """One word of an ``ExecStart=`` command line."""
    word = _escape(word)
    if re.fullmatch(r"[\w@%+=:,./-]+", word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def service_arguments(p: argparse.ArgumentParser) -> None:
    """``swarmtrain service``."""
    actions = p.add_subparsers(dest="action", required=True)
    install_ = actions.add_parser(
        "install", help="write a systemd unit that runs swarmtrain node --config FILE"
    )
    install_.add_argument(
        "--config",
        required=True,
        type=Path,
        metavar="FILE",
        help="the node's settings file (swarmtrain config init writes one); checked now",
    )
    install_.add_argument(
        "--user",
        action="store_true",
        help="a unit of your own systemd manager (systemctl --user), not a system unit",
    )
    install_.add_argument(
        "--out",
        type=Path,
        metavar="PATH",
        help=f"where to write it (default ~/.config/systemd/user/{UNIT_NAME} with --user, "
        f"else {SYSTEM_DIR / UNIT_NAME})",
    )
    install_.add_argument("--force", action="store_true", help="replace an existing unit file")


def run(args: argparse.Namespace) -> int:
    from node.cli.config import use_config_file
    from node.cli.main import command_parser

    config = args.config.expanduser().absolute()
    use_config_file(command_parser("node"), config)  # a bad file: refused now, not at boot
    unit = Unit(
        executable=entry_point(),
        config=config,
        user_unit=args.user,
        run_as=None if args.user else system_account(),
    )
    path = args.out or default_path(args.user)
    install(unit, path, args.force)
    print(unit.instructions(path), end="")
    return 0
