"""ab/ holds only live experiments: every patch there still applies and has a findings entry (see ab/README.md).

A patch that no longer applies is an experiment that rotted when the code under it moved: regenerate it
(`git diff main...BRANCH > ab/NAME.patch`) or, if it is no longer wanted, record its verdict in docs/findings and
delete it.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATCHES = sorted((REPO / "ab").glob("*.patch"))


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


if shutil.which("git") is None:
    pytest.skip("git is not installed", allow_module_level=True)
if _git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
    pytest.skip(f"{REPO} is not a git work tree", allow_module_level=True)


def test_every_patch_applies_to_the_tree():
    failed = {}
    for patch in PATCHES:
        check = _git("apply", "--check", str(patch))
        if check.returncode != 0:
            failed[patch.name] = check.stderr.strip().splitlines()[:3]
    assert not failed, f"ab/ patches that no longer apply (regenerate or retire them): {failed}"


def test_every_patch_has_a_findings_entry():
    findings = "\n".join(p.read_text() for p in (REPO / "docs" / "findings").glob("*.md"))
    # the whole name, so that half-last.patch is not covered by an entry for half-last-d128
    missing = [p.name for p in PATCHES if not re.search(rf"(?<![\w-]){re.escape(p.stem)}(?![\w-])", findings)]
    assert not missing, f"ab/ patches named in no docs/findings/*.md entry: {missing}"
