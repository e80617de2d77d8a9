"""Operations on a running system, the library behind the CLI and the dashboard: runs, their control, queues, schedules, status and doctor."""
