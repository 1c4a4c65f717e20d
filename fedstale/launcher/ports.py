"""Ports for the processes the launcher starts, without the race of picking one ahead.

Flower's CLIs take a port number (1-65535; 0 is refused), so the launcher has to choose it.
Choosing by binding port 0 and closing the socket leaves a gap in which any process on the
machine (an outgoing connection's ephemeral port, another launcher) can take the number,
and the Flower process then fails to bind it. Here a port is instead:

1. reserved: bound on 127.0.0.1 with SO_REUSEADDR and kept open, never listening. While it
   is held the kernel hands that port to no `bind(0)` and no outgoing connection, yet a
   server that sets SO_REUSEADDR can bind and listen on it: uvicorn does, and it serves
   Flower's SuperLink and SuperNode APIs.
2. counted as taken by the process only once the process itself (or a child of it) listens
   on it, read from /proc/net/tcp and the processes' file descriptors: a stranger listening
   there does not count.
3. released, once the process listens (or has failed).

A process that exits before it listens, or finds its port taken, is stopped and started again
on another port, `ATTEMPTS` times in all (a process that neither listens nor exits within
the timeout is not tried again); then one `LaunchError` line names the process, its log
file and the cause read from the log.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fedstale.common.config import ConfigError

ATTEMPTS = 4
LISTEN_SECONDS = 60.0
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's state column
_BIND_FAILURES = ("address already in use", "errno 98", "failed to bind", "eaddrinuse")


class LaunchError(ConfigError):
    """A process the launcher started did not come up: one line for the user, exit code 2."""


# Flower's default ports. A process of ours listening on one would be taken for the user's
# own Flower process there: `fedstale run` on the `local` connection uses a SuperLink already
# up on 39091 (a deployment's SuperLink got that port once, beside a test suite).
FLOWER_DEFAULT_PORTS = frozenset([*range(9091, 9100), *range(39091, 39100)])


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A loopback port nobody else is handed while the block runs (see the module doc), never
    one of Flower's defaults (those drawn are held until the block ends, so none comes back)."""
    with contextlib.ExitStack() as held:
        while True:
            holder = held.enter_context(socket.socket())
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", 0))
            port = int(holder.getsockname()[1])
            if port not in FLOWER_DEFAULT_PORTS:
                yield port
                return


def free_port() -> int:
    """A port free now, for what only connects to it or must not answer (a closed port in a
    test); a process that will listen on a port gets it through `start_listening`."""
    with reserved_port() as port:
        return port


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, pgrp, ... (`man 5
    proc`, field 3 on); None where no process has that pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below `root`, read from /proc."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (fields := proc_stat(entry.name)) is None:
            continue
        try:
            ppid = int(fields[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            commands[int(entry.name)] = command.decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append((pid, commands.get(pid, "")))
        stack.extend(children.get(pid, []))
    return found


def listening_inodes(port: int) -> set[int]:
    """Socket inodes listening on `port` (any address), from /proc/net/tcp and tcp6."""
    inodes: set[int] = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port and inode:
                    inodes.add(inode)
    return inodes


def socket_inodes(pids: list[int]) -> set[int]:
    """Inodes of the sockets these processes hold open."""
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = fd.readlink().as_posix()
                    if target.startswith("socket:["):
                        inodes.add(int(target[8:-1]))
    return inodes


def owner_listens(process: subprocess.Popen, port: int) -> bool | None:
    """True when `process` or a process below it listens on `port`; False when only
    something else does; None while nothing does."""
    listeners = listening_inodes(port)
    if not listeners:
        return None
    tree = [process.pid, *(pid for pid, _ in descendants(process.pid))]
    return bool(listeners & socket_inodes(tree))


def connects(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def log_tail(log: Path, start: int) -> str:
    """What the process wrote to its log since byte `start`."""
    try:
        with log.open("rb") as handle:
            handle.seek(start)
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def cause(text: str) -> str:
    """The line of a log that says why a process stopped: a bind failure, else the last
    error line, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if any(mark in line.lower() for mark in _BIND_FAILURES):
            return line[-300:]
    errors = [line for line in lines if "error" in line.lower() or "exception" in line.lower()]
    picked = errors[-1] if errors else (lines[-1] if lines else "nothing in its log")
    return picked[-300:]


@dataclass
class Attempt:
    """How one start went: `taken` when the port was lost to a bind race (try another)."""

    listening: bool
    taken: bool = False
    why: str = ""
    timed_out: bool = False


def await_listening(
    process: subprocess.Popen, port: int, log: Path, start: int, timeout: float
) -> Attempt:
    deadline = time.monotonic() + timeout
    on_proc = Path("/proc/net/tcp").exists()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            why = cause(log_tail(log, start))
            taken = any(mark in why.lower() for mark in _BIND_FAILURES)
            return Attempt(False, taken, f"exited with code {process.returncode}: {why}")
        owned = owner_listens(process, port) if on_proc else (True if connects(port) else None)
        if owned:
            return Attempt(True)
        if owned is False:
            return Attempt(False, True, f"another process listens on port {port}")
        time.sleep(0.1)
    why = f"not listening on 127.0.0.1:{port} after {timeout:g} s"
    return Attempt(False, False, why, timed_out=True)


def start_listening(
    launch: Callable[[int], subprocess.Popen],
    name: str,
    log: Path,
    *,
    port: int | None = None,
    attempts: int = ATTEMPTS,
    timeout: float = LISTEN_SECONDS,
    stop: Callable[[subprocess.Popen], None],
) -> tuple[subprocess.Popen, int]:
    """Start `launch(port)` until it listens on its port: a reserved one, or `port` when the
    user fixed it (then once). Returns the process and its port; a LaunchError line naming
    `name`, `log` and the cause when every attempt failed. Nothing is left running then."""
    tries = 1 if port is not None else attempts
    attempt, number = Attempt(False), 0
    for number in range(1, tries + 1):
        with contextlib.ExitStack() as stack:
            chosen = port if port is not None else stack.enter_context(reserved_port())
            start = log.stat().st_size if log.exists() else 0
            process = launch(chosen)
            attempt = await_listening(process, chosen, log, start, timeout)
        if attempt.listening:
            return process, chosen
        stop(process)
        if attempt.timed_out or number == tries:
            break
        again = f"port {chosen} was taken" if attempt.taken else "it exited at start"
        print(f"fedstale: {name}: {again}; starting it again on another port", file=sys.stderr)
    ports = f"{number} ports" if number > 1 else "port " + str(chosen)
    raise LaunchError(f"{name} did not start on {ports} ({attempt.why}); its log: {log}")
