"""`flowq bench --baseline PYTHON`: this flowq against another one, A B B A, on one server.

A change to the hot path is judged against the release before it, in one run: figures drift
from run to run on shared machines, ratios measured side by side do not. So each scenario
runs four times, alternating, on the same server: A (the baseline), B (this flowq), B, A;
each side's values are pooled and every figure is printed with B's median, A's (as the
first reference, ratio B/A) and the raw references B measured, ratio B/reference.

Each of the four is a subprocess, `python -m flowq bench --scenario S --json-file F`, with
only the options its bench knows (read from its `--help`): the baseline may be an older
flowq whose bench lacks a newer scenario, option or figure, and then the table says so
("n/a") instead of failing. The baseline is `--baseline PYTHON` (an interpreter with another
flowq installed) and/or `--baseline-path DIR` (a flowq checkout: DIR and DIR/bench are its
PYTHONPATH, and this interpreter runs it when `--baseline` is not given). Children run in an
empty directory, so the current one never shadows either side's flowq; this side's own
import locations are put first on its PYTHONPATH so both sides are exactly what was asked.

`--repeat R` gives each of the four invocations ceil(R/2) runs (each side 2 x ceil(R/2)).
Without `--database-url` an embedded server is started here and both sides use it (each
bench makes its own template database there, migrated by its own flowq).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

__all__ = ["ORDER", "BaselineError", "Side", "baseline_side", "run_versus", "this_side"]

ORDER: Final = "ABBA"
PROBE_TIMEOUT: Final = 120.0
TAIL_LINES: Final = 20
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


class BaselineError(Exception):
    """The baseline cannot run `flowq bench`: the sentence says why and what to give."""


@dataclass
class Side:
    """One flowq: the interpreter and environment that run its `flowq bench`."""

    name: str  # "A" (the baseline) or "B" (this flowq)
    label: str
    python: str
    env: dict[str, str]
    options: set[str] = field(default_factory=set)  # the options its bench takes


def _pythonpath(dirs: Sequence[str], rest: str | None = None) -> str:
    return os.pathsep.join([*dirs, *([rest] if rest else [])])


def this_side() -> Side:
    """This interpreter, with the flowq and flowq_bench imported here first on its path."""
    import flowq
    import flowq_bench

    dirs = list(dict.fromkeys(str(Path(m.__file__ or "").resolve().parent.parent)
                              for m in (flowq, flowq_bench)))
    env = {**os.environ, "PYTHONPATH": _pythonpath(dirs, os.environ.get("PYTHONPATH"))}
    return Side("B", "this flowq", sys.executable, env)


def _run_quiet(cmd: list[str], env: dict[str, str], cwd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=PROBE_TIMEOUT, check=False)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def baseline_side(python: str | None, path: str | None, cwd: str) -> Side:
    """The baseline's Side, checked: it imports flowq and its `flowq bench --help` runs
    (the options it lists are the ones it will be given); a BaselineError otherwise."""
    exe = python or sys.executable
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path is not None:
        root = Path(path).resolve()
        dirs = [str(root)] + ([str(root / "bench")] if (root / "bench").is_dir() else [])
        env["PYTHONPATH"] = _pythonpath(dirs)
    where = f"{exe}" + (f" with PYTHONPATH={env['PYTHONPATH']}" if path is not None else "")
    try:
        found = _run_quiet([exe, "-c", "import flowq; print(flowq.__version__)"], env, cwd)
    except OSError as exc:
        raise BaselineError(f"the baseline interpreter {exe} cannot be run ({exc.strerror}): "
                            "give --baseline the path of a Python interpreter.") from None
    if found.returncode != 0:
        raise BaselineError(f"the baseline {where} cannot import flowq "
                            f"({_last_line(found.stderr)}): install flowq there or give "
                            "--baseline-path a flowq checkout.")
    version = found.stdout.strip()
    helped = _run_quiet([exe, "-m", "flowq", "bench", "--help"], env, cwd)
    if helped.returncode != 0:
        raise BaselineError(f"the baseline {where} cannot run `flowq bench` "
                            f"({_last_line(helped.stderr or helped.stdout)}): install "
                            "flowq-bench beside it or give --baseline-path a checkout whose "
                            "bench/ folder holds it.")
    label = f"flowq {version}"
    if path is not None:
        rev = _run_quiet(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], env, cwd)
        if rev.returncode == 0 and rev.stdout.strip():
            label = rev.stdout.strip()
    return Side("A", f"baseline {label}", exe, env, set(_OPTION.findall(helped.stdout)))


@dataclass
class _Outcome:
    """One invocation: its JSON document, or why there is none."""

    doc: dict[str, Any] | None
    reason: str = ""


def _invoke(side: Side, scenario: str, url: str, argv: list[str], cwd: str,
            say: Callable[[str], None]) -> _Outcome:
    """`flowq bench --scenario scenario` on `side`, its progress passed through `say`."""
    fd, out = tempfile.mkstemp(prefix="flowq-bench-", suffix=".json", dir=cwd)
    os.close(fd)
    to_file = "--json-file" in side.options
    cmd = [side.python, "-m", "flowq", "bench", "--scenario", scenario, "--database-url", url,
           *(["--json-file", out] if to_file else ["--json"]), *argv]
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with open(out if not to_file else os.devnull, "w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                env=side.env, cwd=cwd)
        assert proc.stderr is not None
        for line in proc.stderr:
            tail.append(line.rstrip("\n"))
            say(f"    {side.name}| {line.rstrip()}\n")
        proc.wait()
    try:
        text = Path(out).read_text()
        doc = json.loads(text) if text.strip() else None
    except ValueError:
        doc = None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(out)
    # indexes exits 1 with its document written (a statement not index-served): a result.
    if isinstance(doc, dict) and scenario in doc.get("scenarios", {}):
        return _Outcome(doc)
    text = "\n".join(tail)
    if "unknown scenario" in text or "no such option" in text.lower():
        return _Outcome(None, f"its bench has no scenario {scenario!r}")
    return _Outcome(None, f"it exited with status {proc.returncode}: {_last_line(text)}")


def _key(rows: Sequence[dict[str, Any]]) -> Iterator[tuple[tuple[str, int], dict[str, Any]]]:
    """Each row keyed by its flowq figure's name (and which occurrence of it)."""
    seen: dict[str, int] = {}
    for row in rows:
        name = row["flowq"]["name"]
        seen[name] = seen.get(name, -1) + 1
        yield (name, seen[name]), row


def _pool(runs: Sequence[Sequence[dict[str, Any]]]) -> dict[tuple[str, int], dict[str, Any]]:
    """One side's rows of one scenario over its invocations: values concatenated per figure
    (references matched by name), everything else from the first invocation."""
    pooled: dict[tuple[str, int], dict[str, Any]] = {}
    for rows in runs:
        for key, row in _key(rows):
            if key not in pooled:
                pooled[key] = {**row, "flowq": {**row["flowq"], "values": []},
                               "references": [{**r, "values": []} for r in row["references"]]}
            into = pooled[key]
            into["flowq"]["values"] += row["flowq"]["values"]
            refs = {r["name"]: r for r in into["references"]}
            for ref in row["references"]:
                if ref["name"] in refs:
                    refs[ref["name"]]["values"] += ref["values"]
    return pooled


def _figure(d: dict[str, Any], name: str | None = None) -> Any:
    from flowq_bench.report import Figure

    return Figure(name or d["name"], d["unit"], [float(v) for v in d["values"]],
                  bool(d.get("higher_is_better", True)))


def _rows(scenario: str, mine: list[list[dict[str, Any]]],
          theirs: list[list[dict[str, Any]]],
          missing: str, label: str) -> list[Any]:
    """B's pooled rows with A's figure as the first reference (or n/a and why)."""
    from flowq_bench.report import Figure, Row

    a = _pool(theirs)
    out = []
    for key, row in _pool(mine).items():
        base = a.get(key)
        info: dict[str, Any]
        if base is not None:
            ref, info = _figure(base["flowq"], label), {"measured": True}
        else:
            why = missing or "its bench does not report this figure"
            ref = Figure(f"{label}: n/a, {why}", row["flowq"]["unit"], [],
                         bool(row["flowq"].get("higher_is_better", True)))
            info = {"measured": False, "reason": why}
        out.append(Row(scenario, _figure(row["flowq"]),
                       [ref, *(_figure(r) for r in row["references"])], row.get("note", ""),
                       {**row.get("extra", {}), "baseline": {"label": label, **info}}))
    return out


@contextlib.contextmanager
def _server(url: str | None) -> Iterator[str]:
    """`url`, or a fresh embedded server's for the block (both sides use it)."""
    if url is not None:
        yield url
        return
    from flowq.local.postgres import LocalPostgres

    embedded = LocalPostgres().start()
    try:
        yield embedded.url
    finally:
        embedded.stop()


def run_versus(url: str | None, names: Sequence[str], argv: list[str], repeat: int,
               baseline: tuple[str | None, str | None],
               say: Callable[[str], None] = lambda _: None) -> tuple[str, dict[str, Any]]:
    """Run `names` A B B A (A: `baseline` = (python, path)) with the options `argv` (each
    side gets those its bench takes); the table and the JSON document."""
    from flowq_bench.report import render_table, to_json

    runs = max(1, math.ceil(repeat / 2))
    with tempfile.TemporaryDirectory(prefix="flowq-bench-versus-") as cwd:
        a = baseline_side(*baseline, cwd=cwd)
        b = this_side()
        # B is this bench: it takes every option of argv.
        b.options = {arg for arg in argv if arg.startswith("--")} | {"--json-file", "--repeat"}
        dropped = sorted({arg for arg in argv if arg.startswith("--")} - a.options)
        sides = {"A": a, "B": b}
        rows: list[Any] = []
        machine: dict[str, Any] = {}
        not_measured: dict[str, str] = {}
        with _server(url) as server_url:
            for i, scenario in enumerate(names, 1):
                say(f"[{i}/{len(names)}] running {scenario} … A B B A (A: {a.label})\n")
                docs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
                missing = ""
                for j, name in enumerate(ORDER, 1):
                    side = sides[name]
                    say(f"  {name} ({side.label}): {j}/{len(ORDER)}\n")
                    if name == "A" and missing:
                        continue  # it could not run this scenario: no second try
                    mine = _argv([*argv, "--repeat", str(runs)], side.options)
                    got = _invoke(side, scenario, server_url, mine, cwd, say)
                    if got.doc is None:
                        if name == "B":
                            raise RuntimeError(f"flowq bench --scenario {scenario} failed "
                                               f"on this flowq: {got.reason}")
                        missing = f"the baseline could not run it ({got.reason})"
                        continue
                    docs[name].append(got.doc)
                    machine = machine or (got.doc["machine"] if name == "B" else {})
                if missing:
                    not_measured[scenario] = missing
                rows += _rows(scenario, [d["scenarios"][scenario] for d in docs["B"]],
                              [d["scenarios"][scenario] for d in docs["A"]], missing,
                              a.label)
    head = (f"baseline (A): {a.label} = {a.python}"
            + (f", PYTHONPATH={a.env['PYTHONPATH']}" if baseline[1] else "")
            + f"\norder per scenario: A B B A, {runs} run(s) each: medians over "
            f"{2 * runs} runs per side; the first reference of every figure is the baseline "
            "(ratio = this flowq / baseline), the others the raw references this side "
            "measured" + (f"\nnot given to the baseline (its bench lacks them): "
                          f"{', '.join(dropped)}" if dropped else ""))
    options = {"scenarios": list(names), "argv": argv, "repeat_per_invocation": runs}
    doc = to_json(machine, options, rows)
    doc["baseline"] = {"label": a.label, "python": a.python, "path": baseline[1],
                       "order": ORDER, "runs_per_side": 2 * runs, "not_given": dropped,
                       "not_measured": not_measured}
    return head + "\n" + render_table(machine, rows, 2 * runs), doc


def _argv(argv: list[str], known: set[str]) -> list[str]:
    """`argv` (options, each followed by its value unless it is a flag) without the options
    not in `known`."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            skip = arg not in known
            if not skip:
                out.append(arg)
        elif not skip and i:
            out.append(arg)
    return out
