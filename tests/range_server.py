"""Servers on 127.0.0.1 that count the bytes they send, for the location tests.

* :class:`RangeServer`: a threaded ``http.server`` serving a directory with ``Range``
  requests (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``; 206 with ``Content-Range``, 416 past
  the end), keep-alive, and counting every body byte it sends. ``/redirect/<path>`` answers
  302 to ``<target>/<path>`` (as the Hugging Face hub redirects to its CDN); with
  ``ranges=False`` it ignores ``Range`` (200, the whole file); an absolute URI in the request
  line (a client using it as a proxy) is served as its path. It records each request's line
  and headers.
* :class:`CountingProxy`: a TCP forwarder in front of another server (moto's S3), counting
  the bytes the server sends back through it: what a client really received.

Usage::

    with RangeServer(root) as srv:
        url = srv.url("model.safetensors"); srv.reset(); ...; srv.sent
"""

from __future__ import annotations

import http.server
import os
import re
import socket
import socketserver
import threading
import urllib.parse
from typing import Any

__all__ = ["RangeServer", "CountingProxy"]

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve()

    def _send_empty(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _serve(self, head: bool = False) -> None:
        srv = self.server
        path = urllib.parse.urlsplit(self.path).path  # an absolute URI when used as a proxy
        with srv.lock:
            srv.requests.append((self.requestline, dict(self.headers)))
        if path.startswith("/redirect/"):
            target = srv.redirect_to or f"http://127.0.0.1:{srv.server_address[1]}"
            self._send_empty(302, {"Location": f"{target}/{path[len('/redirect/'):]}"})
            return
        file = os.path.join(srv.root, urllib.parse.unquote(path).lstrip("/"))
        if not os.path.isfile(file):
            self._send_empty(404, {})
            return
        with open(file, "rb") as f:
            data = f.read()
        size = len(data)
        rng = self.headers.get("Range")
        m = _RANGE.fullmatch(rng.strip()) if rng and srv.ranges else None
        if m is None:
            status, body, extra = 200, data, {}
        else:
            a, b = m.groups()
            if a == "":
                start, end = max(0, size - int(b)), size - 1
            else:
                start, end = int(a), min(int(b), size - 1) if b else size - 1
            if start >= size:
                self._send_empty(416, {"Content-Range": f"bytes */{size}"})
                return
            status, body, extra = 206, data[start : end + 1], {"Content-Range": f"bytes {start}-{end}/{size}"}
        self.send_response(status)
        for k, v in extra.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            with srv.lock:  # counted before it is sent: a client may act on it at once
                srv.sent += len(body)
            self.wfile.write(body)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: str, ranges: bool, redirect_to: str | None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.ranges, self.redirect_to = root, ranges, redirect_to
        self.lock = threading.Lock()
        self.sent = 0
        self.requests: list[tuple[str, dict[str, str]]] = []


class RangeServer:
    """Serve ``root`` over http on 127.0.0.1 (see the module docstring)."""

    def __init__(self, root: str, *, ranges: bool = True, redirect_to: str | None = None) -> None:
        self._srv = _Server(root, ranges, redirect_to)
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)

    def __enter__(self) -> RangeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._srv.shutdown()
        self._srv.server_close()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self._srv.server_address[1]}"

    def url(self, path: str = "") -> str:
        return f"{self.base}/{path}"

    @property
    def sent(self) -> int:
        """Body bytes sent since the last :meth:`reset`."""
        return self._srv.sent

    @property
    def requests(self) -> list[tuple[str, dict[str, str]]]:
        return self._srv.requests

    def reset(self) -> None:
        with self._srv.lock:
            self._srv.sent = 0
            self._srv.requests.clear()


class _Pump(socketserver.BaseRequestHandler):
    server: _ProxyServer

    def handle(self) -> None:
        up = socket.create_connection(self.server.target)
        client = self.request

        def pump(src: socket.socket, dst: socket.socket, count: bool) -> None:
            try:
                while True:
                    data = src.recv(1 << 16)
                    if not data:
                        break
                    if count:
                        with self.server.lock:
                            self.server.received += len(data)
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        back = threading.Thread(target=pump, args=(up, client, True), daemon=True)
        back.start()
        pump(client, up, False)
        back.join()
        up.close()


class _ProxyServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(("127.0.0.1", 0), _Pump)
        self.target = target
        self.lock = threading.Lock()
        self.received = 0


class CountingProxy:
    """A TCP forwarder to ``host:port`` counting the bytes sent back to clients (responses)."""

    def __init__(self, host: str, port: int) -> None:
        self._srv = _ProxyServer((host, port))
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._srv.server_address[1]}"

    @property
    def received(self) -> int:
        """Bytes (headers and bodies) the server sent back since the last :meth:`reset`."""
        return self._srv.received

    def reset(self) -> None:
        with self._srv.lock:
            self._srv.received = 0

    def close(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()
