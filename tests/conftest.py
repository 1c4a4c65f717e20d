from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.flower_procs import SimulationSuperLink

# Client shares are cached on disk (common/federation.py); keep the tests' out of ~/.cache.
os.environ.setdefault("FEDSTALE_CACHE_DIR", tempfile.mkdtemp(prefix="fedstale-cache-"))


@pytest.fixture(scope="session")
def superlink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulationSuperLink]:
    """One simulation SuperLink for the session, on a free port, stopped by PID."""
    link = SimulationSuperLink(Path(tmp_path_factory.mktemp("flwr-home"))).start()
    yield link
    link.stop()
