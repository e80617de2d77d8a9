"""Results of `flowq bench`: figures with their spread, each beside its reference; table and JSON.

A `Figure` is one metric measured `repeat` times (median, min, max of the values). A `Row`
puts a flowq figure beside the raw-SQL (or baseline) figures measured in the same invocation
on the same database, with the ratio flowq/reference of the medians. `render_table` prints
them; `to_json` gives the same numbers (and every raw value) for machines.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Figure", "Row", "percentile", "render_table", "to_json"]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Figure:
    """One metric over repeats."""

    name: str
    unit: str
    values: list[float] = field(default_factory=list)
    higher_is_better: bool = True

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "unit": self.unit, "median": self.median,
                "min": min(self.values, default=float("nan")),
                "max": max(self.values, default=float("nan")), "values": self.values,
                "higher_is_better": self.higher_is_better}


@dataclass
class Row:
    """A flowq figure and its references; `note` says what the ratio is compared with."""

    scenario: str
    flowq: Figure
    references: list[Figure] = field(default_factory=list)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def ratios(self) -> list[float]:
        out = []
        for ref in self.references:
            m = ref.median
            out.append(self.flowq.median / m if m else float("nan"))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "flowq": self.flowq.as_dict(),
                "references": [{**r.as_dict(), "ratio": ratio}
                               for r, ratio in zip(self.references, self.ratios(), strict=True)],
                "note": self.note, **({"extra": self.extra} if self.extra else {})}


def _num(x: float) -> str:
    if x != x:  # nan
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _ratio(r: float) -> str:
    if r != r:  # nan
        return "-"
    # Two significant digits below 0.01x, so that a collapse reads as one, not as 0.00x.
    return f"{r:.2g}x" if 0 < abs(r) < 0.01 else f"{r:.2f}x"


def _fig(f: Figure) -> str:
    if not f.values:
        return "-"
    if len(f.values) == 1:
        return f"{_num(f.median)} {f.unit}"
    return f"{_num(f.median)} [{_num(min(f.values))}-{_num(max(f.values))}] {f.unit}"


def render_table(machine: dict[str, Any], rows: Sequence[Row], repeat: int) -> str:
    head = (f"flowq bench: {machine.get('cores')} cores, PostgreSQL {machine.get('postgresql')} "
            f"({'embedded' if machine.get('embedded') else 'given server'}), "
            f"fsync={machine.get('fsync')}, synchronous_commit={machine.get('synchronous_commit')}"
            f", shared_buffers={machine.get('shared_buffers')}; Python {machine.get('python')}"
            f"\nmedian [min-max] over {repeat} run(s); ratio = flowq / reference (medians)")
    table: list[tuple[str, str, str, str, str]] = [
        ("scenario", "flowq metric", "flowq", "reference", "ratio")]
    for row in rows:
        refs = row.references or [Figure("-", "")]
        for i, (ref, ratio) in enumerate(zip(refs, row.ratios() or [float("nan")], strict=True)):
            table.append((row.scenario if i == 0 else "", row.flowq.name if i == 0 else "",
                          _fig(row.flowq) if i == 0 else "",
                          f"{ref.name}: {_fig(ref)}" if ref.values else ref.name,
                          _ratio(ratio)))
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    lines = [head, ""]
    for j, r in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    notes = [f"  {r.scenario} / {r.flowq.name}: {r.note}" for r in rows if r.note]
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)


def to_json(machine: dict[str, Any], options: dict[str, Any], rows: Sequence[Row]
            ) -> dict[str, Any]:
    scenarios: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        scenarios.setdefault(row.scenario, []).append(row.as_dict())
    return {"machine": machine, "options": options, "scenarios": scenarios}
