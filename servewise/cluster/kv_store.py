"""A global KV store: blocks of KV named by their prefix hash (engine.block_manager.chain_hash), shared by
every engine on the machine that opens the same directories.

Two tiers, each a directory of one file per block: a memory tier (under /dev/shm) and an optional
disk tier. A file is written once, under a temporary name, then renamed into place, so a reader sees
a whole entry or none; it is never changed afterwards. Each holds a small header (format, shape,
dtype) and a CRC-32 per layer, then the block's K and V for every layer, so a reader can check each
layer as it arrives. A bad entry is deleted and reported: the request computes that KV instead.

Capacity is kept per tier with a high and a low watermark, least recently used first (a read
touches the file): the memory tier demotes its oldest entries to the disk tier, the disk tier drops
them. An entry being read is leased: a small file naming the reader's process and an expiry time.
Eviction passes over live leases; a lease whose process is gone, or whose time has run out, counts
for nothing (and is removed), so a reader that crashed or hangs never pins an entry. A reader that
has opened an entry keeps reading the same bytes even if it is evicted meanwhile (the file is only
unlinked), so eviction can never hand a reader half an entry.

`SimStore` is the same store for the simulator: names, sizes and tiers without bytes.
"""
from __future__ import annotations

import itertools
import os
import shutil
import struct
import tempfile
import time
import zlib

import numpy as np
import torch

MAGIC = b"SWKV1\0\0\0"
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_HEADER = struct.Struct("<8sIIIIII")  # magic, dtype code, layers, block size, kv heads, head dim, reserved
TIERS = ("memory", "disk")


def entry_file(directory: str, name: bytes) -> str:
    return os.path.join(directory, name.hex() + ".kv")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Entry:
    """An opened, leased entry: per-layer [2, block size, kv heads, head dim] views and their checks."""

    def __init__(self, store: KVStore, name: bytes, path: str, lease: str):
        self.store, self.name, self.lease = store, name, lease
        with open(path, "rb") as f:
            raw = bytearray(f.read())  # one read: the bytes are ours even if the entry is evicted now
        head = _HEADER.unpack_from(raw)
        if head[0] != MAGIC or head[1] != DTYPES[store.dtype] or head[2:6] != store.shape[:1] + store.shape[2:]:
            raise ValueError("not an entry of this store's shape")
        layers = head[2]
        off = _HEADER.size
        self.crcs = struct.unpack_from(f"<{layers}I", raw, off)
        off += 4 * layers
        data = np.frombuffer(raw, np.uint8, offset=off)
        if data.size != store.block_bytes:
            raise ValueError(f"entry holds {data.size} bytes, {store.block_bytes} expected")
        self.data = torch.from_numpy(data).view(store.dtype).view(store.shape)

    def layer(self, i: int) -> torch.Tensor | None:
        """Layer i's K and V, or None when its checksum fails."""
        t = self.data[i]
        return t if crc(t) == self.crcs[i] else None

    def close(self) -> None:
        if self.lease:
            try:
                os.unlink(self.lease)
            except FileNotFoundError:
                pass
            self.lease = ""


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


class KVStore:
    """shape: one block's KV, [layers, 2, block size, kv heads, head dim]; capacities in bytes."""

    def __init__(self, memory_dir: str, shape: tuple[int, ...], dtype: torch.dtype, memory_bytes: int,
                 disk_dir: str | None = None, disk_bytes: int = 0, high: float = 0.95, low: float = 0.8,
                 lease_s: float = 30.0):
        if not 0 < low < high <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low < high <= 1, got {low} and {high}")
        if memory_bytes <= 0 or (disk_dir is not None and disk_bytes <= 0):
            raise ValueError("each tier needs a capacity above 0 bytes")
        self.shape, self.dtype = tuple(shape), dtype
        self.block_bytes = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
        self.file_bytes = _HEADER.size + 4 * shape[0] + self.block_bytes
        self.dirs = {"memory": memory_dir, "disk": disk_dir}
        self.capacity = {"memory": memory_bytes, "disk": disk_bytes if disk_dir else 0}
        self.high, self.low, self.lease_s = high, low, lease_s
        self.lease_dir = os.path.join(memory_dir, "leases")
        for d in (memory_dir, disk_dir, self.lease_dir):
            if d:
                os.makedirs(d, exist_ok=True)
        self._written = dict.fromkeys(TIERS, 0)  # bytes this process added since it last counted a tier
        self._used = {t: self._scan(t)[1] for t in TIERS}
        self._nonce = itertools.count()
        self.stats = {"puts": 0, "hits": 0, "misses": 0, "corrupt": 0, "demoted": 0, "dropped": 0}

    # --- lookups -------------------------------------------------------------------------------
    def tier(self, name: bytes) -> str | None:
        for t in TIERS:
            if self.dirs[t] and os.path.exists(entry_file(self.dirs[t], name)):
                return t
        return None

    def __contains__(self, name: bytes) -> bool:
        return self.tier(name) is not None

    # --- writing -------------------------------------------------------------------------------
    def put(self, name: bytes, kv: torch.Tensor) -> bool:
        """Store one block's KV under its name (no-op when present); False when it was there."""
        if name in self:
            return False
        kv = kv.detach().to("cpu").contiguous()
        if tuple(kv.shape) != self.shape or kv.dtype != self.dtype:
            raise ValueError(f"a block of shape {tuple(kv.shape)} {kv.dtype}; this store holds {self.shape} {self.dtype}")
        self._write(self.dirs["memory"], name, kv, [crc(kv[i]) for i in range(self.shape[0])])
        self.stats["puts"] += 1
        self._written["memory"] += self.file_bytes
        if self._used["memory"] + self._written["memory"] > self.high * self.capacity["memory"]:
            self.evict("memory")
        return True

    # --- reading -------------------------------------------------------------------------------
    def open(self, name: bytes) -> Entry | None:
        """The entry, leased until closed, or None when it is missing or unreadable (then it is dropped)."""
        for t in TIERS:
            if not self.dirs[t]:
                continue
            path = entry_file(self.dirs[t], name)
            lease = self._lease(name)
            try:
                entry = Entry(self, name, path, lease)
            except FileNotFoundError:
                os.unlink(lease)
                continue
            except (ValueError, struct.error):
                os.unlink(lease)
                self.drop(name)
                self.stats["corrupt"] += 1
                return None
            try:
                os.utime(path)  # recently used
            except FileNotFoundError:
                pass
            if t == "disk":  # back to the memory tier: it is in use again
                self._promote(name, entry)
            self.stats["hits"] += 1
            return entry
        self.stats["misses"] += 1
        return None

    def drop(self, name: bytes) -> None:
        """Remove an entry from every tier (a reader found it corrupt)."""
        for t in TIERS:
            if self.dirs[t]:
                try:
                    os.unlink(entry_file(self.dirs[t], name))
                except FileNotFoundError:
                    pass

    def _write(self, directory: str, name: bytes, kv: torch.Tensor, crcs) -> str:
        """Write an entry under a temporary name, then rename it into place (readers see all or nothing)."""
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".put-")
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER.pack(MAGIC, DTYPES[self.dtype], *self.shape[:1], *self.shape[2:], 0))
            f.write(struct.pack(f"<{self.shape[0]}I", *crcs))
            f.write(kv.contiguous().view(torch.uint8).numpy().tobytes())
        path = entry_file(directory, name)
        os.replace(tmp, path)
        return path

    def _promote(self, name: bytes, entry: Entry) -> None:
        self._write(self.dirs["memory"], name, entry.data, entry.crcs)
        self._written["memory"] += self.file_bytes

    def probe(self, n: int = 16) -> dict[str, tuple[float, float]]:
        """Per tier: (seconds to open, read and check one block, 0 fixed), the median of n reads of
        freshly written blocks (so disk reads come from the page cache: a floor for a cold disk)."""
        kv = torch.zeros(self.shape, dtype=self.dtype)
        crcs = [crc(kv[i]) for i in range(self.shape[0])]
        out = {}
        for t in TIERS:
            if not self.dirs[t]:
                continue
            times = []
            for _ in range(n):
                name = os.urandom(16)
                path = self._write(self.dirs[t], name, kv, crcs)
                t0 = time.perf_counter()
                e = Entry(self, name, path, "")
                all(e.layer(i) is not None for i in range(self.shape[0]))
                times.append(time.perf_counter() - t0)
                os.unlink(path)
            out[t] = (sorted(times)[n // 2], 0.0)
        return out

    # --- leases --------------------------------------------------------------------------------
    def _lease(self, name: bytes) -> str:
        path = os.path.join(self.lease_dir, f"{name.hex()}.{os.getpid()}.{next(self._nonce)}")
        with open(path, "w") as f:
            f.write(repr(time.time() + self.lease_s))
        return path

    def leased(self) -> set[str]:
        """Names (hex) with a live lease; dead ones (their process gone, or past their expiry) are removed."""
        live, now = set(), time.time()
        for e in os.scandir(self.lease_dir):
            hexname, _, rest = e.name.partition(".")
            pid = int(rest.partition(".")[0] or 0)
            try:
                with open(e.path) as f:
                    expiry = float(f.read() or 0)
            except (FileNotFoundError, ValueError):
                expiry = 0.0
            if expiry > now and _pid_alive(pid):
                live.add(hexname)
            else:
                try:
                    os.unlink(e.path)
                except FileNotFoundError:
                    pass
        return live

    # --- capacity ------------------------------------------------------------------------------
    def _scan(self, tier: str) -> tuple[list, int]:
        """(entries oldest first as (mtime, hex name, path), bytes used) of a tier."""
        d = self.dirs[tier]
        if not d:
            return [], 0
        rows = []
        for e in os.scandir(d):
            if e.name.endswith(".kv"):
                try:
                    rows.append((e.stat().st_mtime, e.name[:-3], e.path))
                except FileNotFoundError:
                    pass
            elif e.name.startswith(".put-"):  # a writer that died mid-write left this
                try:
                    if e.stat().st_mtime < time.time() - self.lease_s:
                        os.unlink(e.path)
                except FileNotFoundError:
                    pass
        rows.sort()
        return rows, len(rows) * self.file_bytes

    def evict(self, tier: str) -> None:
        """Bring a tier down to its low watermark, least recently used first, passing over leased
        entries: memory entries move to the disk tier (when there is one), disk entries are dropped."""
        rows, used = self._scan(tier)
        self._written[tier] = 0
        goal = self.low * self.capacity[tier]
        if used > self.high * self.capacity[tier]:
            busy = self.leased()
            for _, hexname, path in rows:
                if used <= goal:
                    break
                if hexname in busy:
                    continue
                if tier == "memory" and self.dirs["disk"]:
                    try:
                        shutil.move(path, os.path.join(self.dirs["disk"], hexname + ".kv"))
                    except FileNotFoundError:
                        continue
                    self.stats["demoted"] += 1
                    self._written["disk"] += self.file_bytes
                else:
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        continue
                    self.stats["dropped"] += 1
                used -= self.file_bytes
        self._used[tier] = used
        if tier == "memory" and self.dirs["disk"] and \
                self._used["disk"] + self._written["disk"] > self.high * self.capacity["disk"]:
            self.evict("disk")

    def usage(self) -> dict[str, int]:
        """Bytes held per tier (counted now)."""
        return {t: self._scan(t)[1] for t in TIERS}


class SimStore:
    """The store's bookkeeping for the simulator: which names each tier holds, least recently used
    first, under the same capacities and watermarks (in blocks). Shared by simulated instances."""

    def __init__(self, memory_blocks: int, disk_blocks: int = 0, high: float = 0.95, low: float = 0.8,
                 read_s: dict[str, tuple[float, float]] | None = None):
        from collections import OrderedDict

        self.read_s = read_s or {"memory": (0.0, 0.0), "disk": (0.0, 0.0)}  # per tier: (s per block, fixed s)
        self.capacity = {"memory": memory_blocks, "disk": disk_blocks}
        self.high, self.low = high, low
        self.tiers: dict[str, OrderedDict] = {t: OrderedDict() for t in TIERS}
        self.stats = {"puts": 0, "hits": 0, "misses": 0, "corrupt": 0, "demoted": 0, "dropped": 0}

    def tier(self, name: bytes) -> str | None:
        for t in TIERS:
            if name in self.tiers[t]:
                return t
        return None

    def __contains__(self, name: bytes) -> bool:
        return self.tier(name) is not None

    def put(self, name: bytes, kv=None) -> bool:
        if name in self:
            return False
        self.tiers["memory"][name] = None
        self.stats["puts"] += 1
        self._evict("memory")
        return True

    def read(self, name: bytes) -> str | None:
        """Use an entry (a simulated open): its tier before the read, which brings it to the memory tier."""
        t = self.tier(name)
        if t is None:
            self.stats["misses"] += 1
            return None
        self.stats["hits"] += 1
        del self.tiers[t][name]
        self.tiers["memory"][name] = None
        if t == "disk":
            self._evict("memory")
        return t

    def _evict(self, tier: str) -> None:
        entries, cap = self.tiers[tier], self.capacity[tier]
        if len(entries) <= self.high * cap:
            return
        while entries and len(entries) > self.low * cap:
            name, _ = entries.popitem(last=False)
            if tier == "memory" and self.capacity["disk"]:
                self.tiers["disk"][name] = None
                self.stats["demoted"] += 1
            else:
                self.stats["dropped"] += 1
        if tier == "memory" and self.capacity["disk"]:
            self._evict("disk")
