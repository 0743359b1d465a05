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
import logging
import math
import os
import shutil
import struct
import tempfile
import time
from collections import OrderedDict
from typing import Callable

import torch

from servewise.connectors.shm import crc, discard

MAGIC = b"SWKV1\0\0\0"
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_HEADER = struct.Struct("<8sIIIIII")  # magic, dtype code, layers, block size, kv heads, head dim, reserved
TIERS = ("memory", "disk")
log = logging.getLogger("servewise")


def new_stats() -> dict[str, int]:
    """A store's counts, each at zero (the real, the simulated and the remote store keep the same ones)."""
    return dict.fromkeys(("puts", "hits", "misses", "corrupt", "demoted", "dropped", "put_errors"), 0)


def entry_file(directory: str, name: bytes) -> str:
    return os.path.join(directory, name.hex() + ".kv")


def _unlink(path: str) -> None:
    """Remove a file on an error path: whatever else failed, this must not raise."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Entry:
    """An opened, leased entry, read layer by layer: layer(i) reads layer i's K and V ([2, block size,
    kv heads, head dim]) and checks it. The file stays open until close(), so what is read is the
    entry as opened even if it is evicted (unlinked) meanwhile."""

    def __init__(self, store: KVStore, name: bytes, path: str, lease: str, tier: str = "memory"):
        self.store, self.name, self.lease, self.tier = store, name, lease, tier
        self.fd = os.open(path, os.O_RDONLY)
        try:
            layers = store.shape[0]
            head = os.pread(self.fd, _HEADER.size + 4 * layers, 0)
            if len(head) < _HEADER.size + 4 * layers or os.fstat(self.fd).st_size != store.file_bytes:
                raise ValueError("truncated entry")
            h = _HEADER.unpack_from(head)
            if h[0] != MAGIC or h[1] != DTYPES[store.dtype] or h[2:6] != store.shape[:1] + store.shape[2:]:
                raise ValueError("not an entry of this store's shape")
            self.crcs = struct.unpack_from(f"<{layers}I", head, _HEADER.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.layer_bytes = store.block_bytes // layers
        self.offset = _HEADER.size + 4 * layers
        self.read: list[torch.Tensor | None] = [None] * layers

    def layer(self, i: int) -> torch.Tensor | None:
        """Layer i's K and V, or None when they cannot be read or fail their checksum."""
        try:
            raw = bytearray(os.pread(self.fd, self.layer_bytes, self.offset + i * self.layer_bytes))
        except OSError:
            return None
        if len(raw) != self.layer_bytes:
            return None
        t = torch.frombuffer(raw, dtype=torch.uint8).view(self.store.dtype).view(self.store.shape[1:])
        if crc(t) != self.crcs[i]:
            return None
        self.read[i] = t
        return t

    def close(self) -> None:
        """Release the lease; an entry read whole from the disk tier goes back to the memory tier."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            if self.tier == "disk" and all(t is not None for t in self.read):
                self.store._promote(self.name, torch.stack(self.read), self.crcs)
        if self.lease:
            discard(self.lease)
            self.lease = ""


class ReadCosts:
    """What reading from a store costs: per tier, (seconds per block, fixed seconds per read), measured
    (KVStore.probe) or given (SimStore)."""

    read_s: dict[str, tuple[float, float]] = {t: (0.0, 0.0) for t in TIERS}

    def read_time(self, tiers: list[str]) -> float:
        """Seconds to read blocks from the given tiers: the slowest tier's fixed cost, plus each block's."""
        return max((self.read_s[t][1] for t in set(tiers)), default=0.0) + sum(self.read_s[t][0] for t in tiers)


class KVStore(ReadCosts):
    """shape: one block's KV, [layers, 2, block size, kv heads, head dim]; capacities in bytes."""

    def __init__(self, memory_dir: str, shape: tuple[int, ...], dtype: torch.dtype, memory_bytes: int,
                 disk_dir: str | None = None, disk_bytes: int = 0, high: float = 0.95, low: float = 0.8,
                 lease_s: float = 30.0, clock: Callable[[], float] | None = None):
        """clock: seconds, for tests to drive leases and recounts by hand; by default lease expiries (which
        other processes read) and the age of abandoned temporary files are on the wall clock (time.time) and
        the interval between recounts of a tier on time.monotonic."""
        if not 0 < low < high <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low < high <= 1, got {low} and {high}")
        if memory_bytes <= 0 or (disk_dir is not None and disk_bytes <= 0):
            raise ValueError("each tier needs a capacity above 0 bytes")
        self.shape, self.dtype = tuple(shape), dtype
        self.block_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self.file_bytes = _HEADER.size + 4 * shape[0] + self.block_bytes
        self.dirs = {"memory": memory_dir, "disk": disk_dir}
        self.capacity = {"memory": memory_bytes, "disk": disk_bytes if disk_dir else 0}
        self.high, self.low, self.lease_s = high, low, lease_s
        self._wall, self._monotonic = clock or time.time, clock or time.monotonic
        self.lease_dir = os.path.join(memory_dir, "leases")
        for d in (memory_dir, disk_dir, self.lease_dir):
            if d:
                os.makedirs(d, exist_ok=True)
        self._written = dict.fromkeys(TIERS, 0)  # bytes this process added since it last counted a tier
        self._used = {t: self._scan(t)[1] for t in TIERS}
        self._scanned_at = dict.fromkeys(TIERS, self._monotonic())
        self._nonce = itertools.count()
        self.stats = new_stats()

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
        """Store one block's KV under its name; False when it was there already or could not be written
        (a full or unwritable directory is logged and counted, never raised: the store is a cache)."""
        if name in self:
            return False
        kv = kv.detach().to("cpu").contiguous()
        if tuple(kv.shape) != self.shape or kv.dtype != self.dtype:
            raise ValueError(f"a block of shape {tuple(kv.shape)} {kv.dtype}; this store holds {self.shape} {self.dtype}")
        try:
            self._write(self.dirs["memory"], name, kv, [crc(kv[i]) for i in range(self.shape[0])])
        except OSError as e:
            self.stats["put_errors"] += 1
            if self.stats["put_errors"] == 1:
                log.warning("servewise: the KV store cannot write to %s (%s); blocks are not stored meanwhile",
                            self.dirs["memory"], e)
            return False
        self.stats["puts"] += 1
        self._added("memory")
        return True

    def _added(self, tier: str) -> None:
        """Count an entry this process added; evict past the high watermark. Other processes write too:
        the tier is counted again at least once a second."""
        self._written[tier] += self.file_bytes
        if self._monotonic() - self._scanned_at[tier] > 1.0:
            self._used[tier], self._written[tier] = self._scan(tier)[1], 0
            self._scanned_at[tier] = self._monotonic()
        if self._used[tier] + self._written[tier] > self.high * self.capacity[tier]:
            self.evict(tier)

    # --- reading -------------------------------------------------------------------------------
    def open(self, name: bytes) -> Entry | None:
        """The entry, leased until closed, or None when it is missing or unreadable (a malformed one is
        dropped)."""
        for t in TIERS:
            if not self.dirs[t]:
                continue
            path = entry_file(self.dirs[t], name)
            try:
                lease = self._lease(name)
            except OSError:
                return None
            try:
                entry = Entry(self, name, path, lease, t)
            except FileNotFoundError:
                _unlink(lease)
                continue
            except (ValueError, struct.error):
                _unlink(lease)
                self.reject(name)
                return None
            except OSError:
                _unlink(lease)
                return None
            try:
                os.utime(path)  # recently used
            except OSError:
                pass
            self.stats["hits"] += 1
            return entry
        self.stats["misses"] += 1
        return None

    def reject(self, name: bytes) -> None:
        """A reader found the entry malformed or failing a checksum: drop it, count it."""
        self.drop(name)
        self.stats["corrupt"] += 1

    def drop(self, name: bytes) -> None:
        """Remove an entry from every tier."""
        for t in TIERS:
            if self.dirs[t]:
                discard(entry_file(self.dirs[t], name))

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

    def _promote(self, name: bytes, kv: torch.Tensor, crcs) -> None:
        """A disk entry read again moves back to the memory tier."""
        try:
            self._write(self.dirs["memory"], name, kv, crcs)
        except OSError:
            return
        _unlink(entry_file(self.dirs["disk"], name))
        self._added("memory")

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
                e = Entry(self, name, path, "", "memory")  # (no promotion)
                all(e.layer(i) is not None for i in range(self.shape[0]))
                e.close()
                times.append(time.perf_counter() - t0)
                os.unlink(path)
            out[t] = (sorted(times)[n // 2], 0.0)
        return out

    # --- leases --------------------------------------------------------------------------------
    def _lease(self, name: bytes) -> str:
        """A lease file, NAME.PID.N holding its expiry time (written aside, then renamed into place)."""
        path = os.path.join(self.lease_dir, f"{name.hex()}.{os.getpid()}.{next(self._nonce)}")
        fd, tmp = tempfile.mkstemp(dir=self.lease_dir, prefix=".new-")
        with os.fdopen(fd, "w") as f:
            f.write(repr(self._wall() + self.lease_s))
        os.replace(tmp, path)
        return path

    def leased(self) -> set[str]:
        """Names (hex) with a live lease; dead ones (their process gone, or past their expiry) are removed."""
        live, now = set(), self._wall()
        for e in os.scandir(self.lease_dir):
            if e.name.startswith("."):  # being written
                continue
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
                discard(e.path)
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
                    if e.stat().st_mtime < self._wall() - self.lease_s:
                        os.unlink(e.path)
                except FileNotFoundError:
                    pass
        rows.sort()
        return rows, len(rows) * self.file_bytes

    def evict(self, tier: str) -> None:
        """Bring a tier down to its low watermark, least recently used first, passing over leased
        entries: memory entries move to the disk tier (when there is one), disk entries are dropped."""
        rows, used = self._scan(tier)
        self._written[tier], self._scanned_at[tier] = 0, self._monotonic()
        goal = self.low * self.capacity[tier]
        if used > self.high * self.capacity[tier]:
            busy = self.leased()
            for _, hexname, path in rows:
                if used <= goal:
                    break
                if hexname in busy:
                    continue
                if tier == "memory" and self.dirs["disk"]:
                    if not self._demote(path, hexname):
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

    def _demote(self, path: str, hexname: str) -> bool:
        """Move a memory entry to the disk tier: copied under a temporary name, renamed into place, then
        removed from memory (a reader never sees a partial file, on one filesystem or two)."""
        d, tmp = self.dirs["disk"], ""
        try:
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".put-")
            os.close(fd)
            shutil.copyfile(path, tmp)
            os.replace(tmp, os.path.join(d, hexname + ".kv"))
        except FileNotFoundError:
            _unlink(tmp)
            return False
        except OSError:
            _unlink(tmp)
            _unlink(path)  # no room below: the entry goes
            return True
        _unlink(path)
        return True

    def usage(self) -> dict[str, int]:
        """Bytes held per tier (counted now)."""
        return {t: self._scan(t)[1] for t in TIERS}


class SimStore(ReadCosts):
    """The store's bookkeeping for the simulator: which names each tier holds, least recently used
    first, under the same capacities and watermarks (in blocks). Shared by simulated instances: with a
    `clock`, an entry is visible from the end of the step that wrote it (put's `delay`) on."""

    def __init__(self, memory_blocks: int, disk_blocks: int = 0, high: float = 0.95, low: float = 0.8,
                 read_s: dict[str, tuple[float, float]] | None = None, clock=None):
        if read_s is not None:
            self.read_s = read_s
        self.capacity = {"memory": memory_blocks, "disk": disk_blocks}
        self.high, self.low, self.clock = high, low, clock
        self.tiers: dict[str, OrderedDict] = {t: OrderedDict() for t in TIERS}  # name -> time it is readable
        self.stats = new_stats()

    def tier(self, name: bytes) -> str | None:
        for t in TIERS:
            ready = self.tiers[t].get(name)
            if ready is not None:
                return t if self.clock is None or ready <= self.clock.now() else None
        return None

    def __contains__(self, name: bytes) -> bool:
        return self.tier(name) is not None

    def put(self, name: bytes, kv=None, delay: float = 0.0) -> bool:
        if any(name in self.tiers[t] for t in TIERS):
            return False
        self.tiers["memory"][name] = (self.clock.now() if self.clock is not None else 0.0) + delay
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
        self.tiers["memory"][name] = self.tiers[t].pop(name)
        if t == "disk":
            self._evict("memory")
        return t

    def _evict(self, tier: str) -> None:
        entries, cap = self.tiers[tier], self.capacity[tier]
        if len(entries) <= self.high * cap:
            return
        while entries and len(entries) > self.low * cap:
            name, ready = entries.popitem(last=False)
            if tier == "memory" and self.capacity["disk"]:
                self.tiers["disk"][name] = ready
                self.stats["demoted"] += 1
            else:
                self.stats["dropped"] += 1
        if tier == "memory" and self.capacity["disk"]:
            self._evict("disk")
