"""Where a run came from: the versions it ran on and the code's git commit, for config.json.

In Flower simulation the ServerApp runs from the app bundle's copy of the code, which has
no .git; the commit is then read from the checkout the package was installed from
(an editable install records it), else it is null.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

PACKAGES = ("fedstale", "flwr", "torch", "numpy")


def version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_checkout() -> Path | None:
    """The git checkout this code is, or was installed (editable) from."""
    here = Path(__file__).resolve().parents[2]
    if (here / ".git").exists():
        return here
    try:
        direct = importlib.metadata.distribution("fedstale").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    url = json.loads(direct or "{}").get("url", "")
    if url.startswith("file://") and (Path(url[7:]) / ".git").exists():
        return Path(url[7:])
    return None


def git(folder: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def provenance() -> dict[str, Any]:
    """Versions of Python and the packages, the git commit and whether the tree had
    uncommitted changes to tracked files (null where the code is not a git checkout)."""
    found: dict[str, Any] = {"python": platform.python_version()}
    found.update({name: version_of(name) for name in PACKAGES})
    checkout = source_checkout()
    commit = git(checkout, "rev-parse", "HEAD") if checkout else None
    status = git(checkout, "status", "--porcelain", "--untracked-files=no") if commit else None
    found["git-commit"] = commit
    found["git-dirty"] = None if status is None else bool(status)
    found["source"] = str(checkout) if checkout else None
    return found
