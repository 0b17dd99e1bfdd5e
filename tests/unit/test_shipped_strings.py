"""What is installed names no issue of this project's tracker: docstrings, comments, help text,
log and error messages say what they mean (an issue number means nothing to a user)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ISSUE = re.compile(r"\bissues?\s*#?\s*\d+|\bfindings?\s+\d+", re.IGNORECASE)


def _shipped_sources() -> list[Path]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = sorted(set(doc["tool"]["setuptools"]["package-dir"].values()))
    out = []
    for d in dirs:
        for path in (ROOT / d).rglob("*"):
            if path.suffix in (".py", ".pyi", ".proto") and "_pb2" not in path.name:
                out.append(path)
    return out


def test_no_shipped_source_mentions_an_issue_number() -> None:
    sources = _shipped_sources()
    assert len(sources) > 100  # the scan found the package
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sources
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if ISSUE.search(line)
    ]
    assert hits == []
