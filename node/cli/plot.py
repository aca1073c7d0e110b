"""Line charts as PNG files, drawn by matplotlib (Agg) where it is installed.

matplotlib is an optional extra (``pip install 'swarmtrain[plot]'``): a node needs no
charts, so where it is missing ``write_line_chart`` raises ``PlotUnavailable`` and the
caller writes its figures as CSV alone."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

INSTALL_HINT = "pip install 'swarmtrain[plot]'"


class PlotUnavailable(ImportError):
    """matplotlib is not installed; the message says how to install it."""


def write_line_chart(
    path: Path,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str = "",
    x_label: str = "",
    y_label: str = "",
    markers: Sequence[tuple[float, str]] = (),
    width: int = 800,
    height: int = 480,
) -> None:
    """Draw ``series`` (name -> (x, y) points) as lines and write a ``width`` x ``height``
    PNG at ``path`` atomically (a reader never sees half a file). Non-finite points are
    left out and the line joins their finite neighbours; ``markers`` are (x, label)
    events drawn as labelled dashed vertical lines. Raises ``PlotUnavailable`` without
    matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailable(f"matplotlib is not installed ({INSTALL_HINT})") from e

    dpi = 100
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)  # draws on Agg, whatever backend pyplot would pick
    ax = figure.add_subplot()
    for name, points in series.items():
        finite = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
        ax.plot([x for x, _ in finite], [y for _, y in finite], label=name, linewidth=1.5)
    for x, label in markers:
        if math.isfinite(x):
            ax.axvline(x, color="grey", linestyle="--", linewidth=0.8)
            ax.annotate(label, (x, 1), xycoords=("data", "axes fraction"), rotation=90,
                        xytext=(-2, -4), textcoords="offset points", ha="right", va="top",
                        fontsize=8, color="dimgrey")  # fmt: skip
    ax.set(title=title, xlabel=x_label, ylabel=y_label)
    ax.grid(True, color="0.9")
    if series:
        ax.legend(loc="best", fontsize=9)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            figure.savefig(f, format="png")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
