"""An HTTP/1.1 relay between a SuperExec (and the ServerApps it starts) and the SuperLink's
runtime API, which tells a hook the path and body size of every response before passing it
on: the tests learn the moment a ServerApp's pull has taken replies from the SuperLink. It
changes nothing it relays."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import BinaryIO

Hook = Callable[[str, int], None]  # (request path, response body bytes)


def read_head(stream: BinaryIO) -> bytes | None:
    """A request or response head up to its blank line; None at the end of the stream."""
    lines = []
    while True:
        line = stream.readline()
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def header(head: bytes, name: str) -> str | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name.encode():
            return value.strip().decode()
    return None


def read_body(stream: BinaryIO, head: bytes) -> bytes:
    """The body as framed by Content-Length or chunked transfer (raw chunks kept)."""
    if (header(head, "transfer-encoding") or "").lower() == "chunked":
        raw = []
        while True:
            size_line = stream.readline()
            raw.append(size_line)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    trailer = stream.readline()
                    raw.append(trailer)
                    if trailer in (b"\r\n", b"\n", b""):
                        return b"".join(raw)
            raw.append(stream.read(size + 2))
    return stream.read(int(header(head, "content-length") or 0))


class RuntimeProxy:
    """Listens on 127.0.0.1 (`address`), one upstream connection per client connection."""

    def __init__(self, upstream_port: Callable[[], int], hook: Hook) -> None:
        self.upstream_port = upstream_port  # read per connection: known once upstream listens
        self.hook = hook
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.upstream_port())) as upstream:
            down, up = client.makefile("rb"), upstream.makefile("rb")
            with contextlib.suppress(OSError, ValueError):
                while True:
                    request = read_head(down)
                    if request is None:
                        return
                    upstream.sendall(request + read_body(down, request))
                    response = read_head(up)
                    if response is None:
                        return
                    body = read_body(up, response)
                    path = request.split(b" ")[1].decode(errors="replace")
                    self.hook(path, len(body))
                    client.sendall(response + body)

    def close(self) -> None:
        self.closed = True
        self.server.close()
