"""Operations on a running system, the library behind the CLI and the dashboard: runs
(`runs`: reading, cancel, retry, redrive; `runinfo`, `filters`; `results`: waiting for a
run's end and its result; `fork`: a new run from a step of an old one), `queues`,
`schedules`, `status` and `doctor`. Each takes an Engine or a Connection (`binds`)."""
