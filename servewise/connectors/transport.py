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

import torch

from servewise.connectors.shm import crc, discard, map_file


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


class ShmLink:
    """The zero-copy hand-off between instances on one machine (above). A sender's route is the
    transfer's record path; a receiver's, (record path, the sender's cache file)."""

    def __init__(self, cache: torch.Tensor, layers: int):
        self.cache, self.layers = cache, layers
        self.records: dict[str, Record] = {}
        self.peers: dict[str, torch.Tensor] = {}  # senders' cache files, mapped

    def send(self, rid: str, route, layer: int, blocks: list[int], corrupt: bool = False) -> None:
        rec = self.records.get(rid)
        if rec is None:
            rec = self.records[rid] = Record(route, self.layers, blocks)
        # corrupt: the reader's copy will not match the record, as with a bit flipped on the way (the data
        # is not touched: these blocks are the sender's own, and its prefix cache may serve them again)
        rec.publish(layer, crc(self.cache[layer, :, blocks]) ^ (1 if corrupt else 0))

    def sent(self, rid: str) -> list[int] | None:
        """The checksums the receiver must be told (None: it reads them from the record)."""
        return None

    def flush(self) -> None:
        """Send what waits to be sent (nothing waits here)."""

    def waiting(self) -> bool:
        return False

    def forget(self, rid: str) -> None:
        """The transfer has ended: drop its record (the coordinator may have removed it already)."""
        if (rec := self.records.pop(rid, None)) is not None:
            discard(rec.path)

    def receive(self, inc, table: list[int], n_blocks: int) -> None:
        """Copy the layers ready so far into the request's blocks; their CRCs on the copy go to
        inc.sums, the sender's to inc.expected."""
        path, source = inc.route
        if inc.state is None:
            if not os.path.exists(path):
                return
            inc.state = Record(path, self.layers)
        rec, cache = inc.state, self.cache
        src = self.peers.get(source)
        if src is None:
            src = self.peers[source] = map_file(source, tuple(cache.shape), cache.dtype, create=False)
        dst = table[:len(rec.blocks)]
        while inc.copied < rec.ready:
            k = inc.copied
            cache[k, :, dst] = src[k, :, rec.blocks]
            inc.sums.append(crc(cache[k, :, dst]))
            inc.expected[k] = rec.checksum(k)
            inc.copied += 1

    def peer_gone(self) -> None:
        """A sender may have died: unmap the caches whose files the coordinator removed."""
        for path in [p for p in self.peers if not os.path.exists(p)]:
            del self.peers[path]


class GlooLink:
    """The hand-off over torch.distributed's gloo backend, for instances that share no memory
    (different machines). Each pair of instances has its own two-rank process group, formed in the
    background through the coordinator's TCP store (again, named by the new generation, when either
    restarts).
    The sender gathers each layer of the request's blocks into a buffer, sends it tagged with the
    transfer and the layer, and reports the CRCs once all are sent (`sent`); the receiver posts its
    receives when it has blocks, and a thread per transfer waits for them (a gloo receive completes
    only when waited on). A receive from a dead peer fails, and so does the transfer."""

    def __init__(self, cache: torch.Tensor, layers: int, host: str, port: int, index: int, gen: int,
                 timeout_s: float):
        from datetime import timedelta

        from torch.distributed import TCPStore

        self.cache, self.layers, self.index, self.gen = cache, layers, index, gen
        self.names: dict[int, str] = {}  # peer index -> the name of the pair group formed or forming
        self.timeout = timedelta(seconds=timeout_s)
        self.store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
        self.groups: dict[int, tuple] = {}  # peer index -> (process group, the peer's rank in it)
        self.sums: dict[str, list[int]] = {}
        self.outbox: dict[str, list] = {}  # rid -> [(peer, tag, layer, buffer)] until its group is up

    def connect(self, peer: int, gen: int) -> None:
        """Form the pair group with generation `gen` of instance `peer` in the background. Both sides
        call this and name the group by both instances' generations, so a restart on either side (a
        new generation) forms a new one."""
        import threading

        from torch.distributed import PrefixStore, ProcessGroupGloo

        a, b = sorted(((self.index, self.gen), (peer, gen)))
        name = f"kv-{a[0]}.{a[1]}-{b[0]}.{b[1]}"
        if self.names.get(peer) == name:  # formed or forming already
            return
        self.names[peer] = name
        self.groups.pop(peer, None)
        mine = 0 if (self.index, self.gen) == a else 1

        def form():
            try:
                group = ProcessGroupGloo(PrefixStore(name, self.store), mine, 2, self.timeout)
            except RuntimeError:
                return  # the peer never came: its transfers end by their leases
            if self.names.get(peer) == name:
                self.groups[peer] = (group, 1 - mine)
        threading.Thread(target=form, daemon=True).start()

    def _wait(self, works: list, done) -> None:
        """Wait for works in order in a thread; done(k) after the k-th, done(None, error) on a failure."""
        import threading

        def run():
            for k, w in enumerate(works):
                try:
                    w.wait()
                except RuntimeError as e:
                    done(None, str(e).split("\n")[0][:200])
                    return
                done(k)
        threading.Thread(target=run, daemon=True).start()

    def send(self, rid: str, route, layer: int, blocks: list[int], corrupt: bool = False) -> None:
        peer, tag = route
        buf = self.cache[layer, :, blocks].contiguous()
        self.sums.setdefault(rid, []).append(crc(buf))
        if corrupt:
            buf.view(-1)[0] += 1.0
        self.outbox.setdefault(rid, []).append((peer, tag, layer, buf))
        self.flush()

    def flush(self) -> None:
        """Send what waits for a pair group that is up now."""
        for rid, items in list(self.outbox.items()):
            if items[0][0] not in self.groups:
                continue
            peer = items[0][0]
            group, other = self.groups[peer]
            del self.outbox[rid]
            try:
                works = [group.send([buf], other, tag * self.layers + layer) for _, tag, layer, buf in items]
            except RuntimeError:  # the peer closed the group (it died): this transfer ends by its lease
                self._drop(peer, group)
                continue
            self._wait(works, lambda k, err=None, keep=items: None)  # keeps the buffers until sent

    def waiting(self) -> bool:
        """Layers wait for their pair group."""
        return bool(self.outbox)

    def sent(self, rid: str) -> list[int] | None:
        sums = self.sums.get(rid, [])
        return list(sums) if len(sums) == self.layers else None

    def forget(self, rid: str) -> None:
        self.sums.pop(rid, None)
        self.outbox.pop(rid, None)

    def receive(self, inc, table: list[int], n_blocks: int) -> None:
        peer, tag = inc.route
        cache = self.cache
        if inc.state is None:
            if peer not in self.groups:
                return
            group, other = self.groups[peer]
            shape = (2, n_blocks, *cache.shape[3:])
            st = inc.state = {"bufs": [torch.empty(shape, dtype=cache.dtype) for _ in range(self.layers)],
                              "arrived": 0, "error": None}

            def done(k, err=None, st=st):
                if err is not None:
                    st["error"] = f"the KV did not arrive: {err}"
                else:
                    st["arrived"] = k + 1
            try:
                works = [group.recv([b], other, tag * self.layers + k) for k, b in enumerate(st["bufs"])]
            except RuntimeError as e:  # the peer closed the group (it died): the transfer fails
                self._drop(peer, group)
                st["error"] = f"the KV did not arrive: {str(e).splitlines()[0][:200]}"
                raise ValueError(st["error"]) from None
            self._wait(works, done)
        st = inc.state
        dst = table[:n_blocks]
        while inc.copied < st["arrived"]:
            k = inc.copied
            cache[k, :, dst] = st["bufs"][k]
            inc.sums.append(crc(cache[k, :, dst]))
            inc.copied += 1
        if st["error"] is not None and inc.copied < self.layers:
            raise ValueError(st["error"])

    def _drop(self, peer: int, group) -> None:
        """Forget a pair group whose peer has gone, unless a new one has replaced it meanwhile."""
        if self.groups.get(peer, (None,))[0] is group:
            del self.groups[peer]

    def peer_gone(self) -> None:
        """Nothing to do: a restarted peer comes back through `connect`."""
