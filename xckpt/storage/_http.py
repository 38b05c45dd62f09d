"""`http(s)://` files read with Range requests (the standard library's `http.client`).

`HttpBlob` is the `Blob` of one URL. Opening it sends one
request, `Range: bytes=0-65535`: the answer's `Content-Range` gives the file's
size and its body (the first 64 KiB, where a safetensors header and a torch.save
zip's first records are) is kept, so a header read costs no second request. Every
later read is one `Range: bytes=a-b` request whose body lands straight in the
caller's buffer; nothing else is ever downloaded.

Decisions:

* Connections are kept alive, one per thread and host (readers read from a thread
  pool); a connection the server closed is reopened once.
* Redirects (301, 302, 303, 307, 308) are followed, up to 8, as the Hugging Face
  hub's `resolve/<revision>/` URLs redirect to a CDN; later reads go to the final
  URL, and back to the original once if that one has expired (401, 403, 404, 410).
  Headers given with the location (`Authorization`) go to the original host only.
* Proxies come from the environment (`http_proxy`, `https_proxy`, `no_proxy`,
  as `urllib.request.getproxies` reads them): https through a `CONNECT`
  tunnel, http by absolute URL.
* A server that ignores `Range` (answers 200 with the whole file) is refused for
  files over 64 KiB, naming the URL: xckpt never downloads what it was not asked for.
* 404 and 410 are [`CheckpointNotFoundError`][xckpt.errors.CheckpointNotFoundError]; other failures
  (refused connections, timeouts, 5xx, 401/403) are
  [`StorageError`][xckpt.errors.StorageError] naming the URL and the status.
"""

from __future__ import annotations

import errno
import http.client
import re
import threading
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from xckpt.errors import CheckpointNotFoundError, CorruptChunkError, StorageError, XckptError

from ._blob import Blob

__all__ = ["HttpBlob", "http_headers"]

#: Bytes asked for by the request that opens a file (its head is kept).
HEAD_BYTES = 64 << 10
_TIMEOUT = 60.0
_REDIRECTS = (301, 302, 303, 307, 308)
_MAX_REDIRECTS = 8
_GONE = (404, 410)
_EXPIRED = (401, 403, 404, 410)
_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_UNSATISFIED_RE = re.compile(r"bytes \*/(\d+)")


def http_headers(raw: Any, where: str) -> dict[str, str]:
    """Request headers given with an http location: a mapping, or tensorstore's list of
    `"Name: value"` strings (its `http` kvstore spec's `headers`)."""
    if raw is None:
        return {}
    if isinstance(raw, Mapping):
        items = list(raw.items())
    elif isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)):
        items = []
        for h in raw:
            if not isinstance(h, str) or ":" not in h:
                raise XckptError(f"{where}: header {h!r} is not 'Name: value'")
            k, v = h.split(":", 1)
            items.append((k, v))
    else:
        raise XckptError(f"{where}: headers must be a dict or a list of 'Name: value' strings")
    out = {}
    for k, v in items:
        if not isinstance(k, str) or not isinstance(v, str) or "\n" in k + v or "\r" in k + v:
            raise XckptError(f"{where}: header {k!r} is not a plain string pair")
        out[k.strip()] = v.strip()
    return out


class _Connections(threading.local):
    """This thread's open connections, by (scheme, host:port, proxy)."""

    def __init__(self) -> None:
        self.open: dict[tuple[str, str, str | None], http.client.HTTPConnection] = {}


_POOL = _Connections()


def _proxy_for(scheme: str, host: str) -> str | None:
    proxies = urllib.request.getproxies()
    proxy = proxies.get(scheme)
    if not proxy or urllib.request.proxy_bypass(host):
        return None
    return proxy


def _connect(scheme: str, netloc: str, proxy: str | None) -> http.client.HTTPConnection:
    """A new connection to `netloc`: direct, through a CONNECT tunnel (https via a proxy), or to
    the proxy itself (http via a proxy, which then gets absolute URLs)."""
    if proxy is not None:
        p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        via = p.netloc.rsplit("@", 1)[-1]
        if scheme == "http":
            return http.client.HTTPConnection(via, timeout=_TIMEOUT)
        conn = http.client.HTTPSConnection(via, timeout=_TIMEOUT)
        host, _, port = netloc.partition(":")
        conn.set_tunnel(host, int(port) if port else 443)
        return conn
    if scheme == "https":
        return http.client.HTTPSConnection(netloc, timeout=_TIMEOUT)
    return http.client.HTTPConnection(netloc, timeout=_TIMEOUT)


class HttpBlob(Blob):
    """One `http(s)://` file read by Range requests (see the module docstring).

    Raises (when opened):
        CheckpointNotFoundError: the server says 404 or 410.
        StorageError: the server cannot be reached, or answers with an error.
        XckptError: the server ignores Range requests and the file is over 64 KiB.
    """

    def __init__(self, url: str, where: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(url, where, None)
        self.url = url
        self._final = url
        self._headers = dict(headers or {})
        self._host = urllib.parse.urlsplit(url).netloc
        status, hdrs, body = self._request(f"bytes=0-{HEAD_BYTES - 1}", first=True)
        if status == 416:
            m = _UNSATISFIED_RE.fullmatch(hdrs.get("Content-Range", "").strip())
            if m is None or m.group(1) != "0":
                raise self._failed(status, "answered the first bytes with 416")
            self.size, self._head = 0, b""
        elif status == 206:
            _, _, total = self._content_range(hdrs, 0)
            if total is None:
                raise self._failed(status, "gave no file size in Content-Range")
            self.size, self._head = total, body
        else:  # 200: the server ignored Range and sent the whole file
            self.size, self._head = len(body), body
        self._count(len(body))

    # -- requests ---------------------------------------------------------------------------

    def _failed(self, status: int | None, what: str, cause: BaseException | None = None) -> XckptError:
        if status in _GONE:
            return CheckpointNotFoundError(f"{self.where}: {self.url!r} does not exist (HTTP {status})")
        code = errno.EACCES if status in (401, 403) else errno.EIO
        hint = (
            "check the URL and the access token (headers given with the location)"
            if status in (401, 403)
            else "check that the server is reachable and answers Range requests, then retry"
        )
        shown = f"HTTP {status}" if status is not None else type(cause).__name__ if cause else "no answer"
        return StorageError(code, f"{self.where}: reading {self.url!r} failed: the server {what} ({shown}); {hint}")

    def _send(self, url: str, rng: str) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection, tuple]:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise XckptError(f"{self.where}: {url!r} is not an http(s) URL")
        proxy = _proxy_for(parts.scheme, parts.hostname or "")
        key = (parts.scheme, parts.netloc, proxy)
        target = url if proxy is not None and parts.scheme == "http" else (
            urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        )
        headers = {"Range": rng, "User-Agent": "xckpt", "Accept-Encoding": "identity"}
        if parts.netloc == self._host:
            headers.update(self._headers)
        for attempt in (0, 1):
            conn = _POOL.open.get(key)
            fresh = conn is None
            if conn is None:
                conn = _POOL.open[key] = _connect(parts.scheme, parts.netloc, proxy)
            try:
                conn.request("GET", target, headers=headers)
                return conn.getresponse(), conn, key
            except (http.client.HTTPException, ConnectionError, BrokenPipeError) as e:
                conn.close()
                _POOL.open.pop(key, None)
                if fresh or attempt:  # a kept-alive connection may have been closed by the server: retry once
                    raise self._failed(None, "could not be reached", e) from e
            except OSError as e:
                conn.close()
                _POOL.open.pop(key, None)
                raise self._failed(None, "could not be reached", e) from e
        raise self._failed(None, "could not be reached")

    def _request(self, rng: str, *, first: bool = False) -> tuple[int, http.client.HTTPMessage, bytes]:
        """GET with `Range: rng`, following redirects; (status, headers, body). A 200 answer
        (Range ignored) is read only when the whole file is at most `HEAD_BYTES`."""
        status, hdrs, resp, _ = self._open(rng, first=first)
        try:
            body = resp.read(HEAD_BYTES + 1) if status == 200 else resp.read()
        except (http.client.HTTPException, OSError) as e:
            raise self._failed(status, "broke off its answer", e) from e
        finally:
            resp.close()
        if status == 200 and len(body) > HEAD_BYTES:
            raise XckptError(
                f"{self.where}: the server of {self.url!r} ignores Range requests (it answered 200 "
                f"with the whole file, over {HEAD_BYTES} bytes); xckpt reads byte ranges only. "
                "Download the file and open it locally"
            )
        return status, hdrs, body

    def _open(
        self, rng: str, *, first: bool = False
    ) -> tuple[int, http.client.HTTPMessage, http.client.HTTPResponse, str]:
        """Send the request (following redirects); the open response whose status is 200, 206 or 416."""
        for start in (self._final, self.url) if self._final != self.url else (self.url,):
            url = start
            for _ in range(_MAX_REDIRECTS + 1):
                resp, conn, key = self._send(url, rng)
                status = resp.status
                if status in _REDIRECTS:
                    loc = resp.getheader("Location")
                    resp.read()
                    resp.close()
                    if not loc:
                        raise self._failed(status, "redirected without a Location")
                    url = urllib.parse.urljoin(url, loc)
                    continue
                if status in (200, 206) or (status == 416 and first):
                    self._final = url
                    if resp.getheader("Connection", "").lower() == "close":
                        _POOL.open.pop(key, None)
                    return status, resp.headers, resp, url
                resp.read()
                resp.close()
                if status in _EXPIRED and start != self.url:
                    break  # the redirect target expired: from the original URL again
                raise self._failed(status, f"answered {status} {resp.reason}")
            else:
                raise self._failed(None, f"redirected more than {_MAX_REDIRECTS} times")
        raise self._failed(None, "gave no answer")

    def _content_range(self, hdrs: http.client.HTTPMessage, offset: int) -> tuple[int, int, int | None]:
        m = _RANGE_RE.fullmatch((hdrs.get("Content-Range") or "").strip())
        if m is None or int(m.group(1)) != offset:
            raise self._failed(206, f"answered bytes from {offset} with Content-Range {hdrs.get('Content-Range')!r}")
        total = None if m.group(3) == "*" else int(m.group(3))
        return int(m.group(1)), int(m.group(2)), total

    # -- the Blob protocol -------------------------------------------------------------------

    def _read(self, offset: int, n: int) -> bytes:
        head = self._head
        if offset + n <= len(head):
            return head[offset : offset + n]
        buf = bytearray(n)
        self._fill(offset, memoryview(buf))
        return bytes(buf)

    def pread(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > (self.size or 0):
            raise self.past_end(offset, n)
        if n == 0:
            return b""
        return self._read(offset, n)  # from the kept head (counted when opened), or one request

    def readinto(self, offset: int, buf: memoryview) -> None:
        n = buf.nbytes
        if offset < 0 or offset + n > (self.size or 0):
            raise self.past_end(offset, n)
        if n == 0:
            return
        view = buf.cast("B")
        if offset + n <= len(self._head):
            view[:] = self._head[offset : offset + n]
            return
        self._fill(offset, view)

    def _fill(self, offset: int, view: memoryview) -> None:
        """One Range request for `len(view)` bytes at `offset`, read straight into `view`."""
        n = view.nbytes
        status, hdrs, resp, _ = self._open(f"bytes={offset}-{offset + n - 1}")
        try:
            if status != 206:
                raise self._failed(status, f"answered a Range request for bytes [{offset}, {offset + n}) with {status}")
            start, end, _ = self._content_range(hdrs, offset)
            if end - start + 1 != n:
                raise CorruptChunkError(
                    f"{self.where}: {self.url!r} sent bytes [{start}, {end + 1}) for [{offset}, {offset + n}); "
                    "the file changed on the server or is shorter than it was: open it again"
                )
            got = 0
            while got < n:
                k = resp.readinto(view[got:])
                if not k:
                    raise CorruptChunkError(f"{self.where}: {self.url!r} ended its answer after {got} of {n} bytes")
                got += k
        except (http.client.HTTPException, OSError) as e:
            raise self._failed(status, "broke off its answer", e) from e
        finally:
            resp.close()
        self._count(n)

    def _read_tail(self, n: int) -> bytes:  # the size is always known
        size = self.size or 0
        k = min(n, size)
        return self.pread(size - k, k)

    def close(self) -> None:
        self._head = b""
