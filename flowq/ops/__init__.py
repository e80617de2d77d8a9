"""Operations on a running system, the library behind the CLI and the dashboard: runs
(`runs`: reading, waiting, cancel, retry, redrive; `runinfo`, `filters`), `queues`,
`schedules`, `status` and `doctor`. Each takes an Engine or a Connection (`binds`)."""
