"""The global KV store over the network, for engines on several machines: one `servewise kv-store`
process holds the tiers (a connectors.kv_store.KVStore per KV shape, in directories of its machine) and
engines reach it by address (`--kv-store tcp://HOST:PORT`).

The protocol is length-framed bytes over TCP, nothing unpickled: a request is an op byte, a name (length
byte + bytes) and a payload; an answer is "+" and a payload, or "-" and a message. On connecting, the
server sends a random challenge and the client answers with its HMAC-SHA256 under the shared key
(SERVEWISE_KV_STORE_KEY on both sides); a server started with a key refuses any other answer.

An entry crosses whole: `get` answers with its tier, the per-layer CRC-32s and the bytes, which the client
checks layer by layer as the local store does, so an entry damaged anywhere (the server's files, the
way) reads as corrupt, is dropped, and the request computes that KV. The store is a cache: a server that
is down or does not answer within the timeout costs hits, never a request; the client counts the miss and
tries to reconnect after RETRY_S.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import torch

from servewise.config import STORE_SCHEME as SCHEME
from servewise.config import parse_store_address as parse_address
from servewise.connectors.kv_store import TIERS, KVStore, ReadCosts, new_stats
from servewise.connectors.shm import crc

log = logging.getLogger("servewise")

KEY_ENV = "SERVEWISE_KV_STORE_KEY"
MAX_FRAME = 1 << 30
CHALLENGE_S = 10.0  # seconds a new connection has to answer the challenge
_LEN = struct.Struct("<I")
HELLO, TIER, PUT, GET, REJECT, DROP, USAGE, STATS = (bytes([c]) for c in b"HTPGRDUS")


def key_from_env() -> bytes | None:
    k = os.environ.get(KEY_ENV)
    return k.encode() if k else None


def _send(sock: socket.socket, *parts: bytes) -> None:
    sock.sendall(b"".join([_LEN.pack(sum(len(p) for p in parts)), *parts]))


def _nodelay(sock: socket.socket) -> socket.socket:
    """Small messages go at once (with Nagle's algorithm, a request waits for the last answer's ACK, which the
    other side delays: 40 ms a call)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the connection closed")
        got += k
    return buf


def _recv(sock: socket.socket, limit: int = MAX_FRAME) -> bytearray:
    (n,) = _LEN.unpack(_exact(sock, _LEN.size))
    if n > limit:
        raise EOFError(f"a frame of {n} bytes")
    return _exact(sock, n)


def _digest(key: bytes | None, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest() if key else b""


class StoreServer:
    """Serves KV stores, one per KV shape (a subdirectory of each tier's directory, each with the
    capacities given), to clients on the network. serve_forever() accepts until close(); start() does it in
    a thread of this process."""

    def __init__(self, memory_dir: str, memory_bytes: int, disk_dir: str | None = None, disk_bytes: int = 0,
                 host: str = "127.0.0.1", port: int = 0, key: bytes | None = None):
        if memory_bytes <= 0 or (disk_dir is not None and disk_bytes <= 0):
            raise ValueError("each tier needs a capacity above 0 bytes")
        self.dirs, self.capacity = (memory_dir, disk_dir), (memory_bytes, disk_bytes)
        self.key = key if key is not None else key_from_env()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family)
        self.address = self.sock.getsockname()[:2]
        self.stores: dict[str, tuple[KVStore, threading.Lock]] = {}
        self._lock = threading.Lock()
        self.refused = 0  # connections that failed the challenge
        self.conns: set[socket.socket] = set()

    @property
    def url(self) -> str:
        host, port = self.address
        return f"{SCHEME}{'[' + host + ']' if ':' in host else host}:{port}"

    def serve_forever(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="servewise-kv-store", daemon=True).start()

    def start(self) -> StoreServer:
        threading.Thread(target=self.serve_forever, name="servewise-kv-store", daemon=True).start()
        return self

    def close(self) -> None:
        """Stop accepting and end every connection (shutdown first: close alone wakes no blocked accept)."""
        for sock in [self.sock, *list(self.conns)]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _store(self, hello: dict) -> tuple[KVStore, threading.Lock]:
        shape, dtype = tuple(int(x) for x in hello["shape"]), getattr(torch, hello["dtype"])
        if len(shape) != 5 or min(shape) < 1 or not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a KV block shape: {hello}")
        tag = "x".join(map(str, shape)) + "-" + hello["dtype"]
        with self._lock:
            if tag not in self.stores:
                memory, disk = (os.path.join(d, tag) if d else None for d in self.dirs)
                self.stores[tag] = (KVStore(memory, shape, dtype, self.capacity[0], disk, self.capacity[1]),
                                    threading.Lock())
            return self.stores[tag]

    def _serve(self, conn: socket.socket) -> None:
        _nodelay(conn)
        self.conns.add(conn)
        with conn:
            try:
                conn.settimeout(CHALLENGE_S)  # (a client that never answers holds no thread for long)
                challenge = os.urandom(32)
                _send(conn, challenge)
                answer = bytes(_recv(conn, limit=64))
                if self.key and not hmac.compare_digest(answer, _digest(self.key, challenge)):
                    self.refused += 1
                    _send(conn, b"-the KV store refused the key (set the same " + KEY_ENV.encode() + b" on both sides)")
                    return
                _send(conn, b"+")
                conn.settimeout(None)  # an engine's connection stays open, idle between its calls
                store = lock = None
                while True:
                    msg = _recv(conn)
                    op, n = bytes(msg[:1]), msg[1]
                    name, payload = bytes(msg[2:2 + n]), memoryview(msg)[2 + n:]
                    try:
                        if op == HELLO:
                            store, lock = self._store(json.loads(bytes(payload)))
                            answer = b""
                        elif store is None:
                            raise ValueError("say hello first")
                        else:
                            with lock:
                                answer = self._op(store, op, name, payload)
                        _send(conn, b"+", answer)
                    except (ValueError, KeyError, TypeError, AttributeError) as e:
                        _send(conn, b"-", str(e).encode())
            except (OSError, EOFError, IndexError):
                pass  # the client went away (or sent a frame too short to read)
            finally:
                self.conns.discard(conn)

    @staticmethod
    def _op(store: KVStore, op: bytes, name: bytes, payload: memoryview) -> bytes:
        if op == TIER:
            return (store.tier(name) or "").encode()
        if op == PUT:
            if len(payload) != store.block_bytes:
                raise ValueError(f"a block of {len(payload)} bytes; this store's are {store.block_bytes}")
            kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(store.dtype).view(store.shape)
            return b"1" if store.put(name, kv) else b"0"
        if op == GET:
            e = store.open(name)
            if e is None:
                return b""
            try:
                layers = [e.layer(i) for i in range(store.shape[0])]
            finally:
                e.close()
            if any(t is None for t in layers):
                store.reject(name)
                return b""
            return b"".join([bytes([TIERS.index(e.tier)]), struct.pack(f"<{len(layers)}I", *e.crcs)] +
                            [t.view(torch.uint8).numpy().tobytes() for t in layers])
        if op == REJECT:
            store.reject(name)
            return b""
        if op == DROP:
            store.drop(name)
            return b""
        if op == USAGE:
            return json.dumps(store.usage()).encode()
        if op == STATS:
            return json.dumps(store.stats).encode()
        raise ValueError(f"unknown op {op!r}")


class RemoteEntry:
    """An entry fetched whole from the server; layer(i) checks layer i against its CRC as the local
    store's Entry does."""

    def __init__(self, store: RemoteKVStore, name: bytes, tier: str, crcs: tuple[int, ...], raw: bytearray):
        self.store, self.name, self.tier, self.crcs, self.raw = store, name, tier, crcs, raw

    def layer(self, i: int) -> torch.Tensor | None:
        n = self.store.block_bytes // self.store.shape[0]
        t = torch.frombuffer(self.raw, dtype=torch.uint8, count=n, offset=i * n)
        t = t.view(self.store.dtype).view(self.store.shape[1:])
        return t if crc(t) == self.crcs[i] else None

    def close(self) -> None:
        self.raw = bytearray()


class RemoteKVStore(ReadCosts):
    """A client of a StoreServer with the local store's interface (tier, in, put, open, reject, drop,
    usage, probe, stats). Safe to share between threads (one connection, one call at a time)."""

    RETRY_S = 5.0

    def __init__(self, url: str, shape: tuple[int, ...], dtype: torch.dtype, timeout: float = 10.0,
                 key: bytes | None = None, clock: Callable[[], float] = time.monotonic):
        """clock: seconds, when to try a server that could not be reached again (tests drive it by hand)."""
        self.url, self.address, self._clock = url, parse_address(url), clock
        self.shape, self.dtype, self.timeout = tuple(shape), dtype, timeout
        self.block_bytes = math.prod(self.shape) * torch.empty((), dtype=dtype).element_size()
        self.key = key if key is not None else key_from_env()
        self.stats = new_stats() | {"unreachable": 0}
        self._sock: socket.socket | None = None
        self._retry_at, self._down = 0.0, False
        self._lock = threading.Lock()
        self.read_s = {t: (0.0, 0.0) for t in TIERS}
        self.connected = self._call(USAGE) is not None

    # --- the connection ------------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        sock = _nodelay(socket.create_connection(self.address, timeout=self.timeout))
        try:
            _send(sock, _digest(self.key, bytes(_recv(sock))))
            answer = bytes(_recv(sock))
            if answer[:1] != b"+":
                raise PermissionError(answer[1:].decode(errors="replace"))
            hello = json.dumps({"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")})
            _send(sock, HELLO + b"\0", hello.encode())
            answer = bytes(_recv(sock))
            if answer[:1] != b"+":
                raise ValueError(answer[1:].decode(errors="replace"))
        except BaseException:
            sock.close()
            raise
        return sock

    def _call(self, op: bytes, name: bytes = b"", payload: bytes = b"") -> bytearray | None:
        """The answer's payload, or None when the server cannot be reached (logged once per outage)."""
        with self._lock:
            try:
                if self._sock is None:
                    if self._clock() < self._retry_at:
                        return None
                    self._sock = self._connect()
                    if self._down:
                        log.warning("servewise: the KV store %s is reached again", self.url)
                _send(self._sock, op + bytes([len(name)]) + name, payload)
                answer = _recv(self._sock)
            except (OSError, EOFError, ValueError) as e:  # PermissionError is an OSError
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
                if not self._down:
                    log.warning("servewise: the KV store %s cannot be reached (%s); it reads as empty meanwhile",
                                self.url, e)
                self._down = True
                self._retry_at = self._clock() + self.RETRY_S
                self.stats["unreachable"] += 1
                return None
            self._down = False
        if answer[:1] != b"+":
            raise ValueError(f"the KV store {self.url}: {answer[1:].decode(errors='replace')}")
        return answer[1:]

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    # --- the store's interface -----------------------------------------------------------------
    def tier(self, name: bytes) -> str | None:
        answer = self._call(TIER, name)
        return answer.decode() if answer else None

    def __contains__(self, name: bytes) -> bool:
        return self.tier(name) is not None

    def put(self, name: bytes, kv: torch.Tensor) -> bool:
        kv = kv.detach().to("cpu").contiguous()
        if tuple(kv.shape) != self.shape or kv.dtype != self.dtype:
            raise ValueError(f"a block of shape {tuple(kv.shape)} {kv.dtype}; this store holds {self.shape} {self.dtype}")
        answer = self._call(PUT, name, kv.view(torch.uint8).numpy().tobytes())
        if answer is None:
            self.stats["put_errors"] += 1
            return False
        self.stats["puts"] += answer == b"1"
        return answer == b"1"

    def open(self, name: bytes) -> RemoteEntry | None:
        answer = self._call(GET, name)
        layers = self.shape[0]
        if not answer or len(answer) != 1 + 4 * layers + self.block_bytes:
            self.stats["misses"] += 1
            return None
        self.stats["hits"] += 1
        crcs = struct.unpack_from(f"<{layers}I", answer, 1)
        return RemoteEntry(self, name, TIERS[answer[0]], crcs, answer[1 + 4 * layers:])

    def reject(self, name: bytes) -> None:
        self._call(REJECT, name)
        self.stats["corrupt"] += 1

    def drop(self, name: bytes) -> None:
        self._call(DROP, name)

    def usage(self) -> dict[str, int]:
        answer = self._call(USAGE)
        return json.loads(bytes(answer)) if answer is not None else {t: 0 for t in TIERS}

    def server_stats(self) -> dict | None:
        answer = self._call(STATS)
        return json.loads(bytes(answer)) if answer is not None else None

    def probe(self, n: int = 16) -> dict[str, tuple[float, float]]:
        """(seconds to fetch and check one block, 0 fixed), the median of n fetches of a block written for
        the purpose: the memory tier's cost over the way, taken for the disk tier too (its read adds little
        beside the way). Zero when the server cannot be reached."""
        kv, times, counts = torch.zeros(self.shape, dtype=self.dtype), [], dict(self.stats)
        for _ in range(n):
            name = b"probe-" + os.urandom(10)
            if not self.put(name, kv):
                break
            t0 = time.perf_counter()
            e = self.open(name)
            ok = e is not None and all(e.layer(i) is not None for i in range(self.shape[0]))
            times.append(time.perf_counter() - t0)
            self.drop(name)
            if not ok:
                break
        self.stats.update({k: v for k, v in counts.items() if k != "unreachable"})  # (probes are not traffic)
        cost = (sorted(times)[len(times) // 2], 0.0) if times else (0.0, 0.0)
        return {t: cost for t in TIERS}
