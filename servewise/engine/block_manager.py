"""Paged KV-cache bookkeeping: a device pool, a host pool, per-request block tables.

It never touches tensors. Swaps return plans (lists of (src, dst) block-id pairs) that a runner
executes, so the same object serves the real engine and the simulator.

With prefix caching (a `prefix_key`), every full device block whose KV has been computed is named by
a chained hash: the hash of its tokens and of the block before it, rooted in the key (model, dtype)
and the block size, so equal names mean equal KV in any instance. Blocks carry reference counts; a
new request takes the longest run of cached blocks that starts its tokens and shares them. A block
nobody references keeps its KV and its name until it is needed: blank free blocks are taken first,
then the least recently released cached block (its name is dropped then).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def root_hash(prefix_key: str, block_size: int) -> bytes:
    """The hash a request's first block chains from: deterministic across processes and machines."""
    return hashlib.blake2b(f"servewise-prefix-v1|{prefix_key}|{block_size}".encode(), digest_size=16).digest()


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full block: its tokens and its parent's name."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def prefix_names(tokens: list[int], root: bytes, block_size: int) -> list[bytes]:
    """The chained names of tokens' full blocks (what a request of these tokens would name them)."""
    names, parent = [], root
    for j in range(len(tokens) // block_size):
        parent = chain_hash(parent, tokens[j * block_size:(j + 1) * block_size])
        names.append(parent)
    return names


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs as runs (src start, dst start, count) where both sides are consecutive:
    what a copy call between pools moves per layer, for K and for V (on the GPU's copy-call swap path)."""
    runs: list[list[int]] = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def copy_calls(path: str, layers: int, runs: int) -> int:
    """Calls a swap of `runs` runs of blocks issues: "layer", one block-copy kernel per layer; "run", one
    copy per run, per layer, for K and for V; "none" (CPU: staged groups whatever the runs), none."""
    if path == "layer":
        return layers if runs else 0
    return 2 * layers * runs if path == "run" else 0


class BlockManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int, watermark: float = 0.0,
                 prefix_key: str | None = None):
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.watermark_blocks = int(watermark * num_device_blocks)
        # free lists are stacks: the most recently freed block is reused first
        self.free_device: list[int] = list(range(num_device_blocks - 1, -1, -1))
        self.free_host: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.device_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}
        # prefix caching (off without a prefix_key)
        self.caching = prefix_key is not None
        self.root = root_hash(prefix_key, block_size) if self.caching else b""
        self.refs = [0] * num_device_blocks if self.caching else []  # tables holding each device block
        self.cached: dict[bytes, int] = {}  # block name -> device block holding that KV
        self.name_of: dict[int, bytes] = {}  # the reverse
        self.evictable: OrderedDict[int, None] = OrderedDict()  # named, unreferenced: least recently freed first
        self.registered: dict[str, int] = {}  # request -> leading blocks of its table already named
        self.store = None  # a global KV store (connectors.kv_store): blocks past the device hits may come from it
        self.new_named: list[tuple[int, bytes]] = []  # blocks named since the engine last wrote them to the store
        self.admitted_tokens = 0  # tokens of the requests admitted (again, after a recompute), since start
        self.hit_tokens = 0  # of those, the tokens whose KV came from cached blocks
        self.store_hit_tokens = 0  # and the tokens whose KV was fetched from the store
        self.lent: list[int] = []  # device blocks set aside for another instance's migrated KV or weights

    # --- queries -----------------------------------------------------------------------------
    @property
    def num_free_device(self) -> int:
        """Blocks a request can take: blank ones and cached ones nobody references."""
        return len(self.free_device) + len(self.evictable)

    @property
    def num_free_host(self) -> int:
        return len(self.free_host)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int, hits: list[int] = ()) -> bool:
        """Room for a new request of num_tokens, keeping the admission watermark free; `hits` (from
        match) are cached blocks it would share (those nobody holds now count as taken)."""
        return self._need(num_tokens, hits) <= self.num_free_device - self.watermark_blocks

    def _need(self, num_tokens: int, hits: list[int]) -> int:
        """Free blocks a new request takes: its new ones, and the cached ones it shares that nobody holds."""
        return self.blocks_needed(num_tokens) - len(hits) + sum(self.refs[b] == 0 for b in hits)

    def new_blocks_for(self, req_id: str, num_tokens: int) -> int:
        """Blocks req_id must gain so that its table covers num_tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(self.device_tables[req_id]))

    # --- prefix caching ----------------------------------------------------------------------
    def block_name(self, req, i: int) -> bytes:
        """The chained hash of req's block i (its tokens i*bs .. (i+1)*bs must exist); names are kept on
        the request, computed once."""
        names, bs = req.block_hashes, self.block_size
        if i < len(names):
            return names[i]
        p = req.prompt_token_ids
        tokens = p if (i + 1) * bs <= len(p) else p + req.output_token_ids
        for j in range(len(names), i + 1):
            names.append(chain_hash(names[j - 1] if j else self.root, tokens[j * bs:(j + 1) * bs]))
        return names[i]

    def match(self, req) -> list[int]:
        """The cached blocks that hold the longest prefix of req's tokens, leaving at least its last
        token to compute (a step must compute something to sample from); [] without caching."""
        hits = []
        if self.caching:
            cached = self.cached
            for i in range((req.num_tokens - 1) // self.block_size):
                b = cached.get(self.block_name(req, i))
                if b is None:
                    break
                hits.append(b)
        return hits

    def match_store(self, req, start: int) -> list[bytes]:
        """Names of req's blocks from block `start` on that the store holds, in a row (the last token
        is always computed, as in match)."""
        names = []
        for i in range(start, (req.num_tokens - 1) // self.block_size):
            name = self.block_name(req, i)
            if name not in self.store:
                break
            names.append(name)
        return names

    def register(self, req) -> None:
        """Name the full blocks of req's table whose KV is computed (num_computed_tokens), once each. A
        block whose name another block already holds stays unnamed (the first copy serves)."""
        full = req.num_computed_tokens // self.block_size
        done = self.registered.get(req.request_id, 0)
        if full <= done:
            return
        table = self.device_tables[req.request_id]
        for i in range(done, full):
            name, b = self.block_name(req, i), table[i]
            if name not in self.cached and b not in self.name_of:
                self.cached[name], self.name_of[b] = b, name
                if self.store is not None and name not in self.store:  # (another instance may have written it)
                    self.new_named.append((b, name))
        self.registered[req.request_id] = full

    def reset_prefix_cache(self) -> int:
        """Forget the cached blocks nobody holds (they become blank); returns how many there were."""
        n = len(self.evictable)
        for b in self.evictable:
            del self.cached[self.name_of.pop(b)]
            self.free_device.append(b)
        self.evictable.clear()
        return n

    def _take(self) -> int:
        """A block for a table: a blank one, else the least recently freed cached one (its name goes)."""
        if self.free_device:
            b = self.free_device.pop()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            del self.cached[self.name_of.pop(b)]
        else:
            raise RuntimeError("no free device block")
        if self.caching:
            self.refs[b] = 1
        return b

    def _take_n(self, n: int) -> list[int]:
        """n blocks, taken as n calls of _take take them (without prefix caching: the top of the free stack, in
        one slice)."""
        if self.caching or n > len(self.free_device):
            return [self._take() for _ in range(n)]
        if n <= 0:
            return []
        free = self.free_device
        taken = free[-n:]
        del free[-n:]
        taken.reverse()
        return taken

    def _release(self, table: list[int]) -> None:
        """Drop a table's references, last block first: a named block nobody holds stays cached, and the
        tail of a sequence is evicted before its head."""
        if not self.caching:
            self.free_device.extend(reversed(table))
            return
        refs = self.refs
        for b in reversed(table):
            refs[b] -= 1
            if refs[b] == 0:
                if b in self.name_of:
                    self.evictable[b] = None
                else:
                    self.free_device.append(b)

    # --- device pool -------------------------------------------------------------------------
    @property
    def usable_device(self) -> int:
        """Device blocks this instance may hold: the pool less the blocks lent out."""
        return self.num_device_blocks - len(self.lent)

    def lend(self, n: int) -> None:
        """Set n free blocks aside (a migration's peer keeps the source's KV or the moved weights there)."""
        if n > self.num_free_device:
            raise RuntimeError(f"lend {n} blocks with {self.num_free_device} free")
        self.lent.extend(self._take_n(n))

    def unlend(self, n: int) -> None:
        """Take n lent blocks back (the peer gave the migrated work back)."""
        if n > len(self.lent):
            raise RuntimeError(f"unlend {n} blocks with {len(self.lent)} lent")
        for _ in range(n):
            b = self.lent.pop()
            if self.caching:
                self.refs[b] = 0
            self.free_device.append(b)

    def grow(self, n: int) -> None:
        """n more blocks: the pool of an instance whose KV per token shrank (part of it is kept elsewhere)."""
        start = self.num_device_blocks
        self.num_device_blocks += n
        self.free_device[:0] = range(start + n - 1, start - 1, -1)  # used after the blocks already free
        if self.caching:
            self.refs.extend([0] * n)

    def allocate(self, req_id: str, num_tokens: int, hits: list[int] = ()) -> list[int]:
        """A table covering num_tokens for a new request: the shared cached blocks `hits` (from match),
        then new ones."""
        if req_id in self.device_tables or req_id in self.host_tables:
            raise ValueError(f"request {req_id} already holds blocks")
        if (n := self._need(num_tokens, hits)) > self.num_free_device:
            raise RuntimeError(f"allocate {n} blocks with {self.num_free_device} free")
        table = list(hits)
        for b in hits:
            if self.refs[b] == 0:
                del self.evictable[b]
            self.refs[b] += 1
        table.extend(self._take_n(self.blocks_needed(num_tokens) - len(hits)))
        self.device_tables[req_id] = table
        if self.caching:
            self.registered[req_id] = len(hits)
        return table

    def append_slots(self, req_id: str, num_tokens: int) -> None:
        """Grow req_id's table so it covers num_tokens tokens."""
        table = self.device_tables[req_id]
        n = self.blocks_needed(num_tokens) - len(table)
        if n > self.num_free_device:
            raise RuntimeError(f"append {n} blocks with {self.num_free_device} free")
        if n == 1:
            table.append(self._take())
        elif n > 0:
            table.extend(self._take_n(n))

    def append_blocks(self, req_ids: list[str]) -> None:
        """One block more at the end of each request's table, in this order (a request may come several times):
        what append_slots taking a block for each in turn does, in one call."""
        if len(req_ids) > self.num_free_device:
            raise RuntimeError(f"append {len(req_ids)} blocks with {self.num_free_device} free")
        tables = self.device_tables
        for rid, b in zip(req_ids, self._take_n(len(req_ids))):
            tables[rid].append(b)

    def free(self, req_id: str) -> None:
        """Return every block req_id holds, on device and host (no-op if it holds none)."""
        self._release(self.device_tables.pop(req_id, []))
        self.registered.pop(req_id, None)
        self.free_host.extend(reversed(self.host_tables.pop(req_id, [])))

    # --- swapping ----------------------------------------------------------------------------
    def can_swap_out(self, req_id: str) -> bool:
        return len(self.device_tables[req_id]) <= self.num_free_host

    def swap_out(self, req_id: str) -> list[tuple[int, int]]:
        """Move req_id's blocks to the host pool; returns (device, host) copy pairs."""
        dev = self.device_tables.pop(req_id)
        if len(dev) > self.num_free_host:
            self.device_tables[req_id] = dev
            raise RuntimeError(f"swap out {len(dev)} blocks with {self.num_free_host} host blocks free")
        host = [self.free_host.pop() for _ in dev]
        self.host_tables[req_id] = host
        self._release(dev)
        self.registered.pop(req_id, None)
        return list(zip(dev, host))

    def can_swap_in(self, req_id: str, extra_tokens_to: int | None = None, spare: int = 0) -> bool:
        """Room to bring req_id back (and, if given, grow it to cover extra_tokens_to tokens), leaving
        `spare` blocks free."""
        return self.swap_in_need(req_id, extra_tokens_to) + spare <= self.num_free_device

    def swap_in_need(self, req_id: str, extra_tokens_to: int | None = None) -> int:
        n = len(self.host_tables[req_id])
        return n if extra_tokens_to is None else max(n, self.blocks_needed(extra_tokens_to))

    def swap_in(self, req_id: str) -> list[tuple[int, int]]:
        """Move req_id's blocks back to the device pool; returns (host, device) copy pairs."""
        host = self.host_tables.pop(req_id)
        if len(host) > self.num_free_device:
            self.host_tables[req_id] = host
            raise RuntimeError(f"swap in {len(host)} blocks with {self.num_free_device} free")
        dev = self._take_n(len(host))
        self.device_tables[req_id] = dev
        if self.caching:
            self.registered[req_id] = 0  # fresh blocks: named again as the request's computed blocks are
        self.free_host.extend(reversed(host))
        return list(zip(host, dev))

    # --- invariants --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every block is free or owned, in each pool: by exactly one table, or with prefix caching by as
        many tables as its reference count says (a cached block nobody holds is free, and named)."""
        for pool, free, tables, total in (
            ("device", self.free_device + list(self.evictable), self.device_tables, self.num_device_blocks),
            ("host", self.free_host, self.host_tables, self.num_host_blocks),
        ):
            owned = [b for t in tables.values() for b in t] + (self.lent if pool == "device" else [])
            if self.caching and pool == "device":
                counts = Counter(owned)
                assert all(self.refs[b] == counts[b] for b in range(total)), "device: a reference count is wrong"
                owned = list(counts)
            everything = owned + free
            assert len(everything) == total, f"{pool}: {len(everything)} blocks accounted for, {total} exist"
            assert set(everything) == set(range(total)), f"{pool}: a block is owned twice or lost"
        assert not set(self.device_tables) & set(self.host_tables), "a request is on device and host at once"
        assert all(self.cached[n] == b for b, n in self.name_of.items()) and len(self.cached) == len(self.name_of), \
            "device: block names and cached blocks disagree"
        assert all(b in self.name_of for b in self.evictable), "device: an unnamed block is kept as cached"
