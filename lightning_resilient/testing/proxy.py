"""A loopback HTTP proxy in front of an object store: faults, latency and bandwidth, for real.

It sits between a real client (s3fs/botocore, gcsfs) and a real server (moto, fake-gcs-server), so clients'
own behaviour and ours are exercised end to end:

- ``fail_rate``: that share of requests fails, half with ``503 SlowDown``, half with a reset connection
  (decided by a seeded RNG, so a run is reproducible);
- ``latency``: seconds added before each request is forwarded (a store's time to first byte);
- ``bandwidth``: bytes per second per connection, applied to request and response bodies (a cloud store
  serves one connection far slower than its aggregate; parallel connections add up);
- ``requests``: every forwarded request as ``(method, path)``, for tests that count what a client did;
- ``fail_if``: a predicate on ``(method, path)``; the requests it picks are answered ``503 SlowDown`` every time (one
  part of a multipart upload, say, or its abort);
- :meth:`pause` / :meth:`resume`: hold every request at the door until resumed (a store that hangs);
- :meth:`go_down` / :meth:`come_back`: refuse every connection (the port closed: clients see "connection
  refused", botocore's ``EndpointConnectionError``), then serve again on the same port (a store outage);
- ``drop_conditions``: strip the conditions of conditional writes from requests, as a store (or a proxy in front
  of it) that accepts conditional writes without enforcing them would: the ``If-Match`` / ``If-None-Match`` headers
  (S3) and the ``ifGenerationMatch`` / ``ifMetagenerationMatch`` query parameters (GCS).

Run it as a process (``python -m lightning_resilient.testing UPSTREAM --latency 0.03
--bandwidth 40e6``): it prints its URL on the first line, then serves until killed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import random
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

__all__ = ["StoreProxy", "main"]

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
_BLOCK = 256 * 1024


class StoreProxy:
    """See the module docstring. Use as a context manager, or :meth:`start` / :meth:`stop`."""

    def __init__(self, upstream: str, *, fail_rate: float = 0.0, latency: float = 0.0,
                 bandwidth: float | None = None, seed: int = 0, drop_conditions: bool = False,
                 fail_if: Callable[[str, str], bool] | None = None) -> None:
        if not 0.0 <= fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be within [0, 1], got {fail_rate!r}")
        if latency < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {latency!r}")
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s or None, got {bandwidth!r}")
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.fail_rate = fail_rate
        self.latency = latency
        self.bandwidth = bandwidth
        self.drop_conditions = drop_conditions
        self.fail_if = fail_if
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"forwarded": 0, "503": 0, "reset": 0}
        self.requests: list[tuple[str, str]] = []
        self._open = threading.Event()
        self._open.set()
        self._connections: set[socket.socket] = set()  # the clients' open connections (kept alive between requests)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with proxy.lock:
                    proxy._connections.add(self.connection)

            def finish(self) -> None:
                with proxy.lock:
                    proxy._connections.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def _read(self, n: int) -> bytes:
                out = bytearray()
                while len(out) < n:
                    piece = self.rfile.read(min(_BLOCK, n - len(out)))
                    if not piece:
                        break
                    out += piece
                    proxy._throttle(len(piece))
                return bytes(out)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return bytes(out)
                        out += self._read(size)
                        self.rfile.readline()
                return self._read(int(self.headers.get("Content-Length", 0) or 0))

            def _handle(self) -> None:
                body = self._body()
                proxy._open.wait()
                with proxy.lock:
                    roll = proxy.rng.random()
                picked = proxy.fail_if is not None and proxy.fail_if(self.command, self.path)
                if picked or roll < proxy.fail_rate / 2:
                    proxy._count("503")
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                if roll < proxy.fail_rate:
                    proxy._count("reset")
                    # RST instead of FIN: the client sees "connection reset by peer", as on a dropped link.
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                proxy._count("forwarded")
                with proxy.lock:
                    proxy.requests.append((self.command, self.path))
                if proxy.latency:
                    time.sleep(proxy.latency)
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                dropped = ("transfer-encoding",) + (("if-match", "if-none-match") if proxy.drop_conditions else ())
                headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
                headers["Content-Length"] = str(len(body))
                path = _without_conditions(self.path) if proxy.drop_conditions else self.path
                conn.request(self.command, path, body=body, headers=headers)
                resp = conn.getresponse()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD answer carries the object's length, not the (empty) body's.
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else None
                if length is not None:
                    self.send_header("Content-Length", length)
                    self.end_headers()
                    conn.close()
                    return
                data = resp.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                view = memoryview(data)
                for start in range(0, len(view), _BLOCK):
                    piece = view[start : start + _BLOCK]
                    self.wfile.write(piece)
                    proxy._throttle(len(piece))
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._handler = Handler
        self.server = self._serve(0)
        self.thread = threading.Thread(target=self.server.serve_forever, name="store-proxy", daemon=True)
        self.down = False

    def _serve(self, port: int) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", port), self._handler)
        server.daemon_threads = True
        return server

    def _throttle(self, nbytes: int) -> None:
        # Per connection: each handler thread sleeps for its own bytes, so N connections get N times the rate.
        if self.bandwidth:
            time.sleep(nbytes / self.bandwidth)

    def pause(self) -> None:
        """Hold every request from now on until :meth:`resume`."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def go_down(self) -> None:
        """Close the port and every client's open connection: every request fails (new connections are refused)
        until :meth:`come_back`."""
        if self.down:
            return
        self._port = self.server.server_address[1]
        self.server.shutdown()
        self.server.server_close()
        # Clients keep connections alive between requests: a store that is down answers none of them either.
        with self.lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self.down = True

    def come_back(self) -> None:
        """Serve again, on the same port (clients keep the URL they had)."""
        if not self.down:
            return
        self.server = self._serve(self._port)
        self.thread = threading.Thread(target=self.server.serve_forever, name="store-proxy", daemon=True)
        self.thread.start()
        self.down = False

    def _count(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] += 1

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        name = host.decode() if isinstance(host, (bytes, bytearray)) else host
        return f"http://{name}:{port}"

    def start(self) -> StoreProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._open.set()
        if self.down:
            return
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> StoreProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# GCS's preconditions are query parameters, not headers.
_CONDITION_PARAMS = ("ifgenerationmatch", "ifmetagenerationmatch")


def _without_conditions(path: str) -> str:
    """``path`` without GCS's precondition query parameters (the other parameters untouched, in order)."""
    base, mark, query = path.partition("?")
    if not mark:
        return path
    kept = [p for p in query.split("&") if p.split("=", 1)[0].lower() not in _CONDITION_PARAMS]
    return f"{base}?{'&'.join(kept)}" if kept else base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_resilient.testing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("upstream", help="the store's URL, e.g. http://127.0.0.1:5000")
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added per request")
    parser.add_argument("--bandwidth", type=float, default=None, help="bytes/s per connection")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drop-conditions", action="store_true",
                        help="strip If-Match/If-None-Match (S3) and ifGenerationMatch (GCS): a store that ignores"
                             " conditional writes")
    args = parser.parse_args(argv)
    proxy = StoreProxy(args.upstream, fail_rate=args.fail_rate, latency=args.latency, bandwidth=args.bandwidth,
                       seed=args.seed, drop_conditions=args.drop_conditions)
    print(proxy.url, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        proxy.server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
