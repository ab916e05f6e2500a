"""manifest.json: everything a datastore directory says about itself.

A datastore carries its settings beside it: size, dimension, dtypes, key layer, the
fingerprints of the model, tokenizer and corpus it was built from, the FAISS factory string, and a
checksum of every file. Nothing has to be typed in by hand to open it (the old kNN-LM code needed
`dstore_size`); its presence marks a finished build.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError

FORMAT_VERSION = 4
"""4: the documents table, documents.jsonl (datastore.documents.DocumentRecord: id, fingerprint, tokens,
metadata of every document), and generations: `generation` counts the commits of add/remove/compact, and
each file entry names the file that holds it (`FileEntry.name`), so a new generation writes new files
and commits by renaming one manifest.
3: every entry's provenance, docs.i32 and positions.i32, and the number of documents.
2: the text layout is recorded in full (sink_tokens beside context, stride and boundary_token).
A version-2 datastore still opens and searches (kNN-LM needs no provenance); asking it for provenance is
refused with the rebuild command (Datastore.provenance). A version-1 manifest is refused as an older
format (rebuild), not as a damaged one."""
READABLE_VERSIONS = (2, 3, FORMAT_VERSION)
"""Format versions this memlm opens."""
PROVENANCE_VERSION = 3
"""The first format version with docs.i32 and positions.i32."""
DOCUMENTS_VERSION = 4
"""The first format version with the documents table (documents.jsonl), generations and named file entries."""
MANIFEST_NAME = "manifest.json"
KEYS_NAME = "keys.f16"
"""(N, d) float16, row-major, little-endian, no header: np.memmap(path, "<f2", "r", shape=(N, d))."""
VALUES_NAME = "values.i32"
"""(N,) int32 little-endian next-token ids (int32: SmolLM2's 49152 ids overflow int16)."""
DOCS_NAME = "docs.i32"
"""(N,) int32 little-endian: entry i's document, its index in the build's corpus order (the documents as
the builder read them, after --max-tokens, empty ones counted too: 0 .. documents - 1). Non-decreasing."""
POSITIONS_NAME = "positions.i32"
"""(N,) int32 little-endian: the position of entry i's next token (values[i]) in its document, where the
document boundary token is position 0 and the document's j-th token (0-based) is position j + 1, i.e. the
index in the model's input [boundary, *document]. So values[i] == document[positions[i] - 1] and entry i's
key is the decoder's state at input index positions[i] - 1 (memlm.retrieval.searcher.Provenance)."""
INDEX_NAME = "index.faiss"
"""The FAISS index over the keys (faiss.write_index format); row i of the index is row i of the keys."""
DOCUMENTS_NAME = "documents.jsonl"
"""One JSON object a document, in document-index order (the values of docs.i32):
datastore.documents.DocumentRecord field for field (format 4 on)."""


@dataclass(frozen=True)
class FileEntry:
    bytes: int
    """File size in bytes."""
    sha256: str
    """Hex SHA-256 of the whole file."""
    name: str = ""
    """The file in the datastore directory that holds this role (`Manifest.files` is keyed by role, e.g.
    "keys.f16"); a later generation's file carries its generation ("keys.g000002.f16"). "" in formats 2-3,
    where the role is the file's name."""


@dataclass(frozen=True)
class Manifest:
    n: int
    """Number of (key, next token) pairs N."""
    dim: int
    """Key dimension d."""
    key_layer: str
    """Which activation the keys are (ModelConfig.key_description, e.g. "ffn_input.29")."""
    model_name: str
    """Model the keys came from, as the user named it (preset, path or hub id)."""
    model_fingerprint: str
    """Fingerprint of the model weights; queries must come from the same model."""
    tokenizer_fingerprint: str
    """Fingerprint of the tokenizer; values are its token ids."""
    corpus: str
    """Corpus spec as the user gave it (path or name), with the split."""
    corpus_fingerprint: str
    """Fingerprint of the corpus content the datastore was built from."""
    index_factory: str
    """FAISS factory string of the index, e.g. "IVF1024,PQ64" or "Flat"."""
    metric: str
    """"l2": distances are squared Euclidean distances, smaller is nearer."""
    nprobe: int
    """Default inverted lists visited per query (1 and unused for Flat)."""
    context: int
    """Window length the keys were computed with (tokens of input per window)."""
    stride: int
    """Window stride; each key saw at least context - stride tokens of left context."""
    boundary_token: int
    """Token prepended to each document (memlm.model.tokenizer.document_boundary); queries must use the same."""
    sink_tokens: int
    """Attention-sink tokens kept when the keys were made (0: plain sliding windows, what the builder does)."""
    files: dict[str, FileEntry]
    """Checksums of every data file in the directory, by file name."""
    build: dict[str, Any] = field(default_factory=dict)
    """Build settings and facts (batch size, dtype, device, shard size, timings, versions)."""
    documents: int = 0
    """Documents in the datastore (ids in docs.i32 are below it; empty and removed documents count); 0 in
    format 2."""
    generation: int = 0
    """0 as built; each `memlm datastore add`, `remove` and `compact` commits the next one (format 4)."""
    format_version: int = FORMAT_VERSION
    """Version of this directory layout."""
    key_dtype: str = "float16"
    """Dtype of keys.f16."""
    value_dtype: str = "int32"
    """Dtype of values.i32."""
    weights: str = "float32"
    """Weight format of the model that computed the keys (memlm.model.weight_formats.format_of); a manifest
    written before formats were recorded reads as its float model_dtype (float32 where it has none)."""

    @property
    def has_provenance(self) -> bool:
        """Whether docs.i32 and positions.i32 exist (format 3 on)."""
        return self.format_version >= PROVENANCE_VERSION

    @property
    def has_documents(self) -> bool:
        """Whether the documents table documents.jsonl exists (format 4 on)."""
        return self.format_version >= DOCUMENTS_VERSION

    def file_name(self, role: str) -> str:
        """The file in the directory that holds `role` (a *_NAME constant) in this generation."""
        return self.files[role].name or role

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "manifest.json") -> "Manifest":
        """Parse and check a manifest: every field present with its type, and an entry in `files` for each
        file a datastore needs (a missing entry would turn that file's size and checksum check off)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise MemlmError(f"{source} is not valid JSON ({e}); the datastore is damaged, rebuild it") from e
        if not isinstance(raw, dict):
            raise MemlmError(f"{source} holds a JSON {type(raw).__name__}, not an object; the datastore is "
                             "damaged, rebuild it")
        version = raw.get("format_version")
        if version not in READABLE_VERSIONS:
            raise MemlmError(
                f"{source} has datastore format version {version}, this memlm reads version {FORMAT_VERSION} "
                "(and 3, without the documents table; 2, without provenance either); rebuild the datastore with "
                "this memlm"
            )
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        optional = ({"build", "weights"} | ({"documents"} if version < PROVENANCE_VERSION else set())
                    | ({"generation"} if version < DOCUMENTS_VERSION else set()))
        missing = sorted(set(known) - set(raw) - optional)
        if missing:
            raise MemlmError(f"{source} lacks {', '.join(missing)}; the datastore is damaged, rebuild it")
        raw = {k: v for k, v in raw.items() if k in known}
        if "weights" not in raw:  # the float model that computed the keys was then the only kind
            build = raw.get("build")
            raw["weights"] = str(build.get("model_dtype", "float32") if isinstance(build, dict) else "float32")
        for name, type_name in known.items():
            if name in raw and name != "files":
                _check_type(raw[name], _FIELD_TYPES[type_name], name, source)
        raw["files"] = _file_entries(raw["files"], required_files(version), version >= DOCUMENTS_VERSION, source)
        for name in ("n", "dim", "nprobe", "context", "stride", "documents", "generation"):
            if name in raw and raw[name] < (1 if name in ("dim", "nprobe", "context", "stride") else 0):
                raise MemlmError(f"{source}: {name} is {raw[name]}; the datastore is damaged, rebuild it")
        return cls(**raw)

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST_NAME
        if not path.is_file():
            raise MemlmError(
                f"{directory} holds no {MANIFEST_NAME}: not a finished memlm datastore "
                "(build one with `memlm datastore build`, or finish an interrupted build by running it again)"
            )
        return cls.from_json(path.read_text(), str(path))


PROVENANCE_FILES = (DOCS_NAME, POSITIONS_NAME)
"""The per-entry provenance arrays, from format 3 on."""
REQUIRED_FILES = (KEYS_NAME, VALUES_NAME, INDEX_NAME, *PROVENANCE_FILES, DOCUMENTS_NAME)
"""Files every datastore of this format has; each must have its entry in `Manifest.files`."""


def required_files(version: int) -> tuple[str, ...]:
    """The files a datastore of format `version` has (format 2 had no provenance, 3 no documents table)."""
    if version >= DOCUMENTS_VERSION:
        return REQUIRED_FILES
    return (KEYS_NAME, VALUES_NAME, INDEX_NAME, *(PROVENANCE_FILES if version >= PROVENANCE_VERSION else ()))


DATA_ROLES = (KEYS_NAME, VALUES_NAME, DOCS_NAME, POSITIONS_NAME, INDEX_NAME, DOCUMENTS_NAME)
"""Every data file a datastore of this format has, by role (the keys of `Manifest.files`)."""


def file_generation(name: str) -> int | None:
    """The generation whose `generation_file` is `name` (0 for a role's own name), None for a file that is
    no datastore data file."""
    for role in DATA_ROLES:
        stem, _, suffix = role.rpartition(".")
        if name == role:
            return 0
        if name.startswith(f"{stem}.g") and name.endswith(f".{suffix}"):
            digits = name[len(stem) + 2 : -len(suffix) - 1]
            if len(digits) == 6 and digits.isdigit():
                return int(digits)
    return None


def generation_file(role: str, generation: int) -> str:
    """The file name a generation writes for `role`: the role itself for generation 0 (what a build
    writes), else the role with the generation before its suffix ("keys.g000002.f16"), so a new
    generation never overwrites a file the committed one names (a reader of it keeps working)."""
    if generation == 0:
        return role
    stem, dot, suffix = role.rpartition(".")
    return f"{stem}.g{generation:06d}{dot}{suffix}"
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "str": str, "dict[str, Any]": dict,
                                                   "dict[str, FileEntry]": dict}
"""JSON types of the manifest's fields, by their annotation."""


def _check_type(value: Any, expected: type | tuple[type, ...], name: str, source: str) -> None:
    # bool is an int to Python but never a count in a manifest.
    if isinstance(value, bool) or not isinstance(value, expected):
        want = expected.__name__ if isinstance(expected, type) else "/".join(t.__name__ for t in expected)
        raise MemlmError(f"{source}: {name} is {json.dumps(value)[:60]}, not a JSON {_JSON_NAMES.get(want, want)}; "
                         "the datastore is damaged, rebuild it")


_JSON_NAMES = {"int": "integer", "str": "string", "dict": "object"}


def _file_entries(files: Any, required: tuple[str, ...], named: bool, source: str) -> dict[str, FileEntry]:
    """`files` of a manifest: {role: {"bytes": int, "sha256": str[, "name": str]}}, holding an entry for each
    `required` role; `named` (format 4): every entry names its file, a plain name inside the directory."""
    _check_type(files, dict, "files", source)
    entries = {}
    fields = {"bytes", "sha256", "name"} if named else {"bytes", "sha256"}
    for name, entry in files.items():
        _check_type(entry, dict, f"files.{name}", source)
        if set(entry) != fields:
            raise MemlmError(f"{source}: files.{name} must hold {', '.join(sorted(fields))}, has "
                             f"{', '.join(sorted(entry)) or 'nothing'}; the datastore is damaged, rebuild it")
        _check_type(entry["bytes"], int, f"files.{name}.bytes", source)
        _check_type(entry["sha256"], str, f"files.{name}.sha256", source)
        file = entry.get("name", "")
        if named:
            _check_type(file, str, f"files.{name}.name", source)
            if not file or Path(file).name != file or file in (".", ".."):
                raise MemlmError(f"{source}: files.{name}.name is {file!r}, not a file name inside the datastore; "
                                 "the datastore is damaged, rebuild it")
        entries[name] = FileEntry(bytes=entry["bytes"], sha256=entry["sha256"], name=file)
    absent = [name for name in required if name not in entries]
    if absent:
        raise MemlmError(f"{source}: files has no entry for {', '.join(absent)}, so it could not be checked; "
                         "the datastore is damaged, rebuild it")
    return entries
