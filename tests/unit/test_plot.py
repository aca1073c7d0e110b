"""The chart writer's output is decoded here by hand (chunks, CRCs, zlib, row filters), so
the tests check the PNG a viewer would see rather than the writer's own idea of it."""

from __future__ import annotations

import math
import struct
import zlib
from collections import defaultdict
from pathlib import Path

import pytest

from node.cli.plot import (
    _GLYPHS,
    FRAME,
    MARKER,
    PALETTE,
    TEXT,
    _axis,
    series_color,
    write_line_chart,
)

Pixels = dict[tuple[int, int, int], list[tuple[int, int]]]


def _decode_png(path: Path) -> tuple[int, int, Pixels]:
    """Width, height and every colour's (x, y) positions; asserts the PNG is well formed."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks: list[tuple[bytes, bytes]] = []
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(tag + body) == crc, f"bad CRC in {tag!r}"
        chunks.append((tag, body))
        pos += 12 + length
    assert pos == len(data)
    tags = [t for t, _ in chunks]
    assert tags[0] == b"IHDR" and tags[-1] == b"IEND" and b"IDAT" in tags
    width, height, depth, ctype, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, ctype, comp, filt, interlace) == (8, 2, 0, 0, 0)  # 8-bit RGB, plain

    raw = zlib.decompress(b"".join(body for tag, body in chunks if tag == b"IDAT"))
    stride = 3 * width
    assert len(raw) == height * (stride + 1)
    pixels: Pixels = defaultdict(list)
    for y in range(height):
        start = y * (stride + 1)
        assert raw[start] == 0, "writer uses filter type 0 (none) on every row"
        row = raw[start + 1 : start + 1 + stride]
        for x in range(width):
            pixels[tuple(row[3 * x : 3 * x + 3])].append((x, y))
    return width, height, pixels


def _frame(pixels: Pixels, width: int, height: int) -> tuple[int, int, int, int]:
    """Plot box (left, top, right, bottom) found from the long runs of the frame colour."""
    rows, cols = defaultdict(int), defaultdict(int)
    for x, y in pixels[FRAME]:
        rows[y] += 1
        cols[x] += 1
    long_rows = [y for y, n in rows.items() if n > width // 2]
    top, bottom = min(long_rows), max(long_rows)
    long_cols = [x for x, n in cols.items() if n > (bottom - top) // 2]
    return min(long_cols), top, max(long_cols), bottom


def _inside(points: list[tuple[int, int]], box: tuple[int, int, int, int]):
    left, top, right, bottom = box
    return [(x, y) for x, y in points if left <= x <= right + 2 and top <= y <= bottom + 2]


def test_two_series_and_marker_land_where_their_values_say(tmp_path: Path):
    path = tmp_path / "loss.png"
    falling = [(float(x), 1.0 - x / 100) for x in range(0, 101, 5)]
    flat = [(30.0, 0.2), (60.0, 0.2)]
    write_line_chart(
        path,
        {"train": falling, "eval": flat},
        title="Loss",
        x_label="step",
        y_label="loss",
        markers=[(50.0, "killed peer")],
        width=640,
        height=400,
    )
    width, height, pixels = _decode_png(path)
    assert (width, height) == (640, 400)
    box = left, top, right, bottom = _frame(pixels, width, height)
    assert left < width * 0.2 and right > width * 0.8 and bottom - top > height * 0.5

    def col(x: float) -> float:  # the axis spans exactly 0..100 and 0..1 for this data
        return left + x / 100 * (right - left)

    def row(y: float) -> float:
        return bottom - y * (bottom - top)

    train = _inside(pixels[PALETTE[0]], box)
    eval_ = _inside(pixels[PALETTE[1]], box)
    assert len(train) > 200 and len(eval_) > 50
    # The falling line runs corner to corner: top-left at x=0, bottom-right at x=100.
    assert abs(min(x for x, _ in train) - col(0)) <= 2
    assert abs(max(x for x, _ in train) - col(100)) <= 3
    assert abs(min(y for _, y in train) - row(1.0)) <= 2
    # The flat segment starts at x=30, ends at x=60, at height 0.2.
    assert abs(min(x for x, _ in eval_) - col(30)) <= 3
    assert abs(max(x for x, _ in eval_) - col(60)) <= 3
    assert all(abs(y - row(0.2)) <= 3 for _, y in eval_)
    # Every point of the falling series lies on the line y = 1 - x/100.
    for x, y in train[::7]:
        expected = row(1.0 - (x - left) / (right - left))
        assert abs(y - expected) <= 4, (x, y, expected)

    dashes = _inside(pixels[MARKER], box)
    assert len(dashes) > (bottom - top) // 3
    assert all(abs(x - col(50)) <= 1 for x, _ in dashes)
    assert any(x > col(50) for x, y in pixels[TEXT] if y < top + 20)  # its label


@pytest.mark.parametrize(
    "series",
    [
        {},
        {"empty": []},
        {"single": [(3.0, 2.5)]},
        {"nan": [(0.0, 1.0), (1.0, math.nan), (2.0, 0.5), (math.nan, 3.0), (3.0, 0.4)]},
        {"all_nan": [(0.0, math.nan), (1.0, math.nan)]},
        {"inf": [(0.0, math.inf), (1.0, 2.0), (2.0, -math.inf), (3.0, 1.0)]},
        {"constant": [(0.0, 3.0), (1.0, 3.0), (2.0, 3.0)]},
        {"zero": [(0.0, 0.0), (0.0, 0.0)]},
        {"negative": [(-5.0, -2.0), (5.0, -1.0)]},
        {"huge": [(0.0, 1e9), (1e7, 2e9)]},
        {"tiny": [(0.0, 1.0), (1.0, 1.0 + 1e-7)]},
        {f"s{i}": [(0.0, float(i)), (1.0, i + 0.5)] for i in range(12)},
    ],
    ids=lambda s: next(iter(s), "none") if len(s) < 2 else "many",
)
def test_edge_cases_still_make_valid_pngs(tmp_path: Path, series):
    path = tmp_path / "edge.png"
    write_line_chart(path, series, title="edge? [case]", markers=[(1.0, "m"), (math.nan, "x")])
    width, height, pixels = _decode_png(path)
    assert (width, height) == (800, 480)
    box = _frame(pixels, width, height)
    drawable = [name for name, pts in series.items() if any(math.isfinite(x + y) for x, y in pts)]
    for i, name in enumerate(series):
        if name in drawable:
            assert _inside(pixels[series_color(i)], box), name


def test_constant_series_is_drawn_mid_plot(tmp_path: Path):
    path = tmp_path / "flat.png"
    write_line_chart(path, {"flat": [(0.0, 2.3), (10.0, 2.3)]})
    width, height, pixels = _decode_png(path)
    left, top, right, bottom = box = _frame(pixels, width, height)
    line = _inside(pixels[PALETTE[0]], box)
    assert line
    assert all(top + 10 < y < bottom - 10 for _, y in line)


def test_nan_point_is_skipped_and_the_line_joins_its_neighbours(tmp_path: Path):
    path = tmp_path / "nan.png"
    write_line_chart(path, {"a": [(0.0, 1.0), (50.0, math.nan), (100.0, 0.0)]})
    width, height, pixels = _decode_png(path)
    left, top, right, bottom = box = _frame(pixels, width, height)
    mid_x, mid_y = (left + right) / 2, (top + bottom) / 2
    line = _inside(pixels[PALETTE[0]], box)
    assert any(abs(x - mid_x) <= 2 and abs(y - mid_y) <= 3 for x, y in line)


def test_write_is_atomic_and_replaces(tmp_path: Path):
    path = tmp_path / "sub" / "chart.png"
    write_line_chart(path, {"a": [(0.0, 1.0), (1.0, 0.0)]}, width=200, height=150)
    write_line_chart(path, {"a": [(0.0, 1.0), (1.0, 0.0)]}, width=300, height=200)
    assert [p.name for p in path.parent.iterdir()] == ["chart.png"]
    assert _decode_png(path)[:2] == (300, 200)
    with pytest.raises(ValueError):
        write_line_chart(path, {}, width=10, height=10)
    assert _decode_png(path)[:2] == (300, 200)


def test_font_covers_what_labels_use():
    needed = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ .-_/:()%=,+"
    assert set(needed) <= set(_GLYPHS)
    glyphs = [_GLYPHS[ch] for ch in needed if ch != " "]
    assert all(glyphs) and len(set(glyphs)) == len(glyphs)  # no blank or duplicate glyph
    assert all(0 <= gx < 5 and 0 <= gy < 7 for g in glyphs for gx, gy in g)


@pytest.mark.parametrize(
    "lo,hi",
    [(0, 1), (2.07, 10.6), (-3, 3), (0, 2000), (1.0, 1.0 + 1e-7), (1e9, 2e9), (0, 3e-5), (5, 5.5)],
)
def test_tick_labels_are_distinct_and_cover_the_data(lo: float, hi: float):
    ticks, axis_lo, axis_hi, labels = _axis(lo, hi, 6)
    assert axis_lo <= lo and axis_hi >= hi and 2 <= len(ticks) <= 14
    assert len(set(labels)) == len(labels), labels
    assert all(set(text.upper()) <= set(_GLYPHS) for text in labels)
