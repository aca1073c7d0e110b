"""The node daemon a volunteer runs, and the ``swarmtrain`` command line.

- ``cli``: the ``swarmtrain`` console script and its subcommands.
- ``progress``: what a person sees of long work: a live line on a terminal, plain lines otherwise.
- ``baseline``: the ``swarmtrain baseline`` subcommand: the single-process reference run.
"""
