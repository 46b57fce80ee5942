"""A fault-injecting, bandwidth-limiting HTTP/1.1 proxy between S3 clients
(dtectl, the AWS CLI) and an S3 server (moto) on loopback.

    client --> http://127.0.0.1:PORT (FaultProxy) --> upstream server

Clients use the proxy's address as their endpoint. Each client connection
gets its own upstream connection. Request and response heads are forwarded
byte for byte, so the Host header, which SigV4 signs, reaches the server as
the client sent it and signatures verify. Bodies are relayed in pieces of at
most 64 KiB through one rate limiter per direction (a shared link), and
every byte is counted: `bytes_up` (client to server: heads and bodies of
requests) and `bytes_down` (server to client, including what faults send).

Just enough HTTP is parsed to find message boundaries: Content-Length or
chunked request bodies; response bodies by Content-Length, chunked, none
(HEAD, 1xx, 204, 304) or until the server closes. The proxy answers
`Expect: 100-continue` itself and drops the server's interim 1xx answers.

Faults are Rules, tried in order against each request's method, path, query
and Range header; the first rule that fires decides what happens to the
request:

  status        answer `status` with an S3 error body (`code`, `message`)
                without forwarding, then close the connection
  reset_before  reset the connection (RST) before forwarding anything
  reset_after   forward the request, read the server's whole answer (the
                request is applied), then reset instead of answering
  stall         forward, then hold the answer for `seconds` and reset the
                connection; with `at`, the head and `at` body bytes (at most
                all but one) are sent before the hold
  truncate      forward, send the head with its Content-Length and only `at`
                body bytes (default half, at most all but one), then close
  flip          forward, XOR body byte `at` (default the middle one) with
                `mask`, answer normally
  list_damage_key  forward a ListObjectsV2, XOR the last digit of the key of
                its <Contents> element number `at` (default -1: the last
                one; none: no change) with `mask`, answer with the rest as
                it was (mask 0x40 turns a digit into a letter: the page still
                parses, the key no longer fits the store's grammar)
  list_drop_key forward a ListObjectsV2, remove its <Contents> element number
                `at` (default -1) and lower <KeyCount> to match, answer with
                the Content-Length of what is left (a listing that lacks one
                key yet reads as whole)
  pass          no fault: only runs the rule's hook

A rule lets `skip` matching requests through, then fires on the next `times`
matches (None: all of them). A rule's `hook(exchange)` runs when it fires:
for `pass` rules when the whole request has arrived and before it is
forwarded (`when="request"`) or when the server's answer has arrived and
before the client gets it (`when="response"`); for faults as soon as the
request's head has arrived. Hooks run on the connection's thread (a crash test kills the client
from one).

`exchanges()` lists every request seen, with the fault applied and the
status the client got. Sockets time out after `io_timeout` seconds and
stop() closes everything, so no thread waits forever.

Thread-safety: every public method may be called from any thread.

Standalone: /opt/dte/venv/bin/python s3_proxy.py --upstream http://127.0.0.1:9000
[--port P] [--up-rate BYTES/S] [--down-rate BYTES/S] (Ctrl-C prints counters).
"""

import argparse
import re
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit

PIECE = 64 * 1024
ACTIONS = ("status", "reset_before", "reset_after", "stall", "truncate", "flip",
           "list_damage_key", "list_drop_key", "pass")
LISTING_ACTIONS = ("list_damage_key", "list_drop_key")
_ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
              '<Message>{message}</Message><RequestId>DTEPROXY{seq}</RequestId></Error>')


@dataclass
class Rule:
    action: str
    method: Optional[str] = None   # "PUT"; None: any
    key: Optional[str] = None      # substring of the URL path ("manifests/")
    query: Optional[str] = None    # substring of the query ("partNumber="); "": no query
    ranged: Optional[bool] = None  # True: only requests with a Range header; False: without
    skip: int = 0
    times: Optional[int] = 1
    status: int = 503
    code: str = "SlowDown"
    message: str = "Please reduce your request rate."
    seconds: float = 10.0
    at: Optional[int] = None
    mask: int = 0x10
    hook: Optional[Callable] = None
    when: str = "request"
    matched: int = 0               # matching requests seen so far
    fired: int = 0

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown proxy action {self.action!r}")
        if self.when not in ("request", "response"):
            raise ValueError(f"unknown hook moment {self.when!r}")

    def matches(self, ex):
        return ((self.method is None or ex.method == self.method) and
                (self.key is None or self.key in ex.path) and
                (self.query is None or (self.query in ex.query if self.query else not ex.query))
                and (self.ranged is None or ("range" in ex.headers) == self.ranged))


@dataclass
class Exchange:
    seq: int
    method: str
    path: str
    query: str
    headers: dict = field(repr=False)  # lower-case names
    action: str = "pass"
    status: Optional[int] = None       # what the client got; None: no answer
    request_bytes: int = 0             # head and body as received


class TokenBucket:
    """Bytes per second through one direction; None is unlimited. Callers that
    overdraw wait for the debt to drain, so concurrent senders share the rate."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rate = None
        self._tokens = 0.0
        self._last = time.monotonic()

    def set_rate(self, rate):
        with self._lock:
            self._rate = rate
            self._tokens = 0.0
            self._last = time.monotonic()

    def take(self, n, stopping):
        with self._lock:
            if not self._rate:
                return
            now = time.monotonic()
            burst = max(PIECE, self._rate / 50)
            self._tokens = min(burst, self._tokens + (now - self._last) * self._rate) - n
            self._last = now
            wait = -self._tokens / self._rate if self._tokens < 0 else 0
        if wait > 0:
            stopping.wait(wait)


class _Closed(Exception):
    """The peer closed the connection, or it broke."""


class _Stream:
    """Buffered reads from a socket."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()

    def _fill(self):
        try:
            data = self.sock.recv(PIECE)
        except OSError as e:
            raise _Closed(str(e)) from e
        if not data:
            raise _Closed("closed")
        self.buf += data

    def head(self):
        """Bytes up to and including the blank line; None at a clean end."""
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i >= 0:
                out = bytes(self.buf[:i + 4])
                del self.buf[:i + 4]
                return out
            if len(self.buf) > 256 * 1024:
                raise _Closed("oversized head")
            try:
                self._fill()
            except _Closed:
                if not self.buf:
                    return None
                raise

    def line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        i = self.buf.find(b"\r\n") + 2
        out = bytes(self.buf[:i])
        del self.buf[:i]
        return out

    def some(self, limit):
        if not self.buf:
            self._fill()
        out = bytes(self.buf[:limit])
        del self.buf[:limit]
        return out


def _headers(head):
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def _body_pieces(stream, framing):
    """The body's wire bytes, piece by piece; framing is an int length,
    "chunked" or "close"."""
    if framing == "chunked":
        while True:
            size_line = stream.line()
            yield size_line
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:
                    trailer = stream.line()
                    yield trailer
                    if trailer == b"\r\n":
                        return
            left = size + 2
            while left:
                piece = stream.some(min(left, PIECE))
                left -= len(piece)
                yield piece
    elif framing == "close":
        while True:
            try:
                yield stream.some(PIECE)
            except _Closed:
                return
    else:
        left = framing
        while left:
            piece = stream.some(min(left, PIECE))
            left -= len(piece)
            yield piece


def _request_framing(headers):
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return "chunked"
    return int(headers.get("content-length", "0") or 0)


def _response_framing(method, status, headers):
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return 0
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return "chunked"
    if "content-length" in headers:
        return int(headers["content-length"])
    return "close"


def _reset(sock):
    """Closes with an RST instead of a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    def __init__(self, upstream, port=0, io_timeout=120.0):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port or 80)
        self.io_timeout = io_timeout
        self._lock = threading.Lock()
        self._rules = []
        self._exchanges = []
        self._sockets = set()
        self._threads = []
        self._up, self._down = TokenBucket(), TokenBucket()
        self._bytes = {"up": 0, "down": 0}
        self._stopping = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._accepter = threading.Thread(target=self._accept, daemon=True, name="proxy-accept")
        self._accepter.start()

    # --- control -------------------------------------------------------------

    def add_rule(self, rule=None, **kw):
        rule = rule or Rule(**kw)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear_rules(self):
        with self._lock:
            self._rules.clear()

    def set_rate(self, up=None, down=None):
        """Bytes per second in each direction; None: unlimited."""
        self._up.set_rate(up)
        self._down.set_rate(down)

    @property
    def bytes_up(self):
        with self._lock:
            return self._bytes["up"]

    @property
    def bytes_down(self):
        with self._lock:
            return self._bytes["down"]

    def reset_counters(self):
        with self._lock:
            self._bytes = {"up": 0, "down": 0}
            self._exchanges.clear()

    def exchanges(self, method=None, key=None, query=None):
        probe = Rule("pass", method=method, key=key, query=query)
        with self._lock:
            return [e for e in self._exchanges if probe.matches(e)]

    def stop(self):
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            socks, threads = list(self._sockets), list(self._threads)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in [self._accepter] + threads:
            t.join(timeout=10)

    # --- plumbing ------------------------------------------------------------

    def _accept(self):
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(client,), daemon=True,
                                 name="proxy-conn")
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _track(self, sock):
        sock.settimeout(self.io_timeout)
        with self._lock:
            self._sockets.add(sock)
        return sock

    def _untrack(self, sock, rst=False):
        with self._lock:
            self._sockets.discard(sock)
        if rst:
            _reset(sock)
        else:
            sock.close()

    def _send(self, sock, data, direction):
        (self._up if direction == "up" else self._down).take(len(data), self._stopping)
        try:
            sock.sendall(data)
        except OSError as e:
            raise _Closed(str(e)) from e
        with self._lock:
            self._bytes[direction] += len(data)

    def _serve(self, client):
        conn = {"client": self._track(client), "upstream": None, "rst": False}
        stream = _Stream(client)
        try:
            while not self._stopping.is_set():
                head = stream.head()
                if head is None or not self._exchange(conn, stream, head):
                    break
        except (_Closed, OSError, ValueError):
            pass
        finally:
            if conn["upstream"] is not None:
                self._untrack(conn["upstream"][0])
            self._untrack(client, rst=conn["rst"])

    def _upstream(self, conn):
        if conn["upstream"] is None:
            sock = self._track(socket.create_connection(self.upstream, timeout=self.io_timeout))
            conn["upstream"] = (sock, _Stream(sock))
        return conn["upstream"]

    def _begin(self, head):
        """The exchange record, the fault rule that fires and the hooks."""
        request_line, headers = _headers(head)
        method, target = request_line.split(" ")[:2]
        path, _, query = target.partition("?")
        with self._lock:
            ex = Exchange(len(self._exchanges), method, path, query, headers)
            self._exchanges.append(ex)
            fault, hooks = None, []
            for rule in self._rules:
                if not rule.matches(ex):
                    continue
                rule.matched += 1
                if rule.matched <= rule.skip or (rule.times is not None and
                                                 rule.fired >= rule.times):
                    continue
                if rule.action == "pass":
                    rule.fired += 1
                    hooks.append(rule)
                elif fault is None:
                    rule.fired += 1
                    fault = rule
        if fault is not None:
            ex.action = fault.action
        return ex, fault, hooks

    def _exchange(self, conn, stream, head):
        """Relays one request and its answer; False when the connection ends."""
        with self._lock:
            self._bytes["up"] += len(head)
        ex, fault, hooks = self._begin(head)
        ex.request_bytes = len(head)
        expect = ex.headers.get("expect", "").lower() == "100-continue"
        if fault is not None and fault.hook is not None:
            fault.hook(ex)
        if fault is not None and fault.action == "reset_before":
            conn["rst"] = True
            return False
        if fault is not None and fault.action == "status":
            if not expect:
                for piece in _body_pieces(stream, _request_framing(ex.headers)):
                    self._count_up(ex, piece)
            self._answer_error(conn["client"], ex, fault)
            return False
        if expect:
            self._send(conn["client"], b"HTTP/1.1 100 Continue\r\n\r\n", "down")
        self._forward_request(conn, stream, head, ex, hooks)
        return self._relay_response(conn, ex, fault, hooks)

    def _count_up(self, ex, piece):
        ex.request_bytes += len(piece)
        with self._lock:
            self._bytes["up"] += len(piece)

    def _answer_error(self, client, ex, rule):
        body = _ERROR_XML.format(code=rule.code, message=rule.message, seq=ex.seq).encode()
        head = (f"HTTP/1.1 {rule.status} {rule.code}\r\nContent-Type: application/xml\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        self._send(client, head + body, "down")
        ex.status = rule.status

    def _forward_request(self, conn, stream, head, ex, hooks):
        early = [h for h in hooks if h.when == "request"]
        pieces = _body_pieces(stream, _request_framing(ex.headers))
        if early:  # the whole request arrives before the hooks run
            pieces = list(pieces)
            for piece in pieces:
                self._count_up(ex, piece)
            for h in early:
                h.hook and h.hook(ex)
        sock, _ = self._upstream(conn)
        self._up.take(len(head), self._stopping)
        try:
            sock.sendall(head)
        except OSError as e:
            raise _Closed(str(e)) from e
        for piece in pieces:
            if not early:
                self._count_up(ex, piece)
            self._up.take(len(piece), self._stopping)
            try:
                sock.sendall(piece)
            except OSError as e:
                raise _Closed(str(e)) from e

    def _read_response_head(self, upstream):
        while True:
            head = upstream.head()
            if head is None:
                raise _Closed("the server closed before answering")
            status_line, headers = _headers(head)
            status = int(status_line.split(" ")[1])
            if not 100 <= status < 200:
                return head, status, headers

    def _relay_response(self, conn, ex, fault, hooks):
        client = conn["client"]
        _, upstream = self._upstream(conn)
        head, status, headers = self._read_response_head(upstream)
        framing = _response_framing(ex.method, status, headers)
        for h in hooks:
            if h.when == "response" and h.hook:
                h.hook(ex)
        action = fault.action if fault is not None else "pass"
        if action == "reset_after":
            for _ in _body_pieces(upstream, framing):
                pass
            conn["rst"] = True
            return False
        if action == "stall":
            if fault.at is not None:
                self._send(client, head, "down")
                ex.status = status
                self._send_prefix(client, upstream, framing, fault.at)
            self._stopping.wait(fault.seconds)
            conn["rst"] = True
            return False
        if action in LISTING_ACTIONS:
            body = _rewrite_listing(_read_body(upstream, framing), action, fault)
            self._send(client, _with_length(head, len(body)), "down")
            ex.status = status
            self._send(client, body, "down")
            return False
        self._send(client, head, "down")
        ex.status = status
        size = framing if isinstance(framing, int) else None
        if action == "truncate":
            keep = fault.at if fault.at is not None else (size or 0) // 2
            self._send_prefix(client, upstream, framing, keep)
            return False
        flip_at = None
        if action == "flip":
            flip_at = fault.at if fault.at is not None else (size or 0) // 2
        self._relay_body(client, upstream, framing, flip_at, fault.mask if fault else 0)
        connection = (headers.get("connection", "") + ex.headers.get("connection", "")).lower()
        return framing != "close" and "close" not in connection

    def _send_prefix(self, client, upstream, framing, keep):
        """Sends the first `keep` body bytes, and never a whole non-empty body."""
        if isinstance(framing, int):
            keep = min(keep, max(framing - 1, 0))
        for piece in _body_pieces(upstream, framing):
            if keep <= 0:
                return
            self._send(client, piece[:keep], "down")
            keep -= len(piece)

    def _relay_body(self, client, upstream, framing, flip_at, mask):
        offset = 0
        for piece in _body_pieces(upstream, framing):
            if flip_at is not None and offset <= flip_at < offset + len(piece):
                b = bytearray(piece)
                b[flip_at - offset] ^= mask
                piece = bytes(b)
            offset += len(piece)
            self._send(client, piece, "down")


def _read_body(stream, framing):
    """The whole body, without chunked framing."""
    wire = b"".join(_body_pieces(stream, framing))
    if framing != "chunked":
        return wire
    body, rest = b"", wire
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2:]
    return body


def _with_length(head, length):
    """A response head whose body is `length` plain bytes; the connection closes after it."""
    lines = [line for line in head.decode("latin-1").split("\r\n") if line]
    drop = ("content-length:", "transfer-encoding:", "connection:")
    kept = [line for line in lines if not line.lower().startswith(drop)]
    kept += [f"Content-Length: {length}", "Connection: close"]
    return ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1")


def _rewrite_listing(body, action, rule):
    """A ListObjectsV2 answer with one key damaged or dropped (see the actions)."""
    entries = list(re.finditer(rb"<Contents>.*?</Contents>", body, re.S))
    index = -1 if rule.at is None else rule.at
    if not -len(entries) <= index < len(entries):
        return body
    e = entries[index]
    if action == "list_drop_key":
        body = body[:e.start()] + body[e.end():]
        return re.sub(rb"<KeyCount>(\d+)</KeyCount>",
                      lambda m: b"<KeyCount>%d</KeyCount>" % (int(m.group(1)) - 1), body, 1)
    key = re.search(rb"<Key>(.*?)</Key>", e.group(0), re.S)
    digits = [i for i, c in enumerate(key.group(1)) if 0x30 <= c <= 0x39] if key else []
    if not digits:
        return body
    at = e.start() + key.start(1) + digits[-1]
    return body[:at] + bytes([body[at] ^ rule.mask]) + body[at + 1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--up-rate", type=float, help="bytes/s, client to server")
    ap.add_argument("--down-rate", type=float, help="bytes/s, server to client")
    a = ap.parse_args()
    proxy = FaultProxy(a.upstream, a.port)
    proxy.set_rate(a.up_rate, a.down_rate)
    print(f"proxy {proxy.endpoint} -> {a.upstream}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    while not done.wait(1):
        pass
    proxy.stop()
    print(f"requests {len(proxy.exchanges())}, bytes up {proxy.bytes_up}, "
          f"bytes down {proxy.bytes_down}")


if __name__ == "__main__":
    main()
