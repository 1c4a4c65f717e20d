"""A SuperExec for a SuperNode's ClientApp tasks that forks each task from a warm process.

Flower's own SuperExec (`flower-superexec`, started by every `flower-supernode` unless it runs
with `--isolation process`) starts a fresh `flwr-clientapp` interpreter for every message;
with torch that is about 2.7 s of CPU before the ClientApp sees its message (importing
Flower, torch and numpy), on every message of every node. This one runs Flower's own loop
(`run_superexec`: it claims the node's tasks over the Runtime API) with an executor that
forks a task's process from a process that has already imported them, once:

    flower-supernode --isolation process --port 9094 ... &
    python -m fedstale.launcher.warm_exec --runtime-api-address 127.0.0.1:9094 --insecure

What stays as in Flower: every task still runs in a process of its own, which pulls its
message, installs and loads the app's FAB (the app's own modules are imported fresh in each
task: only the libraries named by `--preload` are shared), replies and exits; a task of
another type, or one that installs the app's dependencies at run time, goes to Flower's own
subprocess executor. Each task's process reseeds numpy's and torch's global generators, as a
fresh interpreter would have. `fedstale deploy` starts one beside each SuperNode
(`--clientapp-exec fork`, the default; `flower` starts Flower's own).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import traceback
from typing import IO, Any

from fedstale.launcher import flower_internals as internal

# Imported once in the warm process, when installed. torch._dynamo: the first torch.optim
# optimizer a process builds imports it, 1.4 s of CPU that every task would otherwise pay.
PRELOAD = ("numpy", "torch", "torch._dynamo")
RUNTIME = internal.RUN_CLIENTAPP.module  # imported once, with the preloads


class Zygote:
    """A process forked before anything else starts: it imports the preloads, then forks a
    task's process for each request written to its pipe (one JSON line each)."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write_end)
            serve(read_end, preload)
        os.close(read_end)
        self.pid = pid
        self.requests: IO[str] = os.fdopen(write_end, "w", buffering=1)

    def launch(self, request: dict[str, Any]) -> bool:
        """Whether the request reached the warm process."""
        try:
            self.requests.write(json.dumps(request) + "\n")
            self.requests.flush()
        except (OSError, ValueError):  # the process is gone, or this end was closed
            return False
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.requests.close()
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(self.pid, signal.SIGTERM)
            os.waitpid(self.pid, 0)


def serve(requests_fd: int, preload: tuple[str, ...]) -> None:
    """The warm process: import, then fork a task per request until the pipe closes (or,
    on Linux, until the SuperExec that forked it is gone, however it ended)."""
    die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # finished tasks are reaped by the kernel
    for name in (RUNTIME, *preload):
        try:
            importlib.import_module(name)
        except ImportError as err:
            print(f"fedstale warm exec: not preloading {name}: {err}", file=sys.stderr)
    with os.fdopen(requests_fd) as requests:
        for line in requests:
            if os.fork() == 0:
                requests.close()
                run_task(json.loads(line))
    os._exit(0)


def die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent exits (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent was already gone before prctl took effect
        os._exit(0)


def run_task(request: dict[str, Any]) -> None:
    """A task's process: what `flwr-clientapp --token T` runs, from the warm imports."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the ClientApp may wait for its own
        forget_app_modules()
        reseed()
        if request.pop("quiet"):
            quiet()
        run_clientapp = importlib.import_module(RUNTIME).run_clientapp
        certificates = request.pop("certificates")
        run_clientapp(certificates=certificates.encode() if certificates else None, **request)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    except BaseException:  # a task's failure is its own, said in its log
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def forget_app_modules() -> None:
    """Drop fedstale's modules (this one's package) so that the app's FAB, which may be
    another version of fedstale, is imported from the FAB as in a fresh interpreter."""
    for name in [m for m in sys.modules if m == "fedstale" or m.startswith("fedstale.")]:
        del sys.modules[name]


def reseed() -> None:
    """Fresh entropy for the global generators a forked process would otherwise share with
    every other task (Python's `random` reseeds itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def quiet() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)


class ForkExecutor:
    """Flower's SuperExec executor protocol (flwr.supercore.superexec.executor.types):
    ClientApp tasks forked from the zygote; anything else by Flower's subprocess executor."""

    def __init__(self, zygote: Zygote) -> None:
        self.zygote = zygote
        self.flower = internal.SUBPROCESS_EXECUTOR.load()()
        self.said_gone = False

    def get_eligible_capacity(self, supported: set[Any], **tls: Any) -> tuple[set[Any], set[str]]:
        return self.flower.get_eligible_capacity(supported, **tls)

    def wait_for_capacity(self, *args: Any, **kwargs: Any) -> None:
        """Forks have no capacity gate, as Flower's subprocesses have none."""

    def launch(self, spec: Any) -> Any:
        task_type, launch_result = internal.TASK_TYPE.load(), internal.LAUNCH_RESULT.load()
        if spec.task_type != task_type.CLIENT_APP or spec.runtime_dependency_install:
            return self.flower.launch(spec)
        if self.zygote.launch(request_of(spec)):
            return launch_result.accepted()
        if not self.said_gone:
            print("fedstale warm exec: the warm process is gone; tasks start as Flower's own")
            self.said_gone = True
        return self.flower.launch(spec)

    def close(self) -> None:
        self.zygote.close()

    def reconcile(self) -> None:
        """No pool to maintain: the kernel reaps finished tasks."""


def request_of(spec: Any) -> dict[str, Any]:
    """What the task's process passes to Flower's run_clientapp (and whether to be quiet)."""
    certificates = None
    if not spec.insecure and spec.root_certificates_path is not None:
        with open(spec.root_certificates_path, encoding="utf-8") as handle:
            certificates = handle.read()
    return {
        "runtime_api_address": spec.runtime_api_address,
        "token": spec.token,
        "insecure": spec.insecure,
        "certificates": certificates,
        "parent_pid": spec.parent_pid,
        "runtime_dependency_install": False,
        "quiet": spec.suppress_output,
    }


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(
        prog="python -m fedstale.launcher.warm_exec",
        description="A SuperExec for a SuperNode started with --isolation process: each "
        "ClientApp task forked from a process that has imported Flower and --preload once.",
    )
    parse.add_argument("--runtime-api-address", required=True, help="the SuperNode's")
    parse.add_argument("--insecure", action="store_true", help="no TLS to the Runtime API")
    parse.add_argument("--root-certificates", help="CA of the Runtime API's TLS certificate")
    parse.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    parse.add_argument(
        "--preload",
        default=",".join(PRELOAD),
        help="comma-separated modules imported once, when installed (default: %(default)s)",
    )
    return parse


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    gone = internal.missing(internal.WARM_EXEC)
    if gone:  # before the zygote forks: one line and exit 2, as the launcher's commands
        print(f"fedstale warm exec: {gone[0]}", file=sys.stderr)
        sys.exit(2)
    zygote = Zygote(tuple(name for name in args.preload.split(",") if name))
    flower = internal.superexec_module()
    # Flower's loop, unchanged, with this executor in place of its subprocess one.
    flower.get_executor = lambda *_, **__: ForkExecutor(zygote)  # type: ignore[assignment]
    try:
        flower.run_superexec(
            runtime_api_address=args.runtime_api_address,
            insecure=args.insecure,
            root_certificates_path=args.root_certificates,
            parent_pid=args.parent_pid,
            runtime_dependency_install=False,
        )
    finally:
        zygote.close()


if __name__ == "__main__":
    main()
