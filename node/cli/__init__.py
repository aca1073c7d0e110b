"""The ``swarmtrain`` command line: ``main`` dispatches to one module per subcommand;
``args`` holds every subcommand's arguments (light: no torch, no hivemind)."""
