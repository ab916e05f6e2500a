"""The two document sets of the lifecycle tests: A is built, B is added (or A + B built at once)."""

from __future__ import annotations

import sys
from pathlib import Path

from memlm.jobs.windows import WindowConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_helpers import make_docs

ALL = make_docs(seed=3, sizes=(300, 90, 0, 200, 33, 150, 120))
DOCS_A, DOCS_B = ALL[:4], ALL[4:]
WINDOW_1 = WindowConfig(context=48, stride=24, batch_size=1)
"""One window a forward batch: an add's batches then hold exactly what one build's do (bit-identical keys)."""
