"""datastore: corpus -> (key, next token) pairs -> FAISS index on disk -> Datastore.search().

Files in data-flow order: manifest.py (what a datastore directory says about itself), shards.py
(crash-safe files), index.py (FAISS factory, training, adding), build.py (the resumable stages),
datastore.py (open + search: the Searcher seam), commands.py (the typed CLI entry points).
"""

from datastore.build import BuildSettings, BuildSource, build_from_tokens
from datastore.commands import build_datastore, datastore_info
from datastore.datastore import Datastore
from datastore.manifest import Manifest

__all__ = [
    "BuildSettings",
    "BuildSource",
    "Datastore",
    "Manifest",
    "build_datastore",
    "build_from_tokens",
    "datastore_info",
]
