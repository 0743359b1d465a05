"""The KV store over the network (`servewise kv-store`, `--kv-store tcp://HOST:PORT`): entries cross
whole and checked; an entry damaged on the server is dropped and reads as a miss; a key keeps strangers
out; a server that is down costs hits, never a request, and is reached again when it is back; engines
that share it by address get the tokens of one engine and fetch instead of computing."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from servewise import LLM
from servewise.connectors.kv_store import entry_file
from servewise.connectors.store_server import RemoteKVStore, StoreServer, parse_address
from test_kv_store import GREEDY, SHAPE, FakeClock, block, prompts, run


def serve(tmp_path, **kw) -> StoreServer:
    return StoreServer(str(tmp_path / "mem"), 1 << 20, **kw).start()


def test_addresses_are_checked():
    assert parse_address("tcp://10.0.0.5:7077") == ("10.0.0.5", 7077)
    assert parse_address("tcp://[::1]:80") == ("::1", 80)
    for bad in ("10.0.0.5:7077", "tcp://host", "tcp://:7077", "tcp://host:0", "tcp://host:99999", "tcp://h:x"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            parse_address(bad)


def test_entries_cross_whole_and_checked(tmp_path):
    s = serve(tmp_path)
    c = RemoteKVStore(s.url, SHAPE, torch.float32, timeout=5)
    assert c.connected
    name, kv = b"n" * 16, block(1)
    assert name not in c and c.open(name) is None
    assert c.put(name, kv) and not c.put(name, kv)  # written once
    assert name in c and c.tier(name) == "memory"
    e = c.open(name)
    assert torch.equal(torch.stack([e.layer(i) for i in range(SHAPE[0])]), kv)
    assert c.stats["puts"] == 1 and c.stats["hits"] == 1 and c.stats["misses"] == 1
    e.raw[-1] ^= 0xFF  # damaged on the way: the last layer fails its check
    assert e.layer(0) is not None and e.layer(SHAPE[0] - 1) is None
    with pytest.raises(ValueError, match="this store holds"):
        c.put(b"m" * 16, torch.zeros(3))
    # damaged in the server's file: the server's check drops it, the client reads a miss
    path = entry_file(os.path.join(str(tmp_path / "mem"), "x".join(map(str, SHAPE)) + "-float32"), name)
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    assert c.open(name) is None and name not in c
    assert c.server_stats()["corrupt"] == 1
    # a second shape gets a store of its own beside the first
    other = RemoteKVStore(s.url, (1, 2, 4, 1, 8), torch.bfloat16)
    assert other.put(name, torch.ones((1, 2, 4, 1, 8), dtype=torch.bfloat16)) and name not in c
    s.close()


def test_a_key_keeps_strangers_out(tmp_path):
    s = serve(tmp_path, key=b"secret")
    stranger = RemoteKVStore(s.url, SHAPE, torch.float32, key=b"guess")
    assert not stranger.connected and not stranger.put(b"n" * 16, block(1)) and stranger.open(b"n" * 16) is None
    assert s.refused >= 1
    friend = RemoteKVStore(s.url, SHAPE, torch.float32, key=b"secret")
    assert friend.connected and friend.put(b"n" * 16, block(1)) and b"n" * 16 in friend
    s.close()


def test_a_store_that_is_down_reads_as_empty_until_it_is_back(tmp_path):
    s = serve(tmp_path)
    port = s.address[1]
    clock = FakeClock()  # when to try the server again: moved by hand, so no sleep and no race with RETRY_S
    c = RemoteKVStore(s.url, SHAPE, torch.float32, timeout=60, clock=clock)
    assert c.put(b"a" * 16, block(1))
    s.close()
    t0 = time.monotonic()
    assert b"a" * 16 not in c and not c.put(b"b" * 16, block(2)) and c.open(b"a" * 16) is None
    # the first call found the connection gone; the others, within RETRY_S of it, did not try the way again
    assert c.stats["unreachable"] == 1 and c.stats["put_errors"] == 1 and c.stats["misses"] == 1, c.stats
    # no waiting on a store that is gone: a call that waited out the client's timeout would take 60 s
    # (the bound only tells the two apart; three calls to this machine take milliseconds)
    assert time.monotonic() - t0 < 30
    back = StoreServer(str(tmp_path / "mem"), 1 << 20, port=port).start()  # its entries are in its directory still
    clock.advance(c.RETRY_S - 0.01)
    assert b"a" * 16 not in c and c.stats["unreachable"] == 1  # not tried again before RETRY_S
    clock.advance(0.02)
    assert b"a" * 16 in c and c.open(b"a" * 16) is not None  # tried again, and reached
    assert c.stats["unreachable"] == 1
    back.close()


@pytest.mark.slow
def test_engines_share_a_store_by_address(tmp_path):
    reference = [o.token_ids for o in LLM("tiny-llama", device="cpu").generate(prompts(), GREEDY)]
    s = serve(tmp_path)
    engines = [LLM("tiny-llama", device="cpu", enable_prefix_caching=True, kv_store=s.url,
                   kv_store_fetch="always").engine for _ in range(2)]
    assert run(engines[0], prompts()[:1]) == reference[:1]
    assert run(engines[1], prompts()[1:]) == reference[1:]  # its own empty pool: the prefix comes over the way
    assert engines[1].stats().store_hit_tokens >= 48 and engines[1].runner.store.stats["hits"] >= 3
    s.close()


def test_the_command(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "servewise", "kv-store", "--port", "0", "--dir", str(tmp_path / "m")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("KV store at tcp://127.0.0.1:"), line + p.stderr.read()
        c = RemoteKVStore(line.split()[3], SHAPE, torch.float32)
        assert c.put(b"n" * 16, block(1)) and b"n" * 16 in c
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0
    finally:
        p.kill()
    bad = subprocess.run([sys.executable, "-m", "servewise", "generate", "--model", "tiny-llama", "--prompt", "hi",
                          "--enable-prefix-caching", "--kv-store", "tcp://nowhere"], capture_output=True, text=True)
    assert bad.returncode == 2 and "tcp://HOST:PORT" in bad.stderr and "Traceback" not in bad.stderr
