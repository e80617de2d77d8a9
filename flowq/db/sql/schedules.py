"""`flowq.schedules`: the cursors of periodic schedules."""

from __future__ import annotations

from functools import cached_property

from sqlalchemy.sql.elements import TextClause

from flowq.db.sql.fragments import S, Statements

__all__ = ["ScheduleStatements"]


class ScheduleStatements(Statements):
    """The statements of `flowq.schedules`, for one schema."""

    @cached_property
    def select_schedules(self) -> TextClause:
        """Read the cursors of periodic schedules, with the database clock.

        The cursor of each of :names (the last tick it enqueued, or when it was first seen;
        NULL: not yet entered) with the database's clock, one row per name."""
        return self.sql(f"""
            SELECT n.name, s.last_tick, clock_timestamp() AS now
              FROM unnest(CAST(:names AS text[])) AS n(name)
              LEFT JOIN {S}.schedules s ON s.name = n.name""")

    @cached_property
    def start_schedules(self) -> TextClause:
        """Enter new periodic schedules, their cursor at now.

        Enter the schedules :names (:tasks, :specs) that are not in the table yet, with
        their cursor at :now: a new schedule starts from now, it does not backfill."""
        return self.sql(f"""
            INSERT INTO {S}.schedules (name, task, spec, last_tick)
            SELECT n.name, n.task, n.spec, CAST(:now AS timestamptz)
              FROM unnest(CAST(:names AS text[]), CAST(:tasks AS text[]),
                          CAST(:specs AS text[])) AS n(name, task, spec)
             ORDER BY n.name
            ON CONFLICT (name) DO UPDATE SET last_tick = excluded.last_tick
             WHERE schedules.last_tick IS NULL""")

    @cached_property
    def stamp_scheduled_run(self) -> TextClause:
        """Record on a run's rows the schedule tick it runs for.

        Record on the rows of run :run_id the tick :tick it runs for (`ctx.scheduled_at`),
        in the transaction that enqueued it, so no worker ever sees the run without it."""
        return self.sql(f"""
            UPDATE {S}.jobs SET scheduled_at = CAST(:tick AS timestamptz)
             WHERE run_id = :run_id""")

    @cached_property
    def advance_schedule(self) -> TextClause:
        """Move a schedule's cursor to the tick it enqueued.

        Record that schedule :name (:task, :spec) enqueued its tick :tick as run :run_id.
        The cursor never moves back: a slower pass may commit an older tick after a newer
        one."""
        return self.sql(f"""
            INSERT INTO {S}.schedules (name, task, spec, last_tick, last_run_id)
            VALUES (:name, :task, :spec, CAST(:tick AS timestamptz), :run_id)
            ON CONFLICT (name) DO UPDATE
               SET task = excluded.task, spec = excluded.spec, updated_at = now(),
                   last_run_id = CASE WHEN schedules.last_tick IS NULL
                                        OR excluded.last_tick >= schedules.last_tick
                                      THEN excluded.last_run_id
                                      ELSE schedules.last_run_id END,
                   last_tick = greatest(schedules.last_tick, excluded.last_tick)""")

    @cached_property
    def list_schedules(self) -> TextClause:
        """List every recorded schedule, with the database clock.

        Every recorded schedule by name, each with the database's clock (one row of NULLs
        and the clock when there is none)."""
        return self.sql(f"""
            SELECT c.now, s.name, s.task, s.spec, s.last_tick, s.last_run_id, s.updated_at
              FROM (SELECT now() AS now) c LEFT JOIN {S}.schedules s ON true
             ORDER BY s.name""")
