"""Files in shared memory and checksums: what moves KV between processes on one machine (the hand-off
transport, the KV store) stands on these."""
from __future__ import annotations

import math
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


def discard(path: str) -> None:
    """Remove a file that may be gone already."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def map_file(path: str, shape: tuple[int, ...], dtype: torch.dtype, create: bool) -> torch.Tensor:
    """A tensor backed by a shared file (created, zeroed, when `create`)."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if create:
        with open(path, "wb") as f:
            f.truncate(size)
    elif os.path.getsize(path) != size:
        raise ValueError(f"{path}: {os.path.getsize(path)} bytes, {size} expected")
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8).view(dtype).view(shape)


def crc(t) -> int:
    """CRC-32 of a tensor's bytes."""
    return zlib.crc32(t.contiguous().cpu().view(torch.uint8).numpy())
