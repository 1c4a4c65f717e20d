from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.flower_procs import SimulationSuperLink

# Client shares are cached on disk (fedstale/common/federation.py); keep the tests' out of ~/.cache,
# in a directory of their own that the session removes when it ends (~200 MB per session).
_OWN_CACHE = (
    None if "FEDSTALE_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="fedstale-cache-")
)
if _OWN_CACHE is not None:
    os.environ["FEDSTALE_CACHE_DIR"] = _OWN_CACHE


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def superlink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulationSuperLink]:
    """One simulation SuperLink for the session, on a free port, stopped by PID."""
    link = SimulationSuperLink(Path(tmp_path_factory.mktemp("flwr-home"))).start()
    yield link
    link.stop()
