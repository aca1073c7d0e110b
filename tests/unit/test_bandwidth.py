"""Bandwidth probe settings are checked before anything is sent."""

from __future__ import annotations

import pytest

from node.measure.bandwidth import (
    MAX_PROBE_BYTES,
    BandwidthProbe,
)


def test_probe_settings_are_checked():
    with pytest.raises(ValueError, match="max_bytes must be in 1..2097152"):
        BandwidthProbe(max_bytes=MAX_PROBE_BYTES + 1)
    with pytest.raises(ValueError, match="burst_bytes >= max_bytes"):
        BandwidthProbe(max_bytes=2**20, burst_bytes=2**19)
