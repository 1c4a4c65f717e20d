"""Fetching dataset files with checksums, from a list of mirrors."""

from __future__ import annotations

import hashlib
import logging
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("fedstale")


@dataclass(frozen=True)
class RemoteFile:
    name: str
    md5: str


class DownloadError(RuntimeError):
    """No mirror delivered a file with the expected checksum."""


def md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def has_valid_copy(path: Path, md5: str) -> bool:
    return path.is_file() and md5_of(path) == md5


def fetch(file: RemoteFile, mirrors: list[str], dest_dir: Path, timeout: float = 60.0) -> Path:
    """Download `file` into `dest_dir` from the first mirror that serves it intact.

    A file already there with the right checksum is kept. The download goes to a temporary
    file first so that an interrupted transfer never leaves a corrupt file behind.
    """
    target = dest_dir / file.name
    if has_valid_copy(target, file.md5):
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    for mirror in mirrors:
        url = mirror.rstrip("/") + "/" + file.name
        tmp_path = dest_dir / f".{file.name}.part"
        try:
            with (
                urllib.request.urlopen(url, timeout=timeout) as response,
                tmp_path.open("wb") as out,
            ):
                shutil.copyfileobj(response, out)
        except (urllib.error.URLError, OSError, ValueError) as err:
            tmp_path.unlink(missing_ok=True)
            failures.append(f"{url}: {err}")
            continue
        if md5_of(tmp_path) != file.md5:
            tmp_path.unlink(missing_ok=True)
            failures.append(f"{url}: checksum mismatch")
            continue
        tmp_path.replace(target)
        log.info("downloaded %s from %s", file.name, url)
        return target
    raise DownloadError(f"could not download {file.name}: " + "; ".join(failures))
