"""Code and docs point at docs/findings entries by anchor; every such pointer resolves to an entry's heading."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FINDINGS = ROOT / "docs" / "findings"
SOURCES = ("csrc", "tk_backend", "scripts", "tests", "README.md", "ab", "docs")
SUFFIXES = {".cu", ".cuh", ".h", ".cpp", ".py", ".sh", ".md"}
LINK = re.compile(r"docs/findings/([a-z_]+)\.md#([a-z0-9][a-z0-9-]*)")
MENTION = re.compile(r"docs/findings/([a-z_]+)\.md")
BARE = re.compile(r"[(,] ?#([a-z][a-z0-9]*(?:-[a-z0-9]+)+)")  # "(#half-last" or ", #prefill-three"


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(name: str) -> set[str]:
    path = FINDINGS / f"{name}.md"
    if not path.exists():
        return set()
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def _files():
    for entry in SOURCES:
        path = ROOT / entry
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def test_findings_exist():
    assert {p.stem for p in FINDINGS.glob("*.md")} >= {"prefill", "decode", "gemm", "ssd", "based", "serving"}


def test_every_findings_pointer_resolves():
    broken = []
    for path in _files():
        if path == Path(__file__):
            continue
        text = path.read_text(errors="replace")
        for name, anchor in LINK.findall(text):
            if anchor not in _anchors(name):
                broken.append(f"{path.relative_to(ROOT)}: docs/findings/{name}.md#{anchor}")
        mentioned = set(MENTION.findall(text)) | ({path.stem} if path.parent == FINDINGS else set())
        if not mentioned:
            continue
        known = set().union(*(_anchors(name) for name in mentioned))
        for anchor in BARE.findall(text):
            if anchor not in known:
                broken.append(f"{path.relative_to(ROOT)}: #{anchor} (in {', '.join(sorted(mentioned))})")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("heading,slug", [("half-last", "half-last"), ("Half last tiles", "half-last-tiles")])
def test_slug(heading, slug):
    assert _slug(heading) == slug
