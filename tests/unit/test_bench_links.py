"""The links benchmark's pure parts: run configurations, specs, bytes by purpose."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from protocol.run_spec import (
    DEFAULT_AVERAGING_COMPRESSION,
    DEFAULT_COMPRESSION,
    read_spec_file,
)
from scripts.bench_swarm import (
    CONFIGS,
    Record,
    _config,
    _purpose_bytes,
    call_names,
    call_split,
    with_overrides,
    write_spec,
)
from scripts.swarm_bench import wire


def test_configs_become_signed_specs_with_h_and_target_batch(tmp_path) -> None:
    args = argparse.Namespace(inner_steps=10, target_batch=16)
    runs = set()
    for name in ("default", "diloco-int4-zip"):
        path = write_spec(tmp_path / name, "tiny", 2, with_overrides(CONFIGS[name], args))
        spec = read_spec_file(path.read_text()).spec
        runs.add(spec.run)
        assert spec.optim.target_batch_size == 16
        if name == "default":
            assert (spec.averaging.mode, spec.averaging.inner_steps) == ("gradient", 50)
            assert (spec.compression, spec.averaging.compression) == ("int4", "uint8")
        else:
            assert (spec.averaging.mode, spec.averaging.inner_steps) == ("diloco", 10)
            assert (spec.averaging.density, spec.averaging.compression) == (0.1, "uint8")
            assert spec.compression == "int4"
    assert len(runs) == 2  # a run (and an owner) per configuration


def test_every_named_config_is_a_run_spec_a_node_accepts(tmp_path) -> None:
    args = argparse.Namespace(inner_steps=None, target_batch=None)
    for name, settings in CONFIGS.items():
        preset = "small" if "arch" in settings else "tiny"  # a rank is a width's share
        spec = read_spec_file(
            write_spec(tmp_path / name, preset, 2, with_overrides(settings, args)).read_text()
        )
        assert spec.spec.compression == settings.get("compression", DEFAULT_COMPRESSION), name
        for field, value in settings.get("arch", {}).items():
            assert getattr(spec.spec.model, field) == value, name
        averaging = settings.get("averaging", {}).get("compression", DEFAULT_AVERAGING_COMPRESSION)
        assert spec.spec.averaging.compression == averaging, name


def test_config_by_name_or_json_and_bad_ones_refused() -> None:
    assert _config("diloco") == ("diloco", CONFIGS["diloco"])
    assert _config('mine={"compression": "uint8"}') == ("mine", {"compression": "uint8"})
    for bad in ("nosuch", "x={not json", "x=[1]"):
        with pytest.raises(argparse.ArgumentTypeError):
            _config(bad)


def test_purpose_bytes_leave_the_uncounted_rest_as_other() -> None:
    rec = Record()
    rec.traffic = {
        "measured": {"activations": 100, "gradients": 50, "averaging": 0, "state": 7},
        "end": {"activations": 1100, "gradients": 550, "averaging": 300, "state": 7},
    }
    rec.wire = {"measured": 1000, "end": 3000}
    moved = _purpose_bytes(rec, "measured", "end")
    assert moved == {"activations": 1000, "gradients": 500, "averaging": 300, "state": 0,
                     "other": 200}  # fmt: skip


def test_node_traffic_reads_the_metrics_exposition(monkeypatch) -> None:
    family = CounterMetricFamily(
        "swarmtrain_network_bytes", "bytes", labels=["purpose", "direction"]
    )
    family.add_metric(["averaging", "sent"], 12345)
    family.add_metric(["activations", "received"], 2.5e9)

    class One:
        def collect(self):
            return [family]

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()

    class Done:
        stdout = text

    monkeypatch.setattr(wire.subprocess, "run", lambda *a, **k: Done())
    got = wire.node_traffic("http://127.0.0.1:1/metrics")
    assert got == {("averaging", "sent"): 12345, ("activations", "received"): 2_500_000_000}


def test_call_split_takes_medians_per_call_and_the_mean_micro_batch() -> None:
    assert call_names(3) == ["fwd0", "fwd1", "loss2", "bwd1", "bwd0"]
    rec = Record()
    rec.mbs = [
        {"t": 1.0, "samples": 8, "calls": (0.1, 0.5, 0.2)},
        {"t": 2.0, "samples": 8, "calls": (0.3, 0.7, 0.2)},
        {"t": 3.0, "samples": 8, "calls": (0.2, 0.6, 0.2)},
        {"t": 9.0, "samples": 8, "calls": (9.0, 9.0, 9.0)},  # outside the span
        {"t": 2.5, "samples": 8, "route": ["a", "b"]},  # a trainer without call times
    ]
    split = call_split(rec, 0.0, 5.0, 2)
    assert split["fwd0"] == 0.2 and split["loss1"] == 0.6 and split["bwd0"] == 0.2
    assert abs(split["mb"] - 1.0) < 1e-9 and split["samples/mb"] == 8
    assert call_split(rec, 10.0, 20.0, 2) == {}
