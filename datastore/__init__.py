"""datastore: corpus -> (key, next token) pairs -> FAISS index on disk -> Datastore.search().

Files in data-flow order: manifest.py (what a datastore directory says about itself), shards.py
(crash-safe files), documents.py (the documents table), index.py (FAISS factory, training, adding), build.py (the resumable stages),
datastore.py (open + search: the Searcher seam), commands.py (the typed CLI entry points).
"""

from datastore.build import BuildSettings, BuildSource, build_from_tokens
from datastore.commands import (
    add_to_datastore,
    build_datastore,
    datastore_docs,
    datastore_info,
)
from datastore.datastore import Datastore
from datastore.documents import DocumentRecord, SourceDocument
from datastore.manifest import Manifest

__all__ = [
    "BuildSettings",
    "BuildSource",
    "Datastore",
    "DocumentRecord",
    "Manifest",
    "SourceDocument",
    "add_to_datastore",
    "build_datastore",
    "build_from_tokens",
    "datastore_docs",
    "datastore_info",
]
