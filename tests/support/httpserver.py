"""A real HTTP server on 127.0.0.1 for update payloads, with `Range: bytes=N-` support, and
three misbehaviours the updater must survive: cutting the connection after some bytes (resume),
sending more bytes than the file has (an "endless data" attack), and serving a file shorter
than the manifest declares (every response whole and well-formed, just short)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Served:
    path: Path
    cut_after: int = 0  # >0: the first response stops after this many bytes
    extra: int = 0  # >0: append this many junk bytes (and announce no length)
    short: int = 0  # >0: the last this many bytes of the file are never served
    requests: list[str] = field(default_factory=list)  # the Range headers seen ("" = none)


class PayloadServer:
    def __init__(self, served: Served) -> None:
        self.served = served
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                s = outer.served
                data = s.path.read_bytes()
                data = data[: len(data) - s.short] if s.short else data
                rng = self.headers.get("Range", "")
                s.requests.append(rng)
                start = int(rng.removeprefix("bytes=").rstrip("-")) if rng else 0
                body = data[start:] + b"\xee" * s.extra
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                if not s.extra:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if s.cut_after and len(s.requests) == 1:
                    self.wfile.write(body[: s.cut_after])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/payload.bin"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
