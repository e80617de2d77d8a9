"""`python -m flowq` is the `flowq` command."""

from flowq.cli import main

main()
