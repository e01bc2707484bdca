"""Mooncake's HTTP metadata server, on loopback, standard library only (run as a script).

The transfer engine keeps its segment descriptors here (``GET/PUT/DELETE /metadata?key=K``,
the protocol of ``mooncake.http_metadata_server``). The master's built-in one
(``--enable_http_metadata_server``) binds every interface whatever ``--http_metadata_server_host``
says (measured with mooncake-transfer-engine-non-cuda 0.3.13.post1), so ``MooncakeMaster``
runs this one instead, bound to the host it is given.

Stops by itself: it exits when its parent process goes away (polled every 0.2 s) and after
``--max-lifetime-s`` seconds if given. Usage::

    python _metadata_server.py --host 127.0.0.1 --port 12345 [--max-lifetime-s 3600]

It prints ``READY <port>`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_store: dict[str, bytes] = {}
_lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else each reply's body waits ~40 ms for a delayed ACK

    def log_message(self, fmt: str, *args: object) -> None:  # quiet
        pass

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _key(self) -> str | None:
        url = urlsplit(self.path)
        if url.path != "/metadata":
            self._reply(404, b"not found")
            return None
        key = parse_qs(url.query).get("key", [""])[0].strip()
        if not key:
            self._reply(400, b"metadata key is required")
            return None
        return key

    def do_GET(self) -> None:
        key = self._key()
        if key is None:
            return
        with _lock:
            value = _store.get(key)
        if value is None:
            self._reply(404, b"metadata not found")
        else:
            self._reply(200, value)

    def do_PUT(self) -> None:
        key = self._key()
        n = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(n) if n else b""
        if key is None:
            return
        with _lock:
            if "rpc_meta" in key and key in _store:
                self._reply(400, b"Duplicate rpc_meta key not allowed")
                return
            _store[key] = data
        self._reply(200, b"metadata updated")

    do_POST = do_PUT

    def do_DELETE(self) -> None:
        key = self._key()
        if key is None:
            return
        with _lock:
            found = _store.pop(key, None) is not None
        self._reply(200 if found else 404, b"metadata deleted" if found else b"metadata not found")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-lifetime-s", type=float, default=0.0, help="exit after this long (0: no limit)")
    args = ap.parse_args(argv)
    parent = os.getppid()
    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer.daemon_threads = True
    srv = ThreadingHTTPServer((args.host, args.port), _Handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    print(f"READY {srv.server_address[1]}", flush=True)
    deadline = time.monotonic() + args.max_lifetime_s if args.max_lifetime_s > 0 else None
    while os.getppid() == parent and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.2)
    srv.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
