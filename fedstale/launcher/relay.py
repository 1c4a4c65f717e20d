"""Flower's own output passed on to the user as it comes, less the lines about a setting
fedstale chose for them (a warning about a default the run does not use misleads)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

# Flower 1.32+ says these in every simulation, whatever num-supernodes it was given: a
# warning about its default and how to resize with flwr. fedstale always gives the size (the
# run's num-clients: change that), and Flower's line naming the size stays.
SETTINGS_FEDSTALE_CHOSE = (
    "Since flwr 1.32, default simulated SuperNodes changed from 10 to 2",
    "To change federation size, use the following command",
    "flwr federation simulation-config",
)


class Relayed:
    """A process whose stdout and stderr reach ours line by line, filtered."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str]) -> None:
        self.process = subprocess.Popen(
            list(command),
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
        )
        pairs = ((self.process.stdout, sys.stdout), (self.process.stderr, sys.stderr))
        self.copiers = [
            threading.Thread(target=copy_lines, args=pair, daemon=True) for pair in pairs
        ]
        for copier in self.copiers:
            copier.start()

    def finish(self, seconds: float = 10.0) -> None:
        """Wait for the last lines after the process ended."""
        for copier in self.copiers:
            copier.join(seconds)


def copy_lines(source: IO[str] | None, target: IO[str]) -> None:
    if source is None:
        return
    for line in source:
        if not any(text in line for text in SETTINGS_FEDSTALE_CHOSE):
            target.write(line)
            target.flush()
