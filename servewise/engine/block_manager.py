"""Paged KV-cache bookkeeping: a device pool, a host pool, per-request block tables.

It never touches tensors. Swaps return plans (lists of (src, dst) block-id pairs) that a runner
executes, so the same object serves the real engine and the simulator.
"""
from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int, watermark: float = 0.0):
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.watermark_blocks = int(watermark * num_device_blocks)
        # free lists are stacks: the most recently freed block is reused first
        self.free_device: list[int] = list(range(num_device_blocks - 1, -1, -1))
        self.free_host: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.device_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}

    # --- queries -----------------------------------------------------------------------------
    @property
    def num_free_device(self) -> int:
        return len(self.free_device)

    @property
    def num_free_host(self) -> int:
        return len(self.free_host)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Room for a new request of num_tokens, keeping the admission watermark free."""
        return self.blocks_needed(num_tokens) <= self.num_free_device - self.watermark_blocks

    def new_blocks_for(self, req_id: str, num_tokens: int) -> int:
        """Blocks req_id must gain so that its table covers num_tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(self.device_tables[req_id]))

    # --- device pool -------------------------------------------------------------------------
    def allocate(self, req_id: str, num_tokens: int) -> list[int]:
        if req_id in self.device_tables or req_id in self.host_tables:
            raise ValueError(f"request {req_id} already holds blocks")
        n = self.blocks_needed(num_tokens)
        if n > self.num_free_device:
            raise RuntimeError(f"allocate {n} blocks with {self.num_free_device} free")
        table = [self.free_device.pop() for _ in range(n)]
        self.device_tables[req_id] = table
        return table

    def append_slots(self, req_id: str, num_tokens: int) -> None:
        """Grow req_id's table so it covers num_tokens tokens."""
        table = self.device_tables[req_id]
        n = self.blocks_needed(num_tokens) - len(table)
        if n > self.num_free_device:
            raise RuntimeError(f"append {n} blocks with {self.num_free_device} free")
        for _ in range(n):
            table.append(self.free_device.pop())

    def free(self, req_id: str) -> None:
        """Return every block req_id holds, on device and host (no-op if it holds none)."""
        self.free_device.extend(reversed(self.device_tables.pop(req_id, [])))
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
        self.free_device.extend(reversed(dev))
        return list(zip(dev, host))

    def can_swap_in(self, req_id: str, extra_tokens_to: int | None = None) -> bool:
        """Room to bring req_id back (and, if given, grow it to cover extra_tokens_to tokens)."""
        n = len(self.host_tables[req_id])
        if extra_tokens_to is not None:
            n = max(n, self.blocks_needed(extra_tokens_to))
        return n <= self.num_free_device

    def swap_in(self, req_id: str) -> list[tuple[int, int]]:
        """Move req_id's blocks back to the device pool; returns (host, device) copy pairs."""
        host = self.host_tables.pop(req_id)
        if len(host) > self.num_free_device:
            self.host_tables[req_id] = host
            raise RuntimeError(f"swap in {len(host)} blocks with {self.num_free_device} free")
        dev = [self.free_device.pop() for _ in host]
        self.device_tables[req_id] = dev
        self.free_host.extend(reversed(host))
        return list(zip(host, dev))

    # --- invariants --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every block is either free or owned by exactly one table, in each pool."""
        for pool, free, tables, total in (
            ("device", self.free_device, self.device_tables, self.num_device_blocks),
            ("host", self.free_host, self.host_tables, self.num_host_blocks),
        ):
            owned = [b for t in tables.values() for b in t]
            everything = owned + free
            assert len(everything) == total, f"{pool}: {len(everything)} blocks accounted for, {total} exist"
            assert set(everything) == set(range(total)), f"{pool}: a block is owned twice or lost"
        assert not set(self.device_tables) & set(self.host_tables), "a request is on device and host at once"
