"""A SuperLink paused while a ServerApp's pull is taking replies, made to happen on purpose.

The ServerApp reaches the SuperLink's runtime API through `RuntimeProxy`, which shows each
response before passing it on. When a pull-messages response carries replies (the
SuperLink has just handed them to that pull and deleted them), the SuperLink process is
stopped (SIGSTOP) before the response reaches the ServerApp, and resumed (SIGCONT) after
`LINK_HOLD_SECONDS`, longer than the ServerApp's pull wait. The pull that took the replies
then hangs fetching their objects, a second pull of the same ids starts meanwhile, and on
resume the SuperLink answers that one with "Message Unavailable" errors. Every pause puts
at least one finished reply in that race: what a slow SuperLink does by chance.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from fedstale.launcher.deploy import LocalDeployment
from fedstale.server_app.transport import PULL_WAIT_SECONDS
from tests.runtime_proxy import RuntimeProxy

LINK_HOLD_SECONDS = PULL_WAIT_SECONDS + 1.5  # past the pull wait: a second pull starts
PULL_MESSAGES = "/v1/runtime/pull-messages"


class SuperLinkPauser:
    """Up to `pauses` pauses, at least `gap` seconds apart, once `arm` is called."""

    def __init__(self, deployment: LocalDeployment, pauses: int, gap: float = 3.0) -> None:
        self.deployment = deployment
        self.pauses = pauses
        self.gap = gap
        self.done = 0
        self.armed = False
        self.paused = False
        self.next_at = 0.0
        self.lock = threading.Lock()
        self.proxy = RuntimeProxy(lambda: deployment.port, self.on_response)
        deployment.superexec_runtime = self.proxy.address

    def arm(self) -> None:
        self.armed = True

    def on_response(self, path: str, size: int) -> None:
        if not (self.armed and path == PULL_MESSAGES and size):
            return
        with self.lock:
            if self.paused or self.done >= self.pauses or time.monotonic() < self.next_at:
                return
            self.paused = True
        self.signal(signal.SIGSTOP)
        threading.Timer(LINK_HOLD_SECONDS, self.resume).start()

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        with self.lock:
            self.done += 1
            self.paused = False
            self.next_at = time.monotonic() + self.gap

    def signal(self, sig: int) -> None:
        assert self.deployment.superlink is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.deployment.superlink.pid, sig)

    def close(self) -> None:
        self.armed = False
        self.signal(signal.SIGCONT)
        self.proxy.close()
