#!/usr/bin/env python3
"""A small orders API with no idempotency of its own: python3's standard library
only (http.server, sqlite3). The proxy tests put it behind `idem proxy`.

  python3 orders.py --db orders.db [--port 0] [--delay-ms 0]

It prints "listening on http://127.0.0.1:PORT" once it accepts connections.

  POST /orders   {"cart_id": "c_1", "total_cents": 1900, "sleep_ms": 0}
                 -> 201 {"id": "ord_N", ...}, Location: /orders/ord_N.
                 The order is committed first; then the answer waits
                 --delay-ms plus sleep_ms (so a test can kill the process
                 after the execution and before the answer).
  GET /orders?cart_id=X   -> {"orders": [...]}
  GET /executions         -> {"count": N}: every POST /orders that committed
  GET|POST /headers       -> the request headers it received, and hop-by-hop
                             response headers a proxy must drop
"""
import argparse
import json
import sqlite3
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

local = threading.local()
ARGS = None


def db():
    conn = getattr(local, "conn", None)
    if conn is None:
        conn = sqlite3.connect(ARGS.db, timeout=30, isolation_level=None)
        conn.execute("PRAGMA busy_timeout=30000")
        local.conn = conn
    return conn


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, status, doc, headers=()):
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def do_GET(self):
        u = urlparse(self.path)
        if u.path == "/orders":
            cart = parse_qs(u.query).get("cart_id", [""])[0]
            rows = db().execute(
                "SELECT id, tenant, cart_id, total_cents FROM orders WHERE cart_id = ? ORDER BY id", (cart,)
            ).fetchall()
            self.answer(200, {"orders": [{"id": "ord_%d" % r[0], "tenant": r[1], "cart_id": r[2], "total_cents": r[3]} for r in rows]})
        elif u.path == "/executions":
            n = db().execute("SELECT count(*) FROM orders").fetchone()[0]
            self.answer(200, {"count": n})
        elif u.path == "/headers":
            self.headers_echo()
        else:
            self.answer(404, {"error": "not found"})

    def headers_echo(self):
        self.body()
        self.answer(200, {"headers": {k.lower(): v for k, v in self.headers.items()}}, [
            ("Connection", "X-Hop-Secret"),
            ("X-Hop-Secret", "must not reach the client"),
            ("Keep-Alive", "timeout=5"),
            ("X-End-To-End", "kept"),
        ])

    def do_POST(self):
        u = urlparse(self.path)
        if u.path == "/headers":
            self.headers_echo()
            return
        if u.path != "/orders":
            self.answer(404, {"error": "not found"})
            return
        try:
            doc = json.loads(self.body() or b"{}")
            cart = str(doc["cart_id"])
            total = int(doc.get("total_cents", 0))
        except (ValueError, KeyError, TypeError):
            self.answer(400, {"error": "invalid order: send {\"cart_id\": ..., \"total_cents\": ...}"})
            return
        tenant = self.headers.get("X-Tenant-ID", "")
        conn = db()
        conn.execute("BEGIN IMMEDIATE")
        cur = conn.execute("INSERT INTO orders (tenant, cart_id, total_cents) VALUES (?, ?, ?)", (tenant, cart, total))
        oid = cur.lastrowid
        conn.execute("COMMIT")
        wait = ARGS.delay_ms + int(doc.get("sleep_ms", 0) or 0)
        if wait:
            time.sleep(wait / 1000)
        self.answer(201, {"id": "ord_%d" % oid, "tenant": tenant, "cart_id": cart, "total_cents": total},
                    [("Location", "/orders/ord_%d" % oid)])


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay-ms", type=int, default=0)
    ARGS = p.parse_args()
    conn = sqlite3.connect(ARGS.db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, tenant TEXT, cart_id TEXT, total_cents INTEGER)")
    conn.close()
    srv = ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler)
    srv.daemon_threads = True
    srv.request_queue_size = 1024
    print("listening on http://127.0.0.1:%d" % srv.server_address[1], flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:  # Ctrl-C stops it quietly
        pass


if __name__ == "__main__":
    sys.exit(main())
