"""Averaging among the peers of a stage (``averager``, its hivemind process in ``process``)
and a stage's state as it travels to a joiner or to disk (``state``)."""
