"""Loss-curve charts as PNG files, with no plotting dependency.

Nodes run where matplotlib or PIL may be missing, so this module rasterises a line chart
itself (a built-in 5x7 bitmap font, Bresenham lines with a 2x2 brush) and encodes the PNG
with zlib and struct only."""

from __future__ import annotations

import colorsys
import contextlib
import math
import os
import struct
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

Color = tuple[int, int, int]

# Series colours: distinct hues that stay readable on white; grey is kept for markers.
PALETTE: tuple[Color, ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (23, 190, 207),
)
BACKGROUND: Color = (255, 255, 255)
FRAME: Color = (0, 0, 0)
TEXT: Color = (30, 30, 30)
GRID: Color = (228, 228, 228)
MARKER: Color = (120, 120, 120)

# 5x7 glyphs, one string of seven rows each; lower case is drawn with the upper-case glyph.
_GLYPH_ROWS: dict[str, str] = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#",
    "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.",
    "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####",
    "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#",
    "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
    "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    " ": "..... ..... ..... ..... ..... ..... .....",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    "-": "..... ..... ..... .###. ..... ..... .....",
    "_": "..... ..... ..... ..... ..... ..... #####",
    "/": "..... ....# ...#. ..#.. .#... #.... .....",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    "=": "..... ..... ##### ..... ##### ..... .....",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..",
}
# Each glyph as the (column, row) offsets of its lit pixels, so drawing skips the blanks.
_GLYPHS: dict[str, tuple[tuple[int, int], ...]] = {
    ch: tuple(
        (gx, gy)
        for gy, row in enumerate(rows.split())
        for gx, cell in enumerate(row)
        if cell == "#"
    )
    for ch, rows in _GLYPH_ROWS.items()
}


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
    """Draw ``series`` (name -> (x, y) points) as coloured polylines and write a PNG at
    ``path`` atomically. Non-finite points are skipped rather than failing the chart;
    ``markers`` are (x, label) events drawn as dashed vertical lines."""
    if width < 160 or height < 120:
        raise ValueError(f"chart {width}x{height} is too small to lay out (min 160x120)")
    clean = {name: _finite_points(points) for name, points in series.items()}
    marks = [(float(x), label) for x, label in markers if math.isfinite(x)]
    xs = [x for pts in clean.values() for x, _ in pts] + [x for x, _ in marks]
    ys = [y for pts in clean.values() for _, y in pts]

    s = max(1, min(width // 640, height // 400))  # text scale: one font pixel per s pixels
    th, gap, tick = 7 * s, 6 * s, 4 * s
    canvas = _Canvas(width, height)

    # Vertical layout: title, legend rows, plot, tick labels, x label.
    top = 8 * s
    title_y = top
    if title:
        top += 2 * th + gap + 3 * s
    legend_rows = _legend_rows(list(clean), width - 16 * s, s)
    legend_y = top
    if legend_rows:
        top += len(legend_rows) * (th + 5 * s) + 3 * s
    plot_top = top
    plot_bottom = height - (8 * s + tick + 3 * s + th + (gap + th if x_label else 0))
    plot_bottom = max(plot_bottom, plot_top + 10)

    y_ticks, y_lo, y_hi, y_text = _axis(*_span(ys), max(2, (plot_bottom - plot_top) // (50 * s)))
    label_w = max(_text_width(t, s) for t in y_text)
    plot_left = 8 * s + (th + gap if y_label else 0) + label_w + 3 * s + tick
    x_ticks, x_lo, x_hi, x_text = _x_axis(_span(xs), width - plot_left - 16 * s, s)
    plot_right = width - max(16 * s, _text_width(x_text[-1], s) // 2 + 8 * s)
    plot_right = max(plot_right, plot_left + 10)

    def col(x: float) -> int:
        return plot_left + round((x - x_lo) / (x_hi - x_lo) * (plot_right - plot_left))

    def row(y: float) -> int:
        return plot_bottom - round((y - y_lo) / (y_hi - y_lo) * (plot_bottom - plot_top))

    for t in x_ticks:
        canvas.rect(col(t), plot_top, 1, plot_bottom - plot_top, GRID)
    for t in y_ticks:
        canvas.rect(plot_left, row(t), plot_right - plot_left, 1, GRID)
    for x, _ in marks:
        for y0 in range(plot_top, plot_bottom, 10 * s):
            canvas.rect(col(x), y0, 1, min(6 * s, plot_bottom - y0), MARKER)

    canvas.rect(plot_left, plot_top, plot_right - plot_left + 1, 1, FRAME)
    canvas.rect(plot_left, plot_bottom, plot_right - plot_left + 1, 1, FRAME)
    canvas.rect(plot_left, plot_top, 1, plot_bottom - plot_top + 1, FRAME)
    canvas.rect(plot_right, plot_top, 1, plot_bottom - plot_top + 1, FRAME)

    for i, pts in enumerate(clean.values()):
        if pts:
            canvas.polyline([(col(x), row(y)) for x, y in pts], series_color(i), s)

    for t, text in zip(x_ticks, x_text, strict=True):
        canvas.rect(col(t), plot_bottom + 1, 1, tick, FRAME)
        canvas.text(col(t) - _text_width(text, s) // 2, plot_bottom + tick + 3 * s, text, TEXT, s)
    for t, text in zip(y_ticks, y_text, strict=True):
        canvas.rect(plot_left - tick, row(t), tick, 1, FRAME)
        x0 = plot_left - tick - 3 * s - _text_width(text, s)
        canvas.text(x0, row(t) - th // 2, text, TEXT, s)
    if x_label:
        x0 = (plot_left + plot_right - _text_width(x_label, s)) // 2
        canvas.text(x0, height - 8 * s - th, x_label, TEXT, s)
    if y_label:
        y0 = (plot_top + plot_bottom + _text_width(y_label, s)) // 2
        canvas.text(8 * s, y0, y_label, TEXT, s, vertical=True)

    _draw_marker_labels(canvas, [(col(x), label) for x, label in marks], plot_top, plot_right, s)
    _draw_legend(canvas, legend_rows, legend_y, s)
    if title:
        x0 = (plot_left + plot_right - _text_width(title, 2 * s)) // 2
        canvas.text(max(x0, 4 * s), title_y, title, TEXT, 2 * s)

    _write_atomic(Path(path), _encode_png(width, height, canvas.px))


def series_color(index: int) -> Color:
    """Colour of the ``index``-th series: the palette first, then hues spread by the golden
    ratio so that any number of series stay apart."""
    if index < len(PALETTE):
        return PALETTE[index]
    r, g, b = colorsys.hsv_to_rgb((index * 0.618034) % 1.0, 0.85, 0.8)
    return (round(r * 255), round(g * 255), round(b * 255))


def _finite_points(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Drop NaN and inf points: a diverged step should not cost the whole chart, and the line
    joins its finite neighbours so sparse curves do not fall apart into dots."""
    pts = [(float(x), float(y)) for x, y in points]
    return [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)]


def _span(values: list[float]) -> tuple[float, float]:
    """Data range, widened when empty or (nearly) constant so the axis has a length."""
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    if hi - lo <= max(abs(lo), abs(hi)) * 1e-9:
        pad = abs(lo) * 0.1 if lo != 0 else 1.0
        return lo - pad, hi + pad
    return lo, hi


def _axis(lo: float, hi: float, target: int) -> tuple[list[float], float, float, list[str]]:
    """Ticks at a 1/2/5 x 10^k step, the axis bounds widened to whole steps, and labels."""
    raw = (hi - lo) / target
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1.0, 2.0, 5.0, 10.0) if m * mag >= raw * (1 - 1e-9))
    k0 = math.floor(lo / step + 1e-9)
    k1 = max(math.ceil(hi / step - 1e-9), k0 + 1)
    ticks = [k * step for k in range(k0, k1 + 1)]
    # min/max: k * step can land a rounding error inside the data it should enclose.
    return ticks, min(k0 * step, lo), max(k1 * step, hi), _tick_labels(ticks, step)


def _x_axis(
    span: tuple[float, float], plot_w: int, s: int
) -> tuple[list[float], float, float, list[str]]:
    """X ticks as dense as the labels allow without touching each other."""
    for target in range(max(2, plot_w // (60 * s)), 1, -1):
        ticks, lo, hi, text = _axis(*span, target)
        spacing = plot_w * (ticks[1] - ticks[0]) / (hi - lo)
        if spacing >= max(_text_width(t, s) for t in text) + 8 * s:
            break
    return ticks, lo, hi, text


def _tick_labels(ticks: list[float], step: float) -> list[str]:
    """Just enough decimals to tell ticks apart; scientific notation for extreme values."""
    biggest = max(abs(t) for t in ticks)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    out = []
    for t in ticks:
        t = 0.0 if abs(t) < step * 1e-6 else t
        if biggest >= 1e6 or biggest < 1e-3:
            digits = max(0, math.floor(math.log10(biggest)) - math.floor(math.log10(step) + 1e-9))
            out.append(f"{t:.{digits}e}")
        else:
            out.append(f"{t:.{decimals}f}")
    return out


def _text_width(text: str, scale: int) -> int:
    return max(0, len(text) * 6 * scale - scale)


def _legend_rows(names: list[str], avail: int, s: int) -> list[list[tuple[int, str]]]:
    """Pack (series index, name) entries into centred rows that fit the image width."""
    rows: list[list[tuple[int, str]]] = []
    used = avail
    for i, name in enumerate(names):
        w = _legend_entry_width(name, s)
        if not rows or used + 14 * s + w > avail:
            rows.append([])
            used = -14 * s
        rows[-1].append((i, name))
        used += 14 * s + w
    return rows


def _legend_entry_width(name: str, s: int) -> int:
    return 16 * s + 4 * s + _text_width(name, s)


def _draw_legend(canvas: _Canvas, rows: list[list[tuple[int, str]]], y: int, s: int) -> None:
    for entries in rows:
        total = sum(_legend_entry_width(n, s) for _, n in entries) + 14 * s * (len(entries) - 1)
        x = (canvas.w - total) // 2
        for i, name in entries:
            canvas.rect(x, y + 3 * s - s // 2, 16 * s, 2 * s, series_color(i))
            canvas.text(x + 20 * s, y, name, TEXT, s)
            x += _legend_entry_width(name, s) + 14 * s
        y += 12 * s


def _draw_marker_labels(
    canvas: _Canvas, marks: list[tuple[int, str]], plot_top: int, plot_right: int, s: int
) -> None:
    """Label each marker line near the plot top, stacking labels that would overlap."""
    lane_ends: list[int] = []
    for x, label in sorted(marks):
        if not label:
            continue
        w = _text_width(label, s)
        x0 = x + 4 * s if x + 4 * s + w <= plot_right - 3 * s else x - 4 * s - w
        lane = next((i for i, end in enumerate(lane_ends) if end < x0 - 10 * s), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(0)
        lane_ends[lane] = x0 + w
        y0 = plot_top + 4 * s + lane * 11 * s
        canvas.rect(x0 - s, y0 - s, w + 2 * s, 9 * s, BACKGROUND)
        canvas.text(x0, y0, label, TEXT, s)


class _Canvas:
    """An RGB raster in one bytearray; drawing outside the image is silently clipped."""

    def __init__(self, width: int, height: int):
        self.w, self.h = width, height
        self.px = bytearray(bytes(BACKGROUND) * (width * height))

    def rect(self, x: int, y: int, w: int, h: int, color: Color) -> None:
        x0, x1 = max(x, 0), min(x + w, self.w)
        if x1 <= x0:
            return
        fill = bytes(color) * (x1 - x0)
        for yy in range(max(y, 0), min(y + h, self.h)):
            i = 3 * (yy * self.w + x0)
            self.px[i : i + len(fill)] = fill

    def polyline(self, points: list[tuple[int, int]], color: Color, s: int) -> None:
        """A 2*s pixel thick line through ``points``; a lone point becomes a small square."""
        brush = 2 * s
        if len(points) == 1:
            x, y = points[0]
            self.rect(x - brush, y - brush, 2 * brush, 2 * brush, color)
            return
        seen: set[tuple[int, int]] = set()
        for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
            for p in _bresenham(x0, y0, x1, y1):
                if p not in seen:
                    seen.add(p)
                    self.rect(p[0], p[1], brush, brush, color)

    def text(
        self, x: int, y: int, text: str, color: Color, scale: int, vertical: bool = False
    ) -> None:
        """Draw from the top-left corner, or upwards from the bottom-left when ``vertical``."""
        for n, ch in enumerate(text.upper()):
            for gx, gy in _GLYPHS.get(ch, _GLYPHS["?"]):
                along = (n * 6 + gx) * scale
                if vertical:
                    self.rect(x + gy * scale, y - along - scale, scale, scale, color)
                else:
                    self.rect(x + along, y + gy * scale, scale, scale, color)


def _bresenham(x0: int, y0: int, x1: int, y1: int) -> list[tuple[int, int]]:
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x1 >= x0 else -1), (1 if y1 >= y0 else -1)
    err, out = dx + dy, []
    while True:
        out.append((x0, y0))
        if x0 == x1 and y0 == y1:
            return out
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x0 += sx
        if e2 <= dx:
            err += dx
            y0 += sy


def _encode_png(width: int, height: int, px: bytearray) -> bytes:
    """8-bit RGB PNG, every row with filter type 0 (none): zlib alone compresses flat
    chart backgrounds well, and it keeps the encoder trivially correct."""
    stride = 3 * width
    raw = b"".join(b"\x00" + px[r * stride : (r + 1) * stride] for r in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


def _write_atomic(path: Path, data: bytes) -> None:
    """Temp file beside ``path`` then os.replace, so a reader never sees half a PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
