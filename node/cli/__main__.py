"""``python -m node.cli``: the ``swarmtrain`` command."""

import sys

from node.cli.main import main

sys.exit(main())
