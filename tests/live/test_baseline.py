"""The single-process baseline learns, and its command line reports it."""

import csv
import subprocess
import sys


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
