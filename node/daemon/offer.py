"""What a node offers its run: samples/s per stage within the volunteer's limits, and
bandwidth, measured or declared.

``Offer`` starts empty (nothing announced before the machine is examined); ``fit`` takes
the examined throughput and applies ``--max-upload-mbps`` / ``--max-download-mbps`` and
``--max-memory``; ``measure_bandwidth`` fills in the measured bandwidth once peers serve.
The record a node publishes reads its figures from here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

from hivemind.p2p import P2P, PeerID

from node import events, limits
from node.daemon.join import NodeError
from node.daemon.settings import NodeSettings
from node.measure.bandwidth import BandwidthError, advertised, measure_bandwidth, partners
from node.measure.capacity import stage_memory
from protocol.reachability import relay_peer_id, relayed_throughput
from protocol.records import PeerInfo
from protocol.run_spec import RunSpec

logger = logging.getLogger(__name__)


class Offer:
    """This node's figures, as its record announces them."""

    def __init__(self, settings: NodeSettings) -> None:
        self._settings = settings
        self.throughput: tuple[float, ...] = ()  # samples/s per stage, within the limits
        self.bandwidth: tuple[float, float] | None = None  # measured (up, down), Mbit/s
        self.stage_needs: list[int] = []  # bytes each stage needs (with --max-memory)
        self.fits_every_stage = True  # else it never moves (--max-memory)

    def fit(self, spec: RunSpec, throughput: tuple[float, ...]) -> None:
        """Offer ``throughput`` (samples/s per stage of ``spec``, as examined) within the
        bandwidth and memory limits (``NodeError`` when ``--max-memory`` refuses)."""
        self.throughput = throughput
        logger.info("throughput per stage (samples/s): %s", self.throughput)
        self._fit_bandwidth(spec)
        self._fit_memory(spec)

    def _fit_bandwidth(self, spec: RunSpec) -> None:
        """``--max-upload-mbps`` / ``--max-download-mbps``: announce no more samples/s per
        stage than the limits let the stage move (``limits.throughput_within``), so that
        routing sends it no more calls, and assignment counts no more, than it can serve."""
        up, down = self._settings.max_upload_mbps, self._settings.max_download_mbps
        if up is None and down is None:
            return
        self.throughput = tuple(
            limits.throughput_within(spec, stage, t, up, down)
            for stage, t in enumerate(self.throughput)
        )
        logger.info("within the bandwidth limits, throughput per stage: %s", self.throughput)

    def _fit_memory(self, spec: RunSpec) -> None:
        """``--max-memory``: refuse (``NodeError``, after a ``stage.refused`` event) pinned
        stages that do not fit, and a run none of whose stages does; announce no
        throughput for the stages that do not fit, so that assignment leaves them to
        others; and where some do not fit, never move (``fits_every_stage``)."""
        s, budget = self._settings, self._settings.max_memory
        if budget is None:
            return
        needs = [stage_memory(spec, stage) for stage in range(spec.n_stages)]
        self.stage_needs = needs
        pinned = [stage for stage in (s.stage, s.second_stage) if stage is not None]
        self.check_memory(pinned)
        fits = limits.stages_within(needs, budget)
        if not fits:
            smallest = min(range(len(needs)), key=needs.__getitem__)
            self.check_memory([smallest])
        self.throughput = tuple(t if i in fits else 0.0 for i, t in enumerate(self.throughput))
        self.fits_every_stage = len(fits) == len(needs)
        logger.info("--max-memory: stages %s fit", fits)

    def memory_refusal(self, stages: list[int]) -> tuple[int, str] | None:
        """Why ``stages`` held together do not fit ``--max-memory`` (the stage, the reason),
        or None when they do (or there is no limit)."""
        return limits.memory_refusal(self.stage_needs, self._settings.max_memory, stages)

    def check_memory(self, stages: list[int]) -> None:
        """``NodeError`` (after a ``stage.refused`` event) unless ``stages`` held together
        fit ``--max-memory``."""
        if refusal := self.memory_refusal(stages):
            self._refuse(*refusal)

    def _refuse(self, stage: int, why: str) -> NoReturn:
        events.emit(
            "stage.refused",
            stage=stage,
            need=self.stage_needs[stage],
            max_memory=self._settings.max_memory,
            reason=why,
        )
        raise NodeError(f"refusing stage {stage} of run {self._settings.run}: {why}")

    def advertised_bandwidth(self) -> tuple[float, float] | None:
        """(up, down) Mbit/s as our record says them: measured, else declared, capped by
        ``--max-upload-mbps`` / ``--max-download-mbps``; None: unknown."""
        s = self._settings
        figure = self.bandwidth or s.bandwidth_mbps
        return advertised(figure, s.max_upload_mbps, s.max_download_mbps)

    def bandwidth_source(self) -> str:
        """Where the record's bandwidth comes from: measured, declared (or the limits where
        nothing was measured), or unknown."""
        if self.bandwidth:
            return "measured"
        return "declared" if self.advertised_bandwidth() else "unknown"

    def download_mbps(self) -> float | None:
        """This node's download bandwidth, measured or declared (None: unknown)."""
        return self.bandwidth[1] if self.bandwidth else self._settings.bandwidth_mbps

    def advertised_throughput(
        self, spec: RunSpec, relay: str | None, peers: list[PeerInfo]
    ) -> tuple[float, ...]:
        """Our throughput per stage, capped by the relay path when we serve through
        ``relay`` (``relayed_throughput``; the relay's rate from its record in ``peers``)."""
        if relay is None:
            return self.throughput
        relay_id = relay_peer_id(relay)
        rates = [min(p.bandwidth_up_mbps, p.bandwidth_down_mbps)
                 for p in peers if p.peer_id == relay_id]  # fmt: skip
        model = spec.model
        per_sample = 2 * model.block_size * model.boundary_width * 4  # activations, grads
        return relayed_throughput(self.throughput, rates[0] if rates else 0.0, per_sample)

    async def measure_bandwidth(
        self, p2p: P2P, records: list[PeerInfo], me: str, reached: Callable[[str], bool]
    ) -> bool:
        """Up/down against a serving peer among ``records`` (up to 3 tried, those reached
        first: ``bandwidth.partners``); True once measured, False if it stays unknown."""
        for peer in partners(records, me, reached, me):
            try:
                self.bandwidth = await measure_bandwidth(p2p, PeerID.from_base58(peer))
            except BandwidthError as e:
                logger.warning("could not measure bandwidth: %s", e)
                continue
            logger.info("bandwidth against %s: %.0f up / %.0f down Mbit/s", peer,
                        *self.bandwidth)  # fmt: skip
            return True
        return False
