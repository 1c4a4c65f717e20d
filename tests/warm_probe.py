"""A stand-in for Flower's `run_clientapp` in tests/test_warm_exec.py: each task's process
writes what it started with to `<runtime_api_address>/<token>.json`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch


def run_clientapp(
    runtime_api_address: str,
    token: str,
    insecure: bool,
    certificates: bytes | None,
    parent_pid: int | None,
    runtime_dependency_install: bool,
) -> None:
    before = set(sys.modules)
    torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    seen = {
        "imported_by_an_optimizer": sorted(set(sys.modules) - before),
        "pid": os.getpid(),
        "parent": os.getppid(),
        "numpy": float(np.random.rand()),
        "torch": float(torch.rand(1)),
        "fedstale_loaded": any(m == "fedstale" or m.startswith("fedstale.") for m in sys.modules),
        "certificates": certificates.decode() if certificates else None,
        "insecure": insecure,
        "parent_pid": parent_pid,
    }
    Path(runtime_api_address, f"{token}.json").write_text(json.dumps(seen))
    if token == "fails":
        raise SystemExit(3)


def drive(folder: Path, tokens: list[str]) -> None:
    """In a process of its own (forking a pytest worker, which has threads, could deadlock):
    a Zygote with this module as its runtime, one task per token, each waited for in turn;
    then the zygote closed. Prints the zygote's pid."""
    import time

    from fedstale.launcher import warm_exec

    warm_exec.RUNTIME = "tests.warm_probe"
    zygote = warm_exec.Zygote(warm_exec.PRELOAD)
    try:
        for token in tokens:
            request = {
                "runtime_api_address": str(folder),
                "token": token,
                "insecure": True,
                "certificates": None,
                "parent_pid": os.getpid(),
                "runtime_dependency_install": False,
                "quiet": token == "quiet",
            }
            assert zygote.launch(request)
            deadline = time.monotonic() + 60
            while not (folder / f"{token}.json").exists():
                assert time.monotonic() < deadline, f"task {token} never ran"
                time.sleep(0.05)
    finally:
        zygote.close()
    late = zygote.launch({"token": "late"})
    print(json.dumps({"zygote": zygote.pid, "driver": os.getpid(), "late": late}))


if __name__ == "__main__":
    drive(Path(sys.argv[1]), sys.argv[2:])
