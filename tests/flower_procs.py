"""A simulation SuperLink of the tests' own, on a free loopback port, stopped by PID: the
launcher's LocalDeployment without SuperNodes (the simulation runs the ClientApps)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from fedstale.launcher.deploy import CONNECTION, LocalDeployment
from fedstale.launcher.launch import tool

__all__ = ["CONNECTION", "SimulationSuperLink"]


@dataclass
class _Deployment(LocalDeployment):
    """A LocalDeployment whose processes get `extra` in their environment too."""

    extra: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, **self.extra}


class SimulationSuperLink:
    """`flower-superlink --simulation` plus a FLWR_HOME whose config names it. Flower 1.41
    serves the Runtime, Control and Fleet APIs on one HTTP port. `environment` goes to the
    SuperLink (its SuperExec and simulation inherit it) and to `fedstale run`."""

    def __init__(self, home: Path, **environment: str) -> None:
        self.link = _Deployment(home, 0, simulation=True, extra=environment)

    @property
    def env(self) -> dict[str, str]:
        return self.link.env

    def start(self) -> SimulationSuperLink:
        self.link.start()
        return self

    def stop(self) -> None:
        self.link.stop()

    def run_app(
        self, app: Path, runs: Path, name: str, config: str, timeout: float
    ) -> tuple[subprocess.CompletedProcess, Path]:
        """`fedstale run` on this SuperLink; returns the process result and the run folder."""
        command = [
            tool("fedstale"),
            "run",
            "--app",
            str(app),
            "--superlink",
            CONNECTION,
            "--run-config",
            f"{config} run-name={name} runs-dir={runs}",
        ]
        result = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        return result, runs / name
