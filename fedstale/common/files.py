"""Writing files so that a crash mid-write never leaves a half-written one behind."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """`write` fills a temporary file beside `path`, which then replaces `path` at once."""
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        try:
            write(tmp)
        except BaseException:
            tmp.close()
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, path)


def resume_folder(resume_from: str) -> Path:
    """The run folder a `resume-from` value (a folder or its checkpoint file) names."""
    path = Path(resume_from).expanduser().resolve()
    return path if path.is_dir() or not path.suffix else path.parent
