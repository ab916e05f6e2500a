"""The product speaks to its users, not to the people who built it: no text file of the source, tests,
benchmarks, scripts or docs carries dates, a particular test machine, issue numbers, commit hashes or
narration of how the work went. A docstring says what a thing does and why; measurements live on the
generated results pages (docs/results/measured.md and its data, excluded here).

The patterns are deliberately narrow, so that legitimate text passes: paper citations with years
(Khandelwal et al. 2020), memory sessions (a product concept), "issues a search", metadata dates in test
corpora ("date": "2000-01-27"), external references such as "facebookresearch/faiss issues #584".
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCANNED = ("memlm", "datastore", "services", "proto", "tests", "benchmarks", "scripts", "docs", "README.md",
           "Makefile", "pyproject.toml", "mkdocs.yml")
"""Where the checker looks (paths relative to the repository root)."""
SUFFIXES = (".py", ".proto", ".md", ".toml", ".yml", ".yaml", ".sh")
"""Text files by suffix; files named Makefile are scanned too."""
EXCLUDED = ("docs/results/measured.md", "docs/results/data/", "docs/decisions", ".venv/", "site/",
            "tests/test_no_history.py")
"""Path prefixes not scanned: the generated results (they record when and where on purpose), decision pages
that record measurements, build output, and this file (its planted examples)."""

_MONTH = (r"(?:Jan|January|Feb|February|Mar|March|Apr|April|May|Jun|June|Jul|July|Aug|August|Sep|Sept|September"
          r"|Oct|October|Nov|November|Dec|December)")

PATTERNS: dict[str, re.Pattern[str]] = {
    "date (day month)": re.compile(rf"\b[0-3]?\d(?:st|nd|rd|th)? {_MONTH}\b\.?"),
    "date (month day)": re.compile(rf"\b{_MONTH}\.? [0-3]?\d(?:st|nd|rd|th)?\b(?!\.\d)"),
    "date (month year)": re.compile(rf"\b{_MONTH} (?:19|20)\d\d\b"),
    "date (ISO)": re.compile(r"(?<!date\": \")(?<!date>=)(?<!date<=)(?<!date=)(?<![\w-])20[0-3]\d-[01]\d-[0-3]\d\b"),
    "machine model": re.compile(r"\b(?:Xeon|EPYC|Ryzen|Threadripper|Sapphire Rapids|Emerald Rapids|Granite Rapids"
                                r"|Ice Lake|Cascade Lake|Skylake|Zen ?[2-5])\b"),
    "test machine": re.compile(r"\bthis (?:\d+-core |shared |lent )?(?:box|CPU)\b|\b\d+-core (?:box|machine)\b"
                               r"|\bAVX-?512 (?:box|machine)\b|\bthe lent\b|\b(?:our|the lent) (?:H100|H200|A100)\b"
                               r"|\bthis project's\b"),
    "issue number": re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w&$/#])#\d{1,5}\b|\b(?:finding|item)s? \d+\b"),
    "commit hash": re.compile(r"\bcommit(?:ted)?:? (?:as |in |at )?[0-9a-f]{7,40}\b|\b[0-9a-f]{7,40} commit\b",
                              re.IGNORECASE),
    "narration": re.compile(r"\b(?:first|second|third|next|later|earlier|previous|last)[- ]waves?\b|\bwave \d\b"
                            r"|\b(?:a later|an earlier|the previous|the last|the fifth|this) session's notes\b"
                            r"|\b(?:a later|an earlier|the previous|the fifth|the fourth|the third) session\b"
                            r"|\breview (?:found|of (?:this|issue|the))\b|\bthe lead (?:runs|commits|said)\b"
                            r"|\btoday's\b|\bBefore[:,] |\bthe old (?:code|link)\b"),
    "STYLE.md": re.compile(r"\bSTYLE\.md\b"),
}
"""What the product's text must not say, by kind."""

EXTERNAL = re.compile(r"\b[\w.-]+/[\w.-]+ (?:issues?|PRs?|pull requests?) #?\d+(?:(?:, | and )#?\d+)*")
"""References to another project's tracker ("facebookresearch/faiss issues #584 and #1818"): allowed."""


def scanned_files(root: Path = ROOT) -> list[Path]:
    """The tracked (and new, not ignored) text files under SCANNED, minus EXCLUDED."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *SCANNED],
                         cwd=root, capture_output=True, check=True).stdout.decode()
    files = []
    for name in sorted(set(filter(None, out.split("\0")))):
        path = root / name
        if name.startswith(EXCLUDED) or not path.is_file():
            continue
        if name.endswith(SUFFIXES) or path.name == "Makefile":
            files.append(path)
    return files


def history_hits(paths: list[Path], root: Path = ROOT) -> list[str]:
    """"file:line: kind: text" for every line of `paths` that a pattern of PATTERNS matches."""
    hits = []
    for path in paths:
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:  # removed since it was listed
            continue
        for number, line in enumerate(lines, 1):
            text = EXTERNAL.sub("", line)
            for kind, pattern in PATTERNS.items():
                if pattern.search(text):
                    name = path.relative_to(root) if path.is_relative_to(root) else path
                    hits.append(f"{name}:{number}: {kind}: {line.strip()[:120]}")
    return hits


def test_the_tree_has_no_lab_notebook() -> None:
    files = scanned_files()
    assert len(files) > 100, f"only {len(files)} files scanned: is this a git checkout?"
    hits = history_hits(files)
    assert not hits, "history or lab notes in the product's text:\n" + "\n".join(hits)


PLANTED = {
    "date (day month)": "measured on 4 Dec with the panels kernel",
    "date (month day)": "chosen on Dec 3rd, see above",
    "date (month year)": "rewritten in March 2026",
    "date (ISO)": "figures of 2026-12-04",
    "machine model": "timed on an AMD EPYC with avx512_bf16",
    "test machine": "about 2x faster on this 2-core box",
    "issue number": "refused up front (issue 9, finding 6)",
    "commit hash": "the fix of commit 3f9a2c1d",
    "narration": "the first wave's name of the preset",
    "STYLE.md": "one factory string (STYLE.md 11)",
}
"""One line of each kind that the checker must flag."""
LEGITIMATE = [
    "kNN-LM (Khandelwal et al. 2020) interpolates with lambda 0.25",
    "Ends a session and frees its entries; a session dies when it expires.",
    "the engine issues a search per step for every row",
    '{"text": "Yes we can.", "year": 2010, "date": "2010-01-27", "title": "yes"}',
    "FAISS cannot remove from these (facebookresearch/faiss issues #584 and #1818)",
    "a batch of 8 rows, 4 Decoder layers, --shard A,B",
]
"""Lines the checker must pass."""


def test_the_checker_flags_each_planted_line_and_passes_legitimate_text(tmp_path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("".join(f"# {line}\n" for line in PLANTED.values()) + "".join(f"# {line}\n" for line in LEGITIMATE))
    hits = history_hits([planted], tmp_path)
    assert [(h.split(":")[1], h.split(": ")[1]) for h in hits] == [
        (str(i), kind) for i, kind in enumerate(PLANTED, 1)], "\n".join(hits)
