"""Charts, the run graph and the step timeline as inline SVG, drawn on the server.

No script and no external resource: each function returns markup (`markupsafe.Markup`) built
from numbers it formats itself and from text it escapes (task, queue and step names come
from users), so the dashboard's Content-Security-Policy without scripts still holds.

- `chart`: one small chart of one or more series over time buckets (lines, or bars for
  counts), with its maximum labelled and a `<title>` per point for hovering.
- `graph`: a run's steps as boxes in columns by depth (a step's column is one more than its
  deepest parent's), with edges from parents, coloured by status; steps not reached yet
  are grey and dashed; a mapped step is one box with its instances' counts.
- `timeline`: per step row, every attempt on one time axis: a grey line while queued or
  waiting for a retry, a bar per attempt (a failed one in the failure colour, the latest in
  the row's status colour), so an attempt lost to a killed worker shows as the time it ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from markupsafe import Markup, escape

__all__ = ["COLORS", "FAILED_COLOR", "Bar", "Node", "Span", "chart", "graph", "timeline"]

COLORS: Final = {"succeeded": "#1a7f37", "dead": "#c62828", "running": "#0b6bcb",
                 "pending": "#9a6700", "waiting": "#9a6700", "cancelled": "#667085",
                 "unreached": "#c3c9d4"}
CHART_W: Final = 270
CHART_H: Final = 80


def _num(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _label(value: float) -> str:
    if value >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.2f}" if value < 1 else f"{value:.1f}"


def chart(title: str, series: Sequence[tuple[str, str, Sequence[float | None]]], *,
          bars: bool = False, unit: str = "", ident: str = "",
          axis: tuple[str, str] | None = None) -> Markup:
    """A chart of `series` ((name, colour, values per bucket, oldest first)), `bars` for
    counts (each series' bars drawn over the previous one's: put the larger first).
    `unit` follows the values in labels; `ident` becomes the id; `axis` labels the first
    bucket's start and the last one's end under the plot."""
    n = max((len(v) for _, _, v in series), default=0)
    top = max([v for _, _, vs in series for v in vs if v is not None] or [0.0])
    scale = top if top > 0 else 1.0
    pad_t, pad_b = 14, (14 if axis else 4)
    plot_h = CHART_H - pad_t - pad_b
    step = CHART_W / max(n, 1)

    def y(v: float) -> float:
        return pad_t + plot_h - plot_h * v / scale

    parts = [f'<svg class="chart" role="img" viewBox="0 0 {CHART_W} {CHART_H}" '
             f'width="{CHART_W}" height="{CHART_H}" xmlns="http://www.w3.org/2000/svg"'
             + (f' id="{escape(ident)}"' if ident else "") + ">",
             f"<title>{escape(title)}</title>",
             f'<rect x="0" y="0" width="{CHART_W}" height="{CHART_H}" fill="#fff" '
             'stroke="#e4e7ec"/>',
             f'<text x="4" y="11" font-size="10" fill="#667085">{escape(title)} · max '
             f"{escape(_label(top))}{escape(unit)}</text>"]
    for name, colour, values in series:
        if bars:
            for i, v in enumerate(values):
                if v:
                    h = plot_h * v / scale
                    parts.append(f'<rect x="{_num(i * step)}" y="{_num(y(v))}" '
                                 f'width="{_num(max(step - 0.5, 0.5))}" height="{_num(h)}" '
                                 f'fill="{colour}"><title>{escape(name)}: '
                                 f"{escape(_label(v))}{escape(unit)}</title></rect>")
            continue
        points = [(i, v) for i, v in enumerate(values) if v is not None]
        if points:
            coords = " ".join(f"{_num((i + 0.5) * step)},{_num(y(v))}" for i, v in points)
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                         f'points="{coords}"><title>{escape(name)}</title></polyline>')
            # A dot per bucket that has a value, so that a lone one shows (and hovers).
            parts.extend(f'<circle cx="{_num((i + 0.5) * step)}" cy="{_num(y(v))}" r="1.6" '
                         f'fill="{colour}"><title>{escape(name)}: {escape(_label(v))}'
                         f"{escape(unit)}</title></circle>"
                         for i, v in points if v or len(points) < 2)
    if axis is not None:
        parts.append(f'<text x="2" y="{CHART_H - 3}" font-size="9" fill="#667085">'
                     f"{escape(axis[0])}</text>"
                     f'<text x="{CHART_W - 2}" y="{CHART_H - 3}" font-size="9" '
                     f'text-anchor="end" fill="#667085">{escape(axis[1])}</text>')
    legend_x = CHART_W - 4
    for name, colour, _ in reversed(series):
        parts.append(f'<text x="{legend_x}" y="11" font-size="10" text-anchor="end" '
                     f'fill="{colour}">{escape(name)}</text>')
        legend_x -= 7 * len(name) + 8
    parts.append("</svg>")
    return Markup("".join(parts))


@dataclass(frozen=True)
class Node:
    """A box of the run graph: a step, its parents, and what its rows say."""

    name: str
    parents: tuple[str, ...]
    status: str  # a job status, or "unreached"
    note: str  # e.g. "x12: 10 succeeded, 2 dead", or the attempts
    signal: str | None = None


NODE_W: Final = 170
NODE_H: Final = 46
GAP_X: Final = 50
GAP_Y: Final = 16


def graph(nodes: Sequence[Node]) -> Markup:
    """The run graph of `nodes` (in definition order: parents before children)."""
    depth: dict[str, int] = {}
    for node in nodes:
        depth[node.name] = 1 + max((depth.get(p, 0) for p in node.parents), default=-1)
    columns: dict[int, list[Node]] = {}
    for node in nodes:
        columns.setdefault(depth[node.name], []).append(node)
    where: dict[str, tuple[float, float]] = {}
    for col, members in columns.items():
        for row, node in enumerate(members):
            where[node.name] = (8 + col * (NODE_W + GAP_X), 8 + row * (NODE_H + GAP_Y))
    width = 16 + (max(columns, default=0) + 1) * (NODE_W + GAP_X) - GAP_X
    height = 16 + max((len(m) for m in columns.values()), default=1) * (NODE_H + GAP_Y) - GAP_Y
    parts = [f'<svg class="dag" id="dag" role="img" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
             "<title>The run's steps</title>"]
    for node in nodes:
        x, y = where[node.name]
        for p in node.parents:
            if p in where:
                px, py = where[p]
                parts.append(f'<line class="edge" x1="{_num(px + NODE_W)}" '
                             f'y1="{_num(py + NODE_H / 2)}" x2="{_num(x)}" '
                             f'y2="{_num(y + NODE_H / 2)}" stroke="#98a2b3" '
                             'stroke-width="1.2"/>')
    for node in nodes:
        x, y = where[node.name]
        colour = COLORS.get(node.status, "#667085")
        dash = ' stroke-dasharray="4 3"' if node.status == "unreached" else ""
        fill = "#f8f9fb" if node.status == "unreached" else "#fff"
        name = node.name or "(first)"
        parts.append(
            f'<g class="node {escape(node.status)}" data-step="{escape(node.name)}">'
            f"<title>{escape(name)}: {escape(node.status)}"
            + (f", waits for signal {escape(node.signal)}" if node.signal else "")
            + f"</title><rect x=\"{_num(x)}\" y=\"{_num(y)}\" width=\"{NODE_W}\" "
            f'height="{NODE_H}" rx="6" fill="{fill}" stroke="{colour}" stroke-width="2"{dash}/>'
            f'<text x="{_num(x + 8)}" y="{_num(y + 18)}" font-size="12" font-weight="600" '
            f'fill="#1d2330">{escape(_cut(name, 22))}</text>'
            f'<text x="{_num(x + 8)}" y="{_num(y + 35)}" font-size="10" fill="{colour}">'
            f"{escape(_cut(node.note, 30))}</text></g>")
    parts.append("</svg>")
    return Markup("".join(parts))


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


FAILED_COLOR: Final = "#e8a33d"
ACTIVE: Final = ("running", "pending", "waiting")


@dataclass(frozen=True)
class Span:
    """One attempt of a step row: when it started and ended (None: still running), and
    whether it failed (its error is kept)."""

    started: datetime | None
    finished: datetime | None
    failed: bool


@dataclass(frozen=True)
class Bar:
    """A step row on the timeline: when it was queued, its status, and its attempts."""

    label: str
    status: str
    queued: datetime
    attempts: tuple[Span, ...] = ()


def timeline(bars: Sequence[Bar], now: datetime) -> Markup:
    """The step rows of `bars` on one time axis: a thin grey line while a row waits (for
    its time, a worker or a retry), a bar per attempt: failed ones in `FAILED_COLOR`, the
    latest in its status colour."""
    if not bars:
        return Markup("")
    start = min(b.queued for b in bars)
    ends = [a.finished for b in bars for a in b.attempts if a.finished is not None]
    active = any(b.status in ACTIVE for b in bars)
    end = max([*ends, now] if active or not ends else ends)
    span = max((end - start).total_seconds(), 0.001)
    label_w, plot_w, row_h = 180, 620, 18
    height = 22 + row_h * len(bars)

    def x(at: datetime) -> float:
        return label_w + plot_w * min(max(0.0, (at - start).total_seconds()) / span, 1.0)

    parts = [f'<svg class="timeline" id="timeline" role="img" viewBox="0 0 '
             f'{label_w + plot_w + 10} {height}" width="{label_w + plot_w + 10}" '
             f'height="{height}" xmlns="http://www.w3.org/2000/svg">',
             "<title>When each step was queued and each of its attempts ran</title>",
             f'<text x="{label_w}" y="12" font-size="10" fill="#667085">'
             f"{escape(start.strftime('%H:%M:%S'))}</text>",
             f'<text x="{label_w + plot_w}" y="12" font-size="10" text-anchor="end" '
             f'fill="#667085">+{escape(_label(span))} s</text>']
    for i, b in enumerate(bars):
        y = 20 + i * row_h
        colour = COLORS.get(b.status, "#667085")
        tried = ", ".join(f"attempt {n} {_clock(a.started)} to {_clock(a.finished)}"
                          + (" failed" if a.failed else "")
                          for n, a in enumerate(b.attempts, 1))
        parts.append(f'<g class="bar {escape(b.status)}" data-attempts="{len(b.attempts)}">'
                     f"<title>{escape(b.label)}: queued {escape(_clock(b.queued))}"
                     f"{escape('; ' + tried if tried else '')}</title>"
                     f'<text x="0" y="{y + 11}" font-size="11" fill="#1d2330">'
                     f"{escape(_cut(b.label, 28))}</text>")
        # The grey line runs under the attempts to the row's end: the gaps are its waits.
        waits_until = now
        if b.status not in ACTIVE:
            last = b.attempts[-1] if b.attempts else None
            waits_until = (last.finished or last.started or b.queued) if last else b.queued
        parts.append(f'<line x1="{_num(x(b.queued))}" y1="{y + 7}" x2="{_num(x(waits_until))}" '
                     f'y2="{y + 7}" stroke="#c3c9d4" stroke-width="2"/>')
        for n, a in enumerate(b.attempts, 1):
            latest = n == len(b.attempts)
            fill = FAILED_COLOR if a.failed and not (latest and b.status == "dead") else colour
            if a.started is None:  # started before this was recorded (revision 0008)
                if a.finished is not None:
                    parts.append(f'<circle class="attempt" cx="{_num(x(a.finished))}" '
                                 f'cy="{y + 7}" r="4" fill="{fill}"/>')
                continue
            a_end = a.finished or now
            parts.append(f'<rect class="attempt" x="{_num(x(a.started))}" y="{y + 2}" '
                         f'width="{_num(max(x(a_end) - x(a.started), 2))}" height="10" '
                         f'fill="{fill}"><title>{escape(b.label)}: attempt {n}, '
                         f"{escape(_clock(a.started))} to {escape(_clock(a.finished))}"
                         f"{' (failed)' if a.failed else ''}</title></rect>")
        parts.append("</g>")
    parts.append("</svg>")
    return Markup("".join(parts))


def _clock(at: datetime | None) -> str:
    return "-" if at is None else at.strftime("%H:%M:%S.%f")[:-3]
