"""The single-process baseline learns, and its command line reports it."""

import csv
import dataclasses
import math
import subprocess
import sys

from models.config import preset
from models.training import train_baseline


def test_tiny_baseline_learns(corpus):
    model, optim = preset("tiny")
    result = train_baseline(model, optim, corpus, steps=60, eval_every=60, n_stages=2)
    final = result.steps[-1].val_loss
    assert result.initial_val_loss > math.log(256) - 0.1  # starts near uniform bytes
    assert final < 3.3, final  # and learns the bytes of Python source


def test_stage_cut_does_not_change_learning(corpus):
    """One stage or two: the same arithmetic, so the same loss curve (clipping is per stage,
    as in the swarm, so it is off here)."""
    model, optim = preset("tiny")
    optim = dataclasses.replace(optim, grad_clip=0.0)
    one = train_baseline(model, optim, corpus, steps=5, n_stages=1)
    two = train_baseline(model, optim, corpus, steps=5, n_stages=2)
    for a, b in zip(one.steps, two.steps, strict=True):
        assert abs(a.train_loss - b.train_loss) < 1e-4


def test_baseline_command_writes_curve(tmp_path):
    out = tmp_path / "curve.csv"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.cli",
            "baseline",
            "--steps",
            "20",
            "--eval-every",
            "10",
            "--csv",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "val loss" in proc.stdout and "samples/s" in proc.stdout
    rows = list(csv.DictReader(out.open()))
    assert [r["step"] for r in rows] == [str(i) for i in range(21)]
    assert float(rows[-1]["val_loss"]) < float(rows[0]["val_loss"])


def test_baseline_command_reports_bad_data(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "node.cli", "baseline", "--data", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "neither a file nor a directory" in proc.stderr
