"""Small inline-SVG charts for the HTML report: heatmap, lines, bars, timeline.

Why hand-written SVG rather than matplotlib: the report must be one self-contained file that renders
crisply at any zoom, with hover titles on every mark and no extra dependency. Inputs are plain numpy
arrays and strings; nothing here queries data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

import numpy as np
import numpy.typing as npt

from fleetscope.schemas.categories import REGISTRY

FONT = "font-family='system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif'"
GREY = "#c4c9d0"
HIGHLIGHTS = ("#d62728", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")
CATEGORY_COLORS = {c.value: about.color for c, about in REGISTRY.items()}

Array = npt.NDArray[np.float64]


def _e(text: object) -> str:
    return escape(str(text), quote=True)


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (1, 2, 2.5, 5 x 10^k steps; whole numbers only
    when ``integer``, e.g. for iterations)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else [0.0]
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if integer:
        step = max(1.0, float(round(step)))
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def label_indices(n: int, slot_px: float, emphasised: frozenset[int], min_px: float = 22.0) -> list[int]:
    """Which of ``n`` evenly spaced axis labels to draw: every emphasised one, plus a regular subset
    that keeps ``min_px`` away from each other and from the emphasised ones (no overlapping text)."""
    step = max(1, math.ceil(min_px / slot_px))
    near = max(1, math.ceil(min_px / slot_px))
    keep = set(emphasised)
    for i in range(0, n, step):
        if all(abs(i - j) >= near for j in emphasised):
            keep.add(i)
    return sorted(keep)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.3g}"
    return f"{v:.4g}"


def diverging(gap: float, limit: float) -> str:
    """Blue (faster than peers) - white - red (slower) for a relative gap, clipped at +-limit."""
    if not math.isfinite(gap):
        return "#eeeeee"
    t = max(-1.0, min(1.0, gap / limit))
    end = (214, 39, 40) if t > 0 else (31, 119, 180)
    r, g, b = (round(255 + (c - 255) * abs(t)) for c in end)
    return f"#{r:02x}{g:02x}{b:02x}"


def _svg(width: float, height: float, body: list[str], label: str) -> str:
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width:.0f}' height='{height:.0f}' "
        f"viewBox='0 0 {width:.0f} {height:.0f}' role='img' aria-label='{_e(label)}' {FONT} font-size='12'>"
        + "".join(body)
        + "</svg>"
    )


def heatmap(
    rows: list[str],
    cols: list[str],
    values: Array,
    *,
    limit: float = 0.5,
    highlight_cols: frozenset[int] = frozenset(),
    row_notes: list[str] | None = None,
    cell_w: float = 0.0,
) -> str:
    """Rows x columns of relative gaps (0.25 = 25 % slower than the peer median), NaN = no data."""
    n_rows, n_cols = values.shape
    labels = [_short(r, 48) for r in rows]
    label_w = 14 + 7.0 * max((len(r) for r in labels), default=4)
    cell_w = cell_w or max(5.0, min(46.0, (1120.0 - label_w) / max(n_cols, 1)))
    cell_h = 22.0
    top, left = 34.0, label_w
    legend_h = 46.0
    width = left + max(n_cols * cell_w, 336) + 20  # room for the colour legend
    height = top + n_rows * cell_h + legend_h
    body: list[str] = []
    for j in label_indices(n_cols, cell_w, highlight_cols, 7.0 * max((len(c) for c in cols), default=1) + 6):
        name = cols[j]
        x = left + (j + 0.5) * cell_w
        weight = " font-weight='700' fill='#d62728'" if j in highlight_cols else ""
        body.append(f"<text x='{x:.1f}' y='{top - 8:.1f}' text-anchor='middle'{weight}>{_e(name)}</text>")
    show_text = cell_w >= 34
    for i, name in enumerate(rows):
        y = top + i * cell_h
        note = f" ({row_notes[i]})" if row_notes else ""
        body.append(
            f"<text x='{left - 6:.1f}' y='{y + cell_h / 2 + 4:.1f}' text-anchor='end'>"
            f"<title>{_e(name + note)}</title>{_e(labels[i])}</text>"
        )
        for j in range(n_cols):
            v = float(values[i, j])
            x = left + j * cell_w
            tip = f"{cols[j]} / {name}: " + (f"{v:+.1%} vs peer median" if math.isfinite(v) else "no data")
            body.append(
                f"<rect x='{x:.1f}' y='{y:.1f}' width='{cell_w - 1:.1f}' height='{cell_h - 1:.1f}' "
                f"fill='{diverging(v, limit)}'><title>{_e(tip)}</title></rect>"
            )
            if show_text and math.isfinite(v) and abs(v) >= 0.05:
                fill = "#fff" if abs(v) >= 0.6 * limit else "#222"
                body.append(
                    f"<text x='{x + cell_w / 2:.1f}' y='{y + cell_h / 2 + 4:.1f}' text-anchor='middle' "
                    f"font-size='10' fill='{fill}' pointer-events='none'>{v:+.0%}</text>"
                )
    for j in highlight_cols:
        x = left + j * cell_w
        body.append(
            f"<rect x='{x - 1:.1f}' y='{top - 1:.1f}' width='{cell_w + 1:.1f}' "
            f"height='{n_rows * cell_h + 1:.1f}' fill='none' stroke='#111' stroke-width='1.5'/>"
        )
    ly = top + n_rows * cell_h + 16
    for k in range(41):
        gap = -limit + 2 * limit * k / 40
        body.append(f"<rect x='{left + k * 8:.1f}' y='{ly:.1f}' width='8' height='10' fill='{diverging(gap, limit)}'/>")
    body.append(f"<text x='{left:.1f}' y='{ly + 24:.1f}'>{-limit:+.0%} faster</text>")
    body.append(f"<text x='{left + 328:.1f}' y='{ly + 24:.1f}' text-anchor='end'>{limit:+.0%} slower</text>")
    body.append(f"<text x='{left + 164:.1f}' y='{ly + 24:.1f}' text-anchor='middle'>peer median</text>")
    return _svg(width, height, body, "heatmap of each rank's deviation from its peers per function")


@dataclass(frozen=True)
class Series:
    name: str
    y: Array
    color: str = GREY
    width: float = 1.0


@dataclass(frozen=True)
class Band:
    """A shaded min..max range with a median line (many ranks drawn as one shape)."""

    lo: Array
    mid: Array
    hi: Array
    name: str = "all ranks (range, median)"


def _frame(
    body: list[str], x0: float, x1: float, y0: float, y1: float, box: tuple[float, float, float, float]
) -> tuple[float, float, float, float]:
    """Axes with ticks; returns the pixel box (left, top, right, bottom)."""
    left, top, right, bottom = box
    for t in nice_ticks(y0, y1):
        y = bottom - (t - y0) / (y1 - y0) * (bottom - top)
        body.append(f"<line x1='{left}' x2='{right}' y1='{y:.1f}' y2='{y:.1f}' stroke='#eceef1'/>")
        body.append(f"<text x='{left - 6}' y='{y + 4:.1f}' text-anchor='end'>{_fmt(t)}</text>")
    for t in nice_ticks(x0, x1, 8, integer=True):
        x = left + (t - x0) / (x1 - x0) * (right - left)
        body.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{bottom}' y2='{bottom + 4}' stroke='#666'/>")
        body.append(f"<text x='{x:.1f}' y='{bottom + 17}' text-anchor='middle'>{_fmt(t)}</text>")
    body.append(f"<line x1='{left}' x2='{right}' y1='{bottom}' y2='{bottom}' stroke='#666'/>")
    body.append(f"<line x1='{left}' x2='{left}' y1='{top}' y2='{bottom}' stroke='#666'/>")
    return box


def _range(arrays: list[Array]) -> tuple[float, float]:
    finite = [a[np.isfinite(a)] for a in arrays]
    values = np.concatenate(finite) if finite else np.empty(0)
    if values.size == 0:
        return 0.0, 1.0
    lo, hi = float(values.min()), float(values.max())
    pad = (hi - lo) * 0.08 or abs(hi) * 0.05 or 1.0
    return lo - pad, hi + pad


def line_chart(
    x: Array,
    series: list[Series],
    *,
    band: Band | None = None,
    x_label: str,
    y_label: str,
    width: float = 1100,
    height: float = 300,
) -> str:
    """Lines over a shared x axis; grey series first, coloured ones on top with a legend."""
    body: list[str] = []
    box = (64.0, 14.0, width - 210.0, height - 40.0)
    arrays = [s.y for s in series] + ([band.lo, band.hi] if band else [])
    y0, y1 = _range(arrays)
    x0, x1 = (float(x.min()), float(x.max())) if x.size else (0.0, 1.0)
    x1 = x1 if x1 > x0 else x0 + 1
    left, top, right, bottom = _frame(body, x0, x1, y0, y1, box)

    def px(xs: Array, ys: Array) -> list[str]:
        ok = np.isfinite(ys)
        xp = left + (xs[ok] - x0) / (x1 - x0) * (right - left)
        yp = bottom - (ys[ok] - y0) / (y1 - y0) * (bottom - top)
        return [f"{a:.1f},{b:.1f}" for a, b in zip(xp, yp, strict=True)]

    legend: list[tuple[str, str]] = []
    if band is not None:
        upper, lower = px(x, band.hi), px(x, band.lo)
        body.append(f"<polygon points='{' '.join(upper + lower[::-1])}' fill='#dfe3e8'/>")
        body.append(f"<polyline points='{' '.join(px(x, band.mid))}' fill='none' stroke='#8a939e'/>")
        legend.append((band.name, "#8a939e"))
    for s in sorted(series, key=lambda s: s.color != GREY):
        pts = px(x, s.y)
        if len(pts) > 1:
            body.append(
                f"<polyline points='{' '.join(pts)}' fill='none' stroke='{s.color}' "
                f"stroke-width='{s.width}'><title>{_e(s.name)}</title></polyline>"
            )
        if s.color != GREY:
            legend.append((s.name, s.color))
    if any(s.color == GREY for s in series):
        legend.insert(0, ("other ranks" if legend else "ranks", GREY))
    for k, (name, color) in enumerate(legend[:12]):
        ly = top + 6 + k * 18
        body.append(f"<rect x='{right + 14}' y='{ly - 8}' width='14' height='4' fill='{color}'/>")
        body.append(f"<text x='{right + 34}' y='{ly - 2}'>{_e(name)}</text>")
    body.append(f"<text x='{(left + right) / 2:.1f}' y='{height - 6}' text-anchor='middle'>{_e(x_label)}</text>")
    body.append(
        f"<text transform='translate(14 {(top + bottom) / 2:.1f}) rotate(-90)' text-anchor='middle'>"
        f"{_e(y_label)}</text>"
    )
    return _svg(width, height, body, y_label + " over " + x_label)


def bar_chart(
    labels: list[str],
    values: Array,
    colors: list[str],
    *,
    y_label: str,
    x_label: str,
    tips: list[str] | None = None,
    width: float = 1100,
    height: float = 260,
) -> str:
    """One bar per label (e.g. per rank), zero-based y axis."""
    body: list[str] = []
    finite = values[np.isfinite(values)]
    y1 = float(finite.max()) * 1.1 if finite.size and finite.max() > 0 else 1.0
    left, top, right, bottom = 64.0, 14.0, width - 20.0, height - 40.0
    for t in nice_ticks(0.0, y1):
        y = bottom - t / y1 * (bottom - top)
        body.append(f"<line x1='{left}' x2='{right}' y1='{y:.1f}' y2='{y:.1f}' stroke='#eceef1'/>")
        body.append(f"<text x='{left - 6}' y='{y + 4:.1f}' text-anchor='end'>{_fmt(t)}</text>")
    slot = (right - left) / max(len(labels), 1)
    emphasised = frozenset(i for i, c in enumerate(colors) if c != GREY)
    shown = set(label_indices(len(labels), slot, emphasised, 7.0 * max((len(x) for x in labels), default=1) + 8))
    for i, (label, v) in enumerate(zip(labels, values, strict=True)):
        x = left + i * slot
        tip = tips[i] if tips else f"{label}: {_fmt(float(v))}"
        if math.isfinite(v):
            h = v / y1 * (bottom - top)
            body.append(
                f"<rect x='{x + slot * 0.12:.1f}' y='{bottom - h:.1f}' width='{slot * 0.76:.1f}' "
                f"height='{h:.1f}' fill='{colors[i]}'><title>{_e(tip)}</title></rect>"
            )
        if i in shown:
            weight = " font-weight='700'" if i in emphasised else ""
            body.append(
                f"<text x='{x + slot / 2:.1f}' y='{bottom + 15}' text-anchor='middle'{weight}>{_e(label)}</text>"
            )
    body.append(f"<line x1='{left}' x2='{right}' y1='{bottom}' y2='{bottom}' stroke='#666'/>")
    body.append(f"<text x='{(left + right) / 2:.1f}' y='{height - 6}' text-anchor='middle'>{_e(x_label)}</text>")
    body.append(
        f"<text transform='translate(14 {(top + bottom) / 2:.1f}) rotate(-90)' text-anchor='middle'>"
        f"{_e(y_label)}</text>"
    )
    return _svg(width, height, body, y_label + " per " + x_label)


@dataclass(frozen=True)
class Span:
    """One finding on the timeline: a bar from ``start`` to ``end`` (iterations)."""

    label: str
    start: float
    end: float
    color: str
    open: bool
    tip: str


def timeline(spans: list[Span], x0: float, x1: float, *, x_label: str, width: float = 1100) -> str:
    """One row per finding; open findings solid, closed ones hatched-light."""
    label_w = 8 + 6.4 * max((len(s.label) for s in spans), default=10)
    row_h = 24.0
    height = 30 + max(len(spans), 1) * row_h + 36
    left, top, right = min(label_w, width * 0.45), 10.0, width - 20.0
    bottom = top + max(len(spans), 1) * row_h
    x1 = x1 if x1 > x0 else x0 + 1
    body: list[str] = []
    for t in nice_ticks(x0, x1, 10, integer=True):
        x = left + (t - x0) / (x1 - x0) * (right - left)
        body.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{top}' y2='{bottom}' stroke='#eceef1'/>")
        body.append(f"<text x='{x:.1f}' y='{bottom + 16}' text-anchor='middle'>{_fmt(t)}</text>")
    if not spans:
        body.append(f"<text x='{left + 8}' y='{top + 16}' fill='#666'>no findings for this job</text>")
    for i, s in enumerate(spans):
        y = top + i * row_h
        xa = left + (s.start - x0) / (x1 - x0) * (right - left)
        xb = left + (s.end + 1 - x0) / (x1 - x0) * (right - left)
        opacity = "1" if s.open else "0.45"
        body.append(f"<text x='{left - 6:.1f}' y='{y + row_h / 2 + 4:.1f}' text-anchor='end'>{_e(s.label)}</text>")
        body.append(
            f"<rect x='{xa:.1f}' y='{y + 4:.1f}' width='{max(xb - xa, 2):.1f}' height='{row_h - 8:.1f}' "
            f"rx='3' fill='{s.color}' fill-opacity='{opacity}'><title>{_e(s.tip)}</title></rect>"
        )
    body.append(f"<line x1='{left}' x2='{right}' y1='{bottom}' y2='{bottom}' stroke='#666'/>")
    body.append(f"<text x='{(left + right) / 2:.1f}' y='{height - 6}' text-anchor='middle'>{_e(x_label)}</text>")
    return _svg(width, height, body, "findings timeline")
