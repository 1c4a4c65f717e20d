from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.flower_procs import SimulationSuperLink


@pytest.fixture(scope="session")
def superlink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulationSuperLink]:
    """One simulation SuperLink for the session, on a free port, stopped by PID."""
    link = SimulationSuperLink(Path(tmp_path_factory.mktemp("flwr-home"))).start()
    yield link
    link.stop()
