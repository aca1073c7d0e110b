"""Averaging among the peers of a stage.

- ``averager``: ``StageAverager``, the round loop a node runs per stage it holds, and
  ``AveragedStageServer``, the stage server that feeds it;
- ``strategies``: what a round averages and how a copy steps (gradient, DiLoCo);
- ``progress``: the peers' progress records in the DHT;
- ``transport``: the hivemind averager process a round's tensors travel through
  (``process``: that process, a ``DecentralizedAverager`` subclass);
- ``download``: a joiner's state, from a peer or from disk; ``state``: a stage's state as
  it travels (checked before it replaces anything);
- ``digests``: parameter digests, and the check that copies are equal.
"""
