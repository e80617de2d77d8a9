"""The rule for migrations (docs/operations.md, "Rolling releases and migrations"): expand now,
contract a release later.

A revision's `upgrade()` runs while workers of the previous release still run, so it may only
add what the previous release can ignore. Every file in alembic/versions is parsed (`ast`, the
marker with `tokenize`) and an `upgrade()` that removes or changes what the previous release
reads is refused, unless the file says, in a marker comment, that it is a contraction and why:
`# flowq: contract (previous release 0.4 no longer reads jobs.old_column)`.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Final

import pytest

from flowq.db.migrations import HEAD_REVISION, is_known_revision

VERSIONS: Final = Path(__file__).resolve().parents[2] / "alembic" / "versions"
MARKER: Final = re.compile(r"#\s*flowq:\s*contract\s*\((?P<reason>[^)]*\S[^)]*)\)")
# Operations that take away what the previous release reads or writes.
ALWAYS: Final = {"drop_column": "drops a column", "drop_table": "drops a table",
                 "rename_table": "renames a table"}
# Raw SQL words that remove or rename (DROP DEFAULT / DROP NOT NULL only relax a column, but a
# rule that reads SQL this far should be told so in the marker).
RAW_BREAKING: Final = re.compile(r"\b(DROP|RENAME)\b", re.IGNORECASE)


def _is_false(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def _keywords(call: ast.Call) -> dict[str, ast.expr]:
    return {k.arg: k.value for k in call.keywords if k.arg is not None}


def _op_name(call: ast.Call) -> str | None:
    """`drop_column` for `op.drop_column(...)`, None for anything not called on `op`."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
            and func.value.id == "op":
        return func.attr
    return None


def _strings(node: ast.AST) -> list[str]:
    """The literal text in `node`: string constants and the fixed parts of f-strings."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def _column_breaks(column: ast.expr) -> bool:
    """A new column the previous release's INSERTs cannot fill: NOT NULL without a default."""
    if not isinstance(column, ast.Call):
        return False
    kw = _keywords(column)
    return ("nullable" in kw and _is_false(kw["nullable"])) and "server_default" not in kw


def breaking_operations(source: str) -> list[str]:
    """What `upgrade()` in this revision's source does that breaks the previous release."""
    tree = ast.parse(source)
    found: list[str] = []
    for fn in tree.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "upgrade"):
            continue
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            name = _op_name(call)
            if name is None:
                continue
            kw = _keywords(call)
            where = f"line {call.lineno}: op.{name}"
            if name in ALWAYS:
                found.append(f"{where} {ALWAYS[name]}")
            elif name == "alter_column":
                if "nullable" in kw and _is_false(kw["nullable"]):
                    found.append(f"{where} makes a column NOT NULL")
                if "type_" in kw:
                    found.append(f"{where} changes a column's type")
                if "new_column_name" in kw:
                    found.append(f"{where} renames a column")
            elif name == "add_column":
                columns = [*call.args[1:2], *([kw["column"]] if "column" in kw else [])]
                if any(_column_breaks(c) for c in columns):
                    found.append(f"{where} adds a NOT NULL column without a server_default")
            elif name == "execute":
                words = {m.upper() for s in _strings(call) for m in RAW_BREAKING.findall(s)}
                if words:
                    found.append(f"{where} runs raw SQL with {', '.join(sorted(words))}")
    return found


def contract_reason(source: str) -> str | None:
    """The reason in the file's `# flowq: contract (...)` comment, if it has one."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and (m := MARKER.search(tok.string)):
            return m.group("reason").strip()
    return None


REVISIONS = sorted(VERSIONS.glob("*.py"))


def test_the_revisions_are_all_read() -> None:
    assert [p.name[:4] for p in REVISIONS][-1] == HEAD_REVISION
    assert len(REVISIONS) >= 7


@pytest.mark.parametrize("path", REVISIONS, ids=[p.name for p in REVISIONS])
def test_every_upgrade_keeps_the_previous_release_working(path: Path) -> None:
    source = path.read_text()
    breaks = breaking_operations(source)
    assert not breaks or contract_reason(source), (
        f"{path.name}: {'; '.join(breaks)}. The previous release still runs while this "
        "migration lands: add only (nullable columns, new tables, indexes), and contract a "
        "release later with a `# flowq: contract (previous release X no longer reads it)` "
        "comment (docs/operations.md, 'Rolling releases and migrations').")


UPGRADE = "from alembic import op\nimport sqlalchemy as sa\n\ndef upgrade() -> None:\n    {}\n"
BREAKING = {
    "drop_column": 'op.drop_column("jobs", "old", schema=S)',
    "drop_table": 'op.drop_table("old")',
    "rename_table": 'op.rename_table("jobs", "tasks")',
    "not null": 'op.alter_column("jobs", "queue", nullable=False)',
    "type": 'op.alter_column("jobs", "priority", type_=sa.BigInteger)',
    "rename column": 'op.alter_column("jobs", "queue", new_column_name="lane")',
    "not null column": 'op.add_column("jobs", sa.Column("x", sa.Integer, nullable=False))',
    "not null column by keyword":
        'op.add_column("jobs", column=sa.Column("x", sa.Integer, nullable=False))',
    "raw drop": 'op.execute(f"ALTER TABLE {S}.jobs DROP COLUMN old")',
    "raw rename": 'op.execute(sa.text("alter table flowq.jobs rename to tasks"))',
}
FINE = {
    "nullable column": 'op.add_column("jobs", sa.Column("x", sa.Integer))',
    "not null with a default": 'op.add_column("jobs", sa.Column("x", sa.Boolean, '
                               'nullable=False, server_default=sa.false()))',
    "relaxing": 'op.alter_column("jobs", "queue", nullable=True)',
    "new table": 'op.create_table("t", sa.Column("id", sa.Integer))',
    "index": 'op.create_index("i", "jobs", ["queue"])',
    "not op": 'other.drop_table("x")',
}


@pytest.mark.parametrize("statement", list(BREAKING.values()), ids=list(BREAKING))
def test_the_rule_refuses_what_breaks_the_previous_release(statement: str) -> None:
    source = UPGRADE.format(statement)
    assert breaking_operations(source), statement
    assert contract_reason(source) is None
    marked = "# flowq: contract (previous release 0.3 no longer reads it)\n" + source
    assert contract_reason(marked) == "previous release 0.3 no longer reads it"


@pytest.mark.parametrize("statement", list(FINE.values()), ids=list(FINE))
def test_the_rule_lets_expansions_through(statement: str) -> None:
    assert breaking_operations(UPGRADE.format(statement)) == []


def test_downgrades_may_drop_and_an_empty_marker_is_no_marker() -> None:
    source = ("from alembic import op\n\ndef upgrade() -> None:\n    pass\n\n"
              "def downgrade() -> None:\n    op.drop_column('jobs', 'x')\n")
    assert breaking_operations(source) == []
    assert contract_reason("# flowq: contract ()\n# flowq: contract (  )\n") is None
    # A string that looks like the marker is not a comment.
    assert contract_reason('X = "# flowq: contract (not a comment)"\n') is None


def test_a_revision_this_flowq_ships_is_known_and_others_are_newer() -> None:
    assert all(is_known_revision(p.name[:4]) for p in REVISIONS)
    for other in ("0999", "head", "base", "000", "", None, "0007 ", "'; DROP TABLE x"):
        assert not is_known_revision(other), other
