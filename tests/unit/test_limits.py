"""The token bucket behind ``--max-upload-mbps`` / ``--max-download-mbps``, driven with a
virtual clock; and ``Traffic``'s counters and waits (its sharing with the averager
processes: tests/live/test_limits.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from models.memory import stage_memory as count_stage_memory
from node.cli.args import parse_memory
from node.cli.config import ConfigError, template, use_config_file
from node.cli.main import command_parser
from node.limits import (
    ACTIVATIONS,
    AVERAGING,
    PURPOSE,
    RECEIVED,
    SENT,
    STATE,
    TokenBucket,
    Traffic,
    burst_for,
    current_purpose,
    mbps_to_bytes,
    memory_refusal,
    stage_bytes_per_sample,
    stages_within,
    throughput_within,
)
from node.measure.bandwidth import advertised
from protocol.identity import peer_id_of
from protocol.run_spec import make_run_spec


def test_a_full_bucket_lets_its_burst_through_at_once_then_holds_the_rate():
    b = TokenBucket.full(rate=1000.0, burst=500.0, now=0.0)
    assert b.take(500, 0.0) == 0.0
    assert b.take(100, 0.0) == pytest.approx(0.1)  # 100 bytes at 1000 B/s
    assert b.take(100, 0.0) == pytest.approx(0.2)  # waits for the one before it too
    assert b.take(0, 0.2) == 0.0  # the debt is paid off by then


def test_over_a_long_run_the_bytes_granted_follow_the_rate():
    """Takes as fast as the bucket allows, for 100 virtual seconds: what went through is
    rate x time plus at most one burst."""
    rate, burst = 1e6, 2.5e5
    b = TokenBucket.full(rate, burst, 0.0)
    now, sent = 0.0, 0
    while now < 100.0:
        now += b.take(65_536, now)  # the caller sleeps the wait, then sends
        sent += 65_536
    assert rate * now <= sent <= rate * now + burst + 65_536


def test_an_idle_bucket_saves_at_most_its_burst():
    b = TokenBucket.full(rate=100.0, burst=50.0, now=0.0)
    b.take(50, 0.0)
    b.refill(1000.0)
    assert b.tokens == 50.0
    assert b.take(60, 1000.0) == pytest.approx(0.1)


def test_a_message_larger_than_the_burst_still_goes():
    b = TokenBucket.full(rate=10.0, burst=1.0, now=0.0)
    assert b.take(101, 0.0) == pytest.approx(10.0)


def test_a_clock_that_goes_back_refills_nothing():
    b = TokenBucket(rate=10.0, burst=100.0, tokens=0.0, at=5.0)
    b.refill(4.0)
    assert b.tokens == 0.0 and b.at == 5.0


@pytest.mark.parametrize("rate, burst", [(0.0, 1.0), (1.0, 0.0), (-1.0, 5.0)])
def test_a_bucket_needs_a_positive_rate_and_burst(rate, burst):
    with pytest.raises(ValueError, match="must be > 0"):
        TokenBucket(rate, burst, 0.0, 0.0)


def test_a_negative_take_is_refused():
    with pytest.raises(ValueError, match="cannot take -1 bytes"):
        TokenBucket.full(1.0, 1.0, 0.0).take(-1, 0.0)


def test_units():
    assert mbps_to_bytes(8) == 1e6
    assert burst_for(mbps_to_bytes(8)) == 250_000
    assert burst_for(1.0) == 2**16


def test_traffic_counts_by_purpose_and_direction_and_waits_for_its_limit():
    t = Traffic()
    t.set_limits(up_mbps=8.0, down_mbps=None)  # 1e6 B/s, a burst of 250,000 bytes

    async def body() -> float:
        started = time.monotonic()
        await t.send(250_000, ACTIVATIONS)  # the burst: no wait
        await t.send(200_000, AVERAGING)  # 0.2 s
        await t.receive(10**9, STATE)  # no download limit: no wait
        return time.monotonic() - started

    elapsed = asyncio.run(body())
    assert 0.18 <= elapsed < 2.0
    c = t.counts()
    assert c.bytes[(ACTIVATIONS, SENT)] == 250_000
    assert c.bytes[(AVERAGING, SENT)] == 200_000
    assert c.bytes[(STATE, RECEIVED)] == 10**9
    assert c.total(SENT) == 450_000 and c.total(RECEIVED) == 10**9
    assert c.waited_s[SENT] == pytest.approx(0.2, abs=0.05) and c.waited_s[RECEIVED] == 0
    assert c.limits == {SENT: 1e6, RECEIVED: None}


def test_a_limit_must_be_positive():
    with pytest.raises(ValueError, match="more than 0 Mbit/s, got 0"):
        Traffic().set_limits(0, None)


def test_the_purpose_is_the_context_s_else_the_default():
    assert current_purpose() == "other"
    token = PURPOSE.set(STATE)
    try:
        assert current_purpose() == STATE
    finally:
        PURPOSE.reset(token)


# -- the settings, and --max-memory's rule ---------------------------------------------


def test_memory_sizes():
    assert parse_memory("8G") == 8 * 2**30
    assert parse_memory("8GiB") == parse_memory("8 GB") == 8 * 2**30
    assert parse_memory("512M") == 512 * 2**20
    assert parse_memory("1.5t") == int(1.5 * 2**40)
    refused = [
        ("8", "give a size with its unit"),
        ("lots", "with its unit"),
        ("xG", "not a size"),
        ("0G", "more than 0"),
        ("-1G", "more than 0"),
        ("8X", "with its unit"),
    ]
    for bad, why in refused:
        with pytest.raises(ValueError, match=why):
            parse_memory(bad)


def test_the_limits_are_flags_and_keys_of_the_settings_file(tmp_path):
    parser = command_parser("node")
    args = parser.parse_args(["--max-upload-mbps", "8", "--max-memory", "2G"])
    assert (args.max_upload_mbps, args.max_download_mbps, args.max_memory) == (8.0, None, "2G")
    path = tmp_path / "node.toml"
    path.write_text('max-upload-mbps = 8\nmax-download-mbps = 20.5\nmax-memory = "512M"\n')
    assert use_config_file(parser, path) == {
        "max_upload_mbps": 8.0,
        "max_download_mbps": 20.5,
        "max_memory": "512M",
    }
    path.write_text('run = "x"\nmax-memory = "plenty"\n')
    with pytest.raises(ConfigError, match=r"line 2: max-memory: 'plenty': give a size"):
        use_config_file(command_parser("node"), path)
    path.write_text("max-upload-mbps = 0\n")
    with pytest.raises(ConfigError, match=r"line 1: max-upload-mbps: must be more than 0"):
        use_config_file(command_parser("node"), path)
    assert "max-upload-mbps" in template(command_parser("node"), "node")


def test_memory_refusal_names_the_stage_that_does_not_fit():
    mib = 2**20
    needs = [3 * mib, 5 * mib, 2 * mib]
    assert memory_refusal(needs, None, [0, 1]) is None
    assert memory_refusal(needs, 8 * mib, [0, 1]) is None
    assert memory_refusal(needs, 4 * mib, [1]) == (
        1,
        "stage 1 needs about 5 MiB, more than --max-memory allows (4 MiB)",
    )
    stage, why = memory_refusal(needs, 6 * mib, [0, 1])
    assert stage == 1 and "besides stage 0" in why
    assert stages_within(needs, 3 * mib) == [0, 2] and stages_within(needs, None) == [0, 1, 2]
    assert stages_within(needs, mib) == []


def test_the_advertised_bandwidth_is_capped_by_the_limits():
    assert advertised((90.0, 300.0), 8.0, None) == (8.0, 300.0)
    assert advertised((5.0, 300.0), 8.0, 100.0) == (5.0, 100.0)
    assert advertised(50.0, None, 20.0) == (50.0, 20.0)  # one declared figure for both
    assert advertised(None, 8.0, 20.0) == (8.0, 20.0)  # unmeasured: the limits
    assert advertised(None, 8.0, None) is None  # still unknown one way
    assert advertised(None, None, None) is None


# -- what a stage moves, and the throughput a node announces within its limits ----------


def _spec(**settings):
    owner = peer_id_of(Ed25519PrivateKey.generate().public_key())
    return make_run_spec("lim", "tiny", 2, owner=owner, **settings)


def test_what_a_stage_moves_per_sample():
    plain = {"compression": "none", "averaging": {"compression": "none"}}
    spec = _spec(**plain)  # tiny: 64 positions of 64 floats, 32 samples a step
    hidden, tokens = 64 * 64 * 4, 64 * 8
    params = [count_stage_memory(spec.model, spec.stage_range(s)).parameters for s in (0, 1)]
    rounds = [2 * 4 * p / 32 for p in params]
    # stage 0: token ids in twice (forward, backward) and grad_outputs in; outputs out
    assert stage_bytes_per_sample(spec, 0) == (hidden + rounds[0], 2 * tokens + hidden + rounds[0])
    # the last stage: hidden states and targets in; the loss and their gradient out
    assert stage_bytes_per_sample(spec, 1) == (8 + hidden + rounds[1], hidden + tokens + rounds[1])
    half = stage_bytes_per_sample(_spec(**plain | {"compression": "float16"}), 1)
    assert half[0] == 8 + hidden // 2 + rounds[1]
    diloco = _spec(compression="none", averaging={"mode": "diloco", "inner_steps": 10,
                                                  "compression": "none"})  # fmt: skip
    assert stage_bytes_per_sample(diloco, 1)[0] == 8 + hidden + rounds[1] / 10
    # The defaults: int4 boundaries (groups of 64: 8 bytes and 32 of codes), 8-bit rounds
    # (a quarter of float32's); compressed DiLoCo sends its density's share of the values.
    int4 = hidden // 4 // 64 * (8 + 32)
    assert stage_bytes_per_sample(_spec(), 1)[0] == 8 + int4 + rounds[1] / 4
    zipped = _spec(averaging={"mode": "diloco", "inner_steps": 10, "density": 0.1})
    assert stage_bytes_per_sample(zipped, 1)[0] == pytest.approx(8 + int4 + rounds[1] / 400)


def test_the_limits_cap_the_throughput_a_node_announces():
    spec = _spec()
    sent, received = stage_bytes_per_sample(spec, 1)
    assert throughput_within(spec, 1, 100.0, None, None) == 100.0
    assert throughput_within(spec, 1, 100.0, 2.0, None) == pytest.approx(2.5e5 / sent)
    assert throughput_within(spec, 1, 100.0, None, 2.0) == pytest.approx(2.5e5 / received)
    assert throughput_within(spec, 1, 5.0, 8.0, 8.0) == 5.0  # compute is the bound
