"""Line charts drawn with PIL (already needed for images), so the run report needs no plotting library.

A chart is drawn at ``SCALE`` times its nominal size (crisp on high-density screens; the report shows it at
the nominal size): title, axes with round-number ticks, light grid, one line per series, markers when a series
has few points (hollow for points flagged so, e.g. asynchronous evaluations), a legend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

SCALE = 2
WIDTH, HEIGHT = 520, 300
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22"]
_MARKERS_BELOW = 40  # points: a sparser series gets a marker per point


@dataclass
class Series:
    """One line: points (x, y) in x order; ``hollow[i]`` draws point i as a hollow marker."""

    name: str
    xs: list[float]
    ys: list[float]
    hollow: list[bool] = field(default_factory=list)


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size * SCALE)
    except TypeError:  # Pillow < 10.1: one small bitmap font
        return ImageFont.load_default()


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round numbers (steps of 1, 2 or 5 x 10^k) covering [low, high]."""
    if not math.isfinite(low) or not math.isfinite(high):
        return []
    # equal but for rounding too: a step below the floats' spacing would never end the loop below
    if high - low <= 1e-9 * max(abs(low), abs(high)):
        low, high = low - (abs(low) or 1) * 0.5, high + (abs(high) or 1) * 0.5
    raw = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    ticks, value = [], first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 12))
    return ticks


def format_number(value: float) -> str:
    """Short tick/table text: 0.0002, 1e-5, 12.5, 1.2k, 3.4M."""
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e6:
        return f"{value / 1e6:.3g}M"
    if magnitude >= 1e4:
        return f"{value / 1e3:.3g}k"
    return f"{value:.4g}".replace("e-0", "e-")


def line_chart(title: str, series: list[Series], x_label: str = "step", note: str = "") -> Image.Image:
    """A chart of ``series`` against x; an empty list gives a chart that says 'no data'."""
    s = SCALE
    image = Image.new("RGB", (WIDTH * s, HEIGHT * s), "white")
    draw = ImageDraw.Draw(image)
    small, label_font = _font(11), _font(13)
    draw.text((12 * s, 8 * s), title, fill="#222", font=label_font)
    series = [line for line in series if line.xs]
    if not series:
        draw.text((WIDTH * s // 2, HEIGHT * s // 2), "no data", fill="#999", font=label_font, anchor="mm")
        return image
    xs = [x for line in series for x in line.xs]
    ys = [y for line in series for y in line.ys]
    x_ticks, y_ticks = nice_ticks(min(xs), max(xs), 6), nice_ticks(min(ys), max(ys), 5)
    y_text = [format_number(t) for t in y_ticks]
    left = max(draw.textlength(t, font=small) for t in y_text) + 18 * s
    legend_rows = math.ceil(len(series) / 3)
    top, right, bottom = (34 + 15 * legend_rows) * s, WIDTH * s - 16 * s, HEIGHT * s - 40 * s
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]

    def px(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1) * (right - left)

    def py(y: float) -> float:
        return bottom - (y - y0) / ((y1 - y0) or 1) * (bottom - top)

    for tick, text in zip(y_ticks, y_text):
        draw.line([(left, py(tick)), (right, py(tick))], fill="#e6e6e6", width=s)
        draw.text((left - 6 * s, py(tick)), text, fill="#444", font=small, anchor="rm")
    for tick in x_ticks:
        draw.line([(px(tick), top), (px(tick), bottom)], fill="#f0f0f0", width=s)
        draw.text((px(tick), bottom + 6 * s), format_number(tick), fill="#444", font=small, anchor="mt")
    draw.rectangle([left, top, right, bottom], outline="#888", width=s)
    draw.text(((left + right) / 2, HEIGHT * s - 8 * s), x_label + (f"   ({note})" if note else ""),
              fill="#444", font=small, anchor="mb")
    for i, line in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        points = [(px(x), py(y)) for x, y in zip(line.xs, line.ys)]
        if len(points) > 1:
            draw.line(points, fill=color, width=2 * s, joint="curve")
        if len(points) < _MARKERS_BELOW:
            for j, (x, y) in enumerate(points):
                r = 3.5 * s
                hollow = j < len(line.hollow) and line.hollow[j]
                draw.ellipse([x - r, y - r, x + r, y + r], fill="white" if hollow else color, outline=color,
                             width=s)
        lx, ly = 12 * s + (i % 3) * (WIDTH * s - 24 * s) / 3, (28 + 15 * (i // 3)) * s
        draw.line([(lx, ly + 6 * s), (lx + 16 * s, ly + 6 * s)], fill=color, width=3 * s)
        draw.text((lx + 21 * s, ly), _fit(draw, line.name, (WIDTH - 60) * s / 3, small), fill="#333", font=small)
    return image


def _fit(draw: ImageDraw.ImageDraw, text: str, width: float, font: ImageFont.ImageFont) -> str:
    """``text`` shortened with an ellipsis to fit ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def grid(charts: list[Image.Image], columns: int = 2) -> Image.Image:
    """Charts side by side, ``columns`` to a row (for curves.png)."""
    if not charts:
        return line_chart("no metrics", [])
    width, height = charts[0].size
    rows = math.ceil(len(charts) / columns)
    sheet = Image.new("RGB", (width * min(columns, len(charts)), height * rows), "white")
    for i, chart in enumerate(charts):
        sheet.paste(chart, ((i % columns) * width, (i // columns) * height))
    return sheet
