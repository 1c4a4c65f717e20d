"""The README is a front door and the docs stand on their own: every link made in them
resolves inside the repository, and no file points outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
OUTSIDE = re.compile(r"\.\./shared|ALGORITHMS\.md|\bpapers/")


def test_the_readme_is_short_and_has_a_table_of_contents() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 25 * 1024
    contents = text.split("\n## ", 1)[0]
    sections = re.findall(r"^## (.+)$", text, re.M)
    for section in sections:
        anchor = "#" + re.sub(r"[^a-z0-9 -]", "", section.lower()).replace(" ", "-")
        assert anchor in contents, f"the contents line lacks {section}"


def test_every_relative_link_resolves() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken


def test_no_tracked_file_refers_outside_the_repository() -> None:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    this = Path(__file__).relative_to(ROOT).as_posix()
    hits = []
    for name in files:
        path = ROOT / name
        if name == this or path.suffix not in {".py", ".md", ".toml", ".yml", ".txt", ""}:
            continue
        if path.is_file() and OUTSIDE.search(path.read_text(errors="replace")):
            hits.append(name)
    assert not hits
