"""A simulation SuperLink of the tests' own, on free loopback ports, stopped by PID."""

from __future__ import annotations

import subprocess
from pathlib import Path

from server_app.cli import flower_env, tool
from server_app.deploy import free_port, stop, wait_for_port

CONNECTION = "fedstale-test"


class SimulationSuperLink:
    """`flower-superlink --simulation` plus a FLWR_HOME whose config names it. Flower 1.41
    serves the Runtime, Control and Fleet APIs on one HTTP port."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return flower_env(FLWR_HOME=str(self.home))

    def start(self) -> SimulationSuperLink:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        command = [
            tool("flower-superlink"),
            "--insecure",
            "--simulation",
            "--isolation",
            "subprocess",
            "--disable-runtime-dependency-installation",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        log = (self.home / "superlink.log").open("w")
        self.process = subprocess.Popen(
            command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_for_port(self.port, 60.0, self.process, "flower-superlink")
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)

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
