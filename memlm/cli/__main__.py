"""`python -m memlm.cli`: the same as `memlm`."""

from memlm.cli.commands import main

raise SystemExit(main())
