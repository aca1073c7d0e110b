"""Charts: the PNG that matplotlib draws is read back as pixels, so the tests check what a
viewer sees (where a line runs, where a marker stands); without matplotlib (the optional
``plot`` extra) the demo writes its CSV and says how to get the PNG."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from node.cli.plot import INSTALL_HINT, PlotUnavailable, write_line_chart

try:
    # Imported at collection, not in a test: the first import of matplotlib's font
    # manager may run fc-list once to build its cache, and a unit test may start no process.
    import matplotlib.font_manager  # noqa: F401
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread
except ImportError:
    imread = None

needs_matplotlib = pytest.mark.skipif(imread is None, reason="matplotlib (the plot extra)")
BLUE = "#1f77b4"  # matplotlib's first series colour


def _where(path: Path, color: str) -> tuple[np.ndarray, np.ndarray]:
    """(columns, rows) of the pixels of ``color`` (within antialiasing's tolerance)."""
    rgb = imread(path)[..., :3]
    near = np.abs(rgb - np.array(to_rgb(color))).max(axis=-1) < 0.03
    rows, cols = np.nonzero(near)
    return cols, rows


@needs_matplotlib
def test_a_falling_series_is_drawn_falling_at_the_size_asked(tmp_path: Path):
    path = tmp_path / "chart.png"
    write_line_chart(path, {"loss": [(float(x), 10.0 - x) for x in range(11)]}, width=640,
                     height=400, title="t", x_label="samples", y_label="loss")  # fmt: skip
    assert imread(path).shape[:2] == (400, 640)
    cols, rows = _where(path, BLUE)
    left, right = cols < np.percentile(cols, 20), cols > np.percentile(cols, 80)
    assert rows[left].mean() < rows[right].mean()  # image rows grow downwards


@needs_matplotlib
def test_non_finite_points_are_skipped_and_the_line_joins_its_neighbours(tmp_path: Path):
    path = tmp_path / "chart.png"
    points = [(0.0, 1.0), (1.0, math.nan), (2.0, math.inf), (3.0, 1.0), (math.nan, 0.5)]
    write_line_chart(path, {"flat": points})
    cols, _ = _where(path, BLUE)
    line = np.unique(cols[cols > np.percentile(cols, 10)])  # past the legend's sample
    assert np.diff(line).max() <= 2, "the line has a gap where the non-finite points were"


@needs_matplotlib
def test_markers_are_vertical_lines_and_the_file_is_replaced_whole(tmp_path: Path):
    path = tmp_path / "chart.png"
    path.write_bytes(b"old")
    write_line_chart(path, {"a": [(0.0, 0.0), (10.0, 1.0)]}, markers=[(5.0, "SIGKILL peer1"),
                     (math.nan, "never drawn")])  # fmt: skip
    cols, rows = _where(path, "grey")
    column = np.bincount(cols).argmax()
    assert np.ptp(rows[cols == column]) > 200  # a dashed line down most of the plot
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]  # no temporary file left


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib as if it were not installed."""
    for name in ["matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_without_matplotlib_the_chart_says_how_to_install_it(tmp_path, no_matplotlib):
    with pytest.raises(PlotUnavailable, match=INSTALL_HINT.replace("[", r"\[")):
        write_line_chart(tmp_path / "chart.png", {"a": [(0.0, 1.0)]})
    assert not (tmp_path / "chart.png").exists()


def test_without_matplotlib_the_demo_writes_the_csv_and_one_line(tmp_path, no_matplotlib, capsys):
    from node.cli.demo import Demo
    from node.cli.train import Curve

    demo = Demo(argparse.Namespace(out=tmp_path, stages=2, peers=2))
    demo.write_curve(Curve(train=[(8, 5.0), (16, 4.0)], val=[(0, 5.5), (16, 4.1)]))
    assert (tmp_path / "loss.csv").read_text().startswith("samples,train_loss,val_loss\n")
    assert not (tmp_path / "loss.png").exists()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and INSTALL_HINT in out and "loss.csv" in out
