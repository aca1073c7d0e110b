"""``python -m node.cli``: the ``swarmtrain`` command."""

from node.cli.main import entry

entry()
