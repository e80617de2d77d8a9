"""`flowq signal RUN_ID NAME [--payload JSON]`: delivered in its own transaction, one sentence
(exit code 2) for each thing that stops it, and no app needed (the real command, in a process
that never imported the app, checks the name against the definition its workers recorded)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from types import ModuleType

import pytest
import sqlalchemy as sa
from support import NO_ENV, assert_user_error, enqueue_id
from support import cli as flowq

from flowq.ops.runs import get_run
from flowq.testing import drain
from flowq.worker.registry import Registry


@pytest.fixture
def approvals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A module in the cwd whose pipeline `approval_<hex>` waits for signal `approved`."""
    name = f"signalapp_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""
        from typing import Any

        import flowq

        app = flowq.FlowQ()
        approval = app.pipeline("approval_{name}")

        @approval.step()
        def request(ctx: flowq.Context, doc: str) -> dict[str, str]:
            return {{"doc": doc}}

        @approval.step(wait_for="approved")
        def publish(ctx: flowq.Context, doc: str, approved: Any) -> dict[str, Any]:
            return {{"doc": doc, "by": approved}}
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def waiting_run(engine: sa.Engine, module: ModuleType, doc: str = "a") -> int:
    """A run of the module's pipeline, drained up to its step waiting for `approved`."""
    run_id = enqueue_id(engine, module.approval, doc=doc)
    drain(engine, module.app)
    assert get_run(engine, run_id).status == "waiting"
    return run_id


def test_a_signal_reaches_the_waiting_step(approvals: ModuleType, engine: sa.Engine,
                                           db_url: str) -> None:
    run_id = waiting_run(engine, approvals)
    sent = flowq("signal", str(run_id), "approved", "--payload", '{"by": "ann"}',
                 "--database-url", db_url)
    assert sent.exit_code == 0, sent.output
    assert sent.output == (f"signal 'approved' delivered to run {run_id}: the step waiting "
                           "for it runs next.\n")
    again = flowq("signal", str(run_id), "approved", "--payload", '{"by": "ann"}',
                  "--database-url", db_url, "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.output) == {"run_id": run_id, "name": "approved",
                                        "created": False, "delivered": False}
    drain(engine, approvals.app)
    assert get_run(engine, run_id).result == {"doc": "a", "by": {"by": "ann"}}
    # Before the step is reached, the signal waits for it; without --payload it is null.
    early = enqueue_id(engine, approvals.approval, doc="b")
    assert "recorded for run" in flowq("signal", str(early), "approved",
                                       "--database-url", db_url).output
    drain(engine, approvals.app)
    assert get_run(engine, early).result == {"doc": "b", "by": None}


def test_what_stops_a_signal_is_one_sentence(approvals: ModuleType, engine: sa.Engine,
                                             db_url: str) -> None:
    run_id = waiting_run(engine, approvals)

    def signal(*args: str) -> str:
        return assert_user_error(flowq("signal", *args, "--database-url", db_url))

    assert "no run 999999999 exists to signal" in signal("999999999", "approved")
    assert "--payload is not JSON" in signal(str(run_id), "approved", "--payload", "{by: ann}")
    assert "waits for 'approved'" in signal(str(run_id), "nope")
    flowq("signal", str(run_id), "approved", "--payload", "1", "--database-url", db_url)
    assert "already sent" in signal(str(run_id), "approved", "--payload", "2")
    drain(engine, approvals.app)
    assert "has finished" in signal(str(run_id), "approved")


def _flowq_process(*args: str, cwd: Path, env: dict[str, str] | None = None
                   ) -> subprocess.CompletedProcess[str]:
    """The real `flowq` in a process of its own, which imports no app unless told to."""
    base = {k: v for k, v in os.environ.items() if k not in NO_ENV}
    return subprocess.run([sys.executable, "-m", "flowq", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env={**base, **(env or {})})


def test_without_the_app_the_name_is_checked_against_the_recorded_definition(
        approvals: ModuleType, engine: sa.Engine, db_url: str, tmp_path: Path) -> None:
    run_id = waiting_run(engine, approvals)
    # No worker recorded the pipeline's shape: nothing can tell, and the command says so.
    unchecked = _flowq_process("signal", str(run_id), "unknown", "--database-url", db_url,
                               cwd=tmp_path)
    assert unchecked.returncode == 0, unchecked.stderr
    assert "warning: nothing here knows whether a step of run" in unchecked.stderr
    # A worker serving the pipeline recorded its shape (every worker does when it starts).
    Registry(engine, "flowq", worker="worker-a", queues=["default"],
             tasks=[approvals.approval.name], concurrency=1,
             definitions=approvals.app.definitions).register()
    refused = _flowq_process("signal", str(run_id), "aproved", "--database-url", db_url,
                             cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip() == (
        f"Error: no step of run {run_id} ('{approvals.approval.name}') waits for signal "
        "'aproved' (it waits for 'approved'); if today's code differs from what the run "
        "started on, pass --app MODULE:APP")
    # With the app (here from the environment), today's code says the same.
    named = _flowq_process("signal", str(run_id), "aproved", "--database-url", db_url,
                           cwd=tmp_path, env={"FLOWQ_APP": f"{approvals.__name__}:app"})
    assert named.returncode == 2 and "waits for 'approved'" in named.stderr, named.stderr
    sent = _flowq_process("signal", str(run_id), "approved", "--payload", '"yes"',
                          "--database-url", db_url, cwd=tmp_path)
    assert sent.returncode == 0, sent.stderr
    assert "delivered" in sent.stdout
    drain(engine, approvals.app)
    assert get_run(engine, run_id).result == {"doc": "a", "by": "yes"}
