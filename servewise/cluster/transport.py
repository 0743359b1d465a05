"""KV transfer of real tensors between instances on one machine, without a copy on the sending side.

Each instance of a split cluster keeps its device KV cache in a file of the cluster's directory under
/dev/shm (memory, not disk), so that another instance can map it. A hand-off then costs the prompt
instance only a checksum per layer: it publishes, in a small record file per transfer, the request's
block ids, and then each layer's CRC-32 and the count of layers ready (during the prompt's forward
pass, layer by layer, or after the step); the token instance copies each ready layer straight from
the prompt instance's blocks into its own and checks the CRC on its copy. The prompt instance holds
those blocks until the transfer ends, so what the checksum covers cannot change while it is read;
a copy that does not match (a stale reader, a bit flipped) is never decoded from.

The record's count is written after the layer's CRC, and each after its data (stores land in
program order on x86), so a reader that sees the count also sees the rest. The coordinator owns the
directory: it removes a record when its transfer ends and the whole directory when the cluster
stops, so a crashed instance leaves no memory behind.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import zlib

import torch


def make_dir() -> str:
    """A fresh directory for a cluster's shared files, in memory where the system has /dev/shm."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="servewise-kv-", dir=base)


def remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def map_file(path: str, shape: tuple[int, ...], dtype: torch.dtype, create: bool) -> torch.Tensor:
    """A tensor backed by a shared file (created, zeroed, when `create`)."""
    n = 1
    for d in shape:
        n *= d
    size = n * torch.empty((), dtype=dtype).element_size()
    if create:
        with open(path, "wb") as f:
            f.truncate(size)
    elif os.path.getsize(path) != size:
        raise ValueError(f"{path}: {os.path.getsize(path)} bytes, {size} expected")
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8).view(dtype).view(shape)


class Record:
    """One transfer's record: [layers ready, blocks, CRC per layer..., block ids...] as int64."""

    def __init__(self, path: str, layers: int, blocks: list[int] | None = None):
        """blocks given: create it (atomically: a reader never sees a record without its block ids)."""
        self.path, self.layers = path, layers
        if blocks is not None:
            tmp = path + ".new"
            raw = map_file(tmp, (2 + layers + len(blocks),), torch.int64, create=True)
            raw[1] = len(blocks)
            raw[2 + layers:] = torch.tensor(blocks, dtype=torch.int64)
            os.rename(tmp, path)
        else:
            n = (os.path.getsize(path) // 8) - 2 - layers
            raw = map_file(path, (2 + layers + n,), torch.int64, create=False)
            if int(raw[1]) != n:
                raise ValueError(f"{path}: {int(raw[1])} blocks recorded, room for {n}")
        self.raw = raw
        self.blocks = raw[2 + layers:].tolist()

    @property
    def ready(self) -> int:
        return int(self.raw[0])

    def checksum(self, layer: int) -> int:
        return int(self.raw[2 + layer])

    def publish(self, layer: int, checksum: int) -> None:
        """Layer `layer` (in order) is in the sender's blocks, with this CRC."""
        if layer != self.ready:
            raise ValueError(f"{self.path}: layer {layer} published, layer {self.ready} expected")
        self.raw[2 + layer] = checksum
        self.raw[0] = layer + 1
