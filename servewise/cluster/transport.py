"""KV transfer of real tensors between instances on one machine: one shared-memory segment per
transfer, written layer by layer by the prompt instance and read layer by layer by the token
instance, with no message per layer.

A segment is a file in the cluster's directory under /dev/shm (memory, not disk), mapped by both
processes. Its header holds the number of layers written so far and each written layer's CRC-32;
the writer fills a layer's data, then its checksum, then the count (stores land in program order on
x86), so a reader that sees the count also sees the data. The reader copies a layer into its own
blocks and checks the CRC on the copy: what it decodes from is what the writer checksummed.

The cluster's coordinator owns the directory and removes a segment when its transfer ends, and the
whole directory when the cluster stops, so a crashed instance cannot leave memory behind.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import zlib

import torch

HEADER_INTS = 2  # layers written, bytes per layer; then one CRC per layer


def make_dir() -> str:
    """A fresh directory for a cluster's segments, in memory where the system has /dev/shm."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="servewise-kv-", dir=base)


def remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


class Segment:
    """One transfer's KV: `layers` x [2, blocks, block_size, kv heads, head dim] of `dtype`."""

    def __init__(self, path: str, layers: int, shape: tuple[int, ...], dtype: torch.dtype, create: bool):
        self.path, self.layers, self.shape = path, layers, tuple(shape)
        n = 1
        for d in shape:
            n *= d
        self.layer_bytes = n * torch.empty((), dtype=dtype).element_size()
        head = (HEADER_INTS + layers) * 8
        size = head + layers * self.layer_bytes
        if create:
            with open(path, "wb") as f:
                f.truncate(size)
        elif os.path.getsize(path) != size:
            raise ValueError(f"segment {path}: {os.path.getsize(path)} bytes, {size} expected")
        raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.header = raw[:head].view(torch.int64)
        self.data = raw[head:].view(dtype).view(layers, *shape)
        if create:
            self.header[1] = self.layer_bytes
        elif int(self.header[1]) != self.layer_bytes:
            raise ValueError(f"segment {path}: layers of {int(self.header[1])} bytes, {self.layer_bytes} expected")

    @property
    def written(self) -> int:
        return int(self.header[0])

    def write(self, layer: int, kv: torch.Tensor) -> None:
        """Layer `layer` (in order) of the request's KV: [2, blocks, ...] gathered from the cache."""
        if layer != self.written:
            raise ValueError(f"segment {self.path}: layer {layer} written, layer {self.written} expected")
        self.data[layer].copy_(kv)
        self.header[HEADER_INTS + layer] = crc(self.data[layer])
        self.header[0] = layer + 1

    def checksum(self, layer: int) -> int:
        return int(self.header[HEADER_INTS + layer])
