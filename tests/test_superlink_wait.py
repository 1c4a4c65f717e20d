"""`fedstale run --superlink NAME` waits for a SuperLink that does not answer yet (a
container still starting) and gives one line when it never does."""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path

import pytest

from fedstale.common.config import ConfigError
from fedstale.launcher.local_link import await_remote
from fedstale.launcher.ports import free_port, reserved_port


def connection(home: Path, port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "box"\n\n'
        f'[superlink.box]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    monkeypatch.setenv("FLWR_HOME", str(home))


def test_nothing_listening_is_one_line_after_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    connection(tmp_path, port, monkeypatch)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"127.0.0.1:{port} .*did not answer within 2 s"):
        await_remote("box", timeout=2.0)
    assert time.monotonic() - started >= 2.0


def test_a_superlink_that_comes_up_late_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with reserved_port() as port:  # held until the server binds it (SO_REUSEADDR)
        connection(tmp_path, port, monkeypatch)
        handler = http.server.BaseHTTPRequestHandler  # any answer counts, a 501 too
        server = http.server.HTTPServer(("127.0.0.1", port), handler, bind_and_activate=False)

        def listen_and_serve() -> None:
            server.server_bind()
            server.server_activate()
            server.serve_forever()

        later = threading.Timer(2.0, listen_and_serve)
        later.start()
        try:
            await_remote("box", timeout=30.0)
        finally:
            server.shutdown()
            later.join()
            server.server_close()
    assert "waiting for the SuperLink at 127.0.0.1" in capsys.readouterr().err
