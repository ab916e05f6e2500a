"""Split expressions (`split`, the command line's `--split EXPR`) select documents; no eval, a small parser::

    expr    := item ("," item)*            items are ANDed; commas inside quotes do not split
    item    := hub | cond | slice           hub only first, a slice only last
    hub     := NAME ["[" A ":" B "]"]       hub split name, passed through: "train", "test[:1%]"
    cond    := FIELD OP VALUE               "year<2001", "president=Lincoln", "party!=Whig"
             | VALUE LT FIELD LT VALUE      "1990<=year<=2000" (or both > / >=)
    OP      := "<" | "<=" | ">" | ">=" | "=" | "==" | "!="
    VALUE   := number | bare text (no , < > = !) | 'quoted' | "quoted"
    slice   := "[" [INT] ":" [INT] "]"      positions over the documents that pass the conditions
                                            ("[0:10]", "[-5:]", "year>=2001[:3]")

A condition on a numeric field compares numbers ("year<2001" with year 1999 holds); a quoted value
always compares as text; ordering on text fields compares numbers when both sides are numbers and
strings otherwise (so ISO dates order correctly: "date>=1990-01-01"). Equality is case-sensitive.
A document without the field fails the condition; a field that no document has is an error.
A hub part selects rows before the conditions (datasets' own split syntax, percentages included);
local files and fetched corpora have one split, "train". Empty documents are kept (they keep their
position); a corpus whose selected documents are all empty is an error.
"""

from __future__ import annotations

import collections
import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from memlm.errors import MemlmError

# split expressions

SPLIT_SYNTAX = (
    "split syntax: conditions joined by ',' (AND) and an optional trailing slice, e.g. "
    "'year<2001', '1990<=year<=2000', 'president=Lincoln', 'year>=1990,year<2001', '[0:10]', '[-5:]', "
    "'year>=2001[:3]'; or a hub split name first: 'train', 'test[:1%]', 'train,year>2000'"
)
_FIELD = r"[A-Za-z_][A-Za-z0-9_]*"
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_HUB = re.compile(rf"({_FIELD})(\[[^\[\]]*\])?")
SLICE_RE = re.compile(r"\[\s*(-?\d+)?\s*:\s*(-?\d+)?\s*\]")
_HUB_SLICE = re.compile(r"\[\s*(-?\d+%?)?\s*:\s*(-?\d+%?)?\s*\]")
_COND = re.compile(rf"({_FIELD})\s*(<=|>=|==|!=|=|<|>)\s*(.+)")
_RANGE = re.compile(rf"(.+?)\s*(<=|>=|<|>)\s*({_FIELD})\s*(<=|>=|<|>)\s*(.+)")
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "=": lambda a, b: a == b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


def _bad(expr: str, why: str) -> MemlmError:
    return MemlmError(f"bad split {expr!r}: {why}; {SPLIT_SYNTAX}")


def _as_number(text: str) -> int | float | None:
    if not _NUMBER.fullmatch(text):
        return None
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


@dataclass(frozen=True)
class Condition:
    """One comparison `FIELD OP VALUE` of a split expression."""

    field: str
    """Metadata field the condition reads."""
    op: str
    """One of < <= > >= = == !=."""
    value: str
    """The literal as written (quotes removed)."""
    quoted: bool
    """A quoted literal always compares as text."""

    def __str__(self) -> str:
        lit = json.dumps(self.value) if self.quoted or not re.fullmatch(r"[^,<>=!\"'\[\]]+", self.value) else self.value
        return f"{self.field}{'=' if self.op == '==' else self.op}{lit}"

    def holds(self, meta: dict) -> bool:
        """Whether a document with this meta passes; a missing or null field fails."""
        have = meta.get(self.field)
        if have is None:
            return False
        cmp = _OPS[self.op]
        lit_num = None if self.quoted else _as_number(self.value)
        if isinstance(have, (int, float)) and not isinstance(have, bool):
            if lit_num is None:
                raise MemlmError(f"split condition {self}: field {self.field!r} is numeric but {self.value!r} is not a number")
            return cmp(have, lit_num)
        text = str(have)
        if self.op not in ("=", "==", "!=") and lit_num is not None:
            have_num = _as_number(text)
            if have_num is not None:
                return cmp(have_num, lit_num)
        return cmp(text, self.value)


@dataclass(frozen=True)
class SplitExpr:
    """A parsed split expression; `str()` gives its canonical form (used in fingerprints)."""

    hub: str | None
    """Hub split name with its own bracket, e.g. "train" or "train[:1%]"; None selects everything."""
    conditions: tuple[Condition, ...]
    """ANDed conditions on document metadata."""
    start: int | None
    """Positional slice over the documents that pass the conditions (Python slice semantics)."""
    stop: int | None

    def __str__(self) -> str:
        parts = ([self.hub] if self.hub else []) + [str(c) for c in self.conditions]
        text = ",".join(parts)
        if self.start is not None or self.stop is not None:
            text += f"[{'' if self.start is None else self.start}:{'' if self.stop is None else self.stop}]"
        return text


def _split_items(expr: str) -> list[str]:
    """Split on commas outside quotes and brackets."""
    items, cur, quote, depth = [], [], None, 0
    for ch in expr:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if quote:
        raise _bad(expr, "unclosed quote")
    items.append("".join(cur).strip())
    return items


def _literal(expr: str, text: str) -> tuple[str, bool]:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1], True
    if not text or re.search(r"[<>=!'\"\[\]]", text):
        raise _bad(expr, f"bad value {text!r} (quote values that hold < > = ! or quotes)")
    return text, False


def _mask_quotes(item: str) -> str:
    """`item` with the inside of quotes blanked, so operators inside quoted values are not operators."""
    out, quote = [], None
    for ch in item:
        if quote:
            out.append(ch if ch == quote else "_")
            quote = None if ch == quote else quote
        else:
            quote = ch if ch in "'\"" else None
            out.append(ch)
    return "".join(out)


def _condition(expr: str, item: str) -> list[Condition]:
    masked = _mask_quotes(item)  # same length as item: spans found in it index item
    m = _RANGE.fullmatch(masked)
    if m:
        lo, op1, field, op2, hi = (item[m.start(i) : m.end(i)] for i in range(1, 6))
        if (op1[0] == "<") != (op2[0] == "<"):
            raise _bad(expr, f"a range {item!r} needs both bounds in one direction (a<=x<b or a>=x>b)")
        lo_v, lo_q = _literal(expr, lo)
        hi_v, hi_q = _literal(expr, hi)
        # "lo < field" is "field > lo".
        return [Condition(field, _FLIP[op1], lo_v, lo_q), Condition(field, op2, hi_v, hi_q)]
    m = _COND.fullmatch(masked)
    if m:
        value, quoted = _literal(expr, item[m.start(3) :])
        return [Condition(m.group(1), m.group(2), value, quoted)]
    raise _bad(expr, f"cannot read {item!r}")


def parse_split(expr: str | None) -> SplitExpr | None:
    """Parse a split expression (grammar in the module docstring); None or blank -> None."""
    if expr is None or not expr.strip():
        return None
    items = _split_items(expr.strip())
    if any(not it for it in items):
        raise _bad(expr, "empty item between commas")
    hub, start, stop = None, None, None
    first = _HUB.fullmatch(items[0])
    if first:
        if first.group(2) and not _HUB_SLICE.fullmatch(first.group(2)):
            raise _bad(expr, f"bad slice in {items[0]!r}")
        hub = items.pop(0)
    if items:
        last = items[-1]
        m = re.search(r"\[[^\[\]]*\]$", last)
        if m:
            sl = SLICE_RE.fullmatch(m.group(0))
            if not sl:
                raise _bad(expr, f"bad slice {m.group(0)!r}: positions are integers, as in [0:10] or [-5:]")
            start = None if sl.group(1) is None else int(sl.group(1))
            stop = None if sl.group(2) is None else int(sl.group(2))
            items[-1] = last[: m.start()].strip()
            if not items[-1]:
                items.pop()
    conditions: list[Condition] = []
    for it in items:
        if "[" in it or "]" in it:
            raise _bad(expr, f"a slice may only end the expression, found {it!r}")
        conditions.extend(_condition(expr, it))
    return SplitExpr(hub, tuple(conditions), start, stop)


def slice_iter(items: Iterable, start: int | None, stop: int | None) -> Iterator:
    """`list(items)[start:stop]` over an iterator, holding at most |negative bound| items in memory."""
    if (start is None or start >= 0) and (stop is None or stop >= 0):
        yield from itertools.islice(items, start, stop)
        return
    if start is not None and start < 0:
        # The last -start items are candidates; which of them survive depends on the total count.
        tail: collections.deque = collections.deque(maxlen=-start)
        n = 0
        for x in items:
            tail.append(x)
            n += 1
        first = n - len(tail)
        keep = range(n)[slice(start, stop)]
        for i, x in enumerate(tail, first):
            if i in keep:
                yield x
        return
    # start >= 0 and stop < 0: an item is safe once -stop later items have been seen.
    lag: collections.deque = collections.deque()
    for i, x in enumerate(items):
        lag.append((i, x))
        if len(lag) > -stop:
            j, y = lag.popleft()
            if start is None or j >= start:
                yield y


