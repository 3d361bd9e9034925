"""A webhook receiver for tests: a real HTTP server thread that records every request and answers as told."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    headers: dict[str, str]
    body: str
    answered: int


@dataclass
class Receiver:
    """Records requests; `status` is what it answers, `delay_s` how long it takes. stop()/start() keep the port.

    `trickle_s` makes it a slow loris: the answer's status line and headers go out one byte every `trickle_s`
    seconds and never end (each read of the sender gets a byte in time, so only a deadline over the whole
    attempt stops it)."""

    port: int = 0
    status: int = 200
    delay_s: float = 0.0
    trickle_s: float = 0.0
    requests: list[Received] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers.get("content-length", 0))).decode()
                time.sleep(receiver.delay_s)
                status = receiver.status
                receiver.requests.append(Received({k.lower(): v for k, v in self.headers.items()}, body, status))
                if receiver.trickle_s:
                    self.close_connection = True
                    for byte in b"HTTP/1.1 200 OK\r\nx-slow: " + b"a" * 1000:
                        try:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                        except OSError:
                            return  # the sender gave up
                        time.sleep(receiver.trickle_s)
                    return
                self.send_response(status)
                self.send_header("content-type", "text/plain")
                self.end_headers()
                self.wfile.write(b"ok" if status < 300 else b"unavailable, try later")

            def log_message(self, *args: object) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening: connections are refused until start() again."""
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()
        self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def accepted(self) -> list[Received]:
        return [r for r in self.requests if 200 <= r.answered < 300]


def refused_port() -> int:
    """A port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
