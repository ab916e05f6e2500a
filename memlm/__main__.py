import sys

from memlm.cli import main

sys.exit(main())
