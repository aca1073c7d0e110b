"""The ``swarmtrain`` command line: ``main`` dispatches to one module per subcommand;
``args`` holds the subcommands' arguments (light: no torch, no hivemind), and ``config``
(settings files, ``--config``) and ``service`` (systemd units), light too, hold their own."""
