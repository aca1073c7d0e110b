"""The node daemon a volunteer runs, and the ``swarmtrain`` command line.

- ``cli``: the ``swarmtrain`` console script and its subcommands.
- ``progress``: what a person sees of long work: a live line on a terminal, plain lines otherwise.
- ``baseline``: the ``swarmtrain baseline`` subcommand: the single-process reference run.
- ``stage_server``: ``StageServer``, one pipeline stage served over hivemind P2P streams.
- ``stage_client``: the forward / loss / backward calls a trainer makes to stage servers.
- ``stage_wire``: how their tensors travel: chunked streams, size checks before reading.
- ``bandwidth``: ``BandwidthProbe`` and ``measure_bandwidth``: a link's up/down against a peer.
"""
