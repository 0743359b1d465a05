"""The cluster hand-off on real engines: prefill on one, copy the KV blocks, decode on another; the
tokens are those of one engine doing both."""
import pytest

from servewise.builder import build_engine
from servewise.sampling_params import SamplingParams


@pytest.mark.slow
def test_a_request_prefilled_on_one_real_engine_decodes_on_another_token_for_token():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5 + (7 * i) % 300 for i in range(n)] for n in (9, 23, 40)]
    alone = build_engine(model="tiny-llama", num_device_blocks=64, block_size=4)
    want = []
    for p in prompts:
        req = alone.add_request(p, params)
        while alone.has_unfinished():
            alone.step()
        want.append(req.output_token_ids)

    a = build_engine(model="tiny-llama", num_device_blocks=64, block_size=4)
    b = build_engine(model="tiny-llama", num_device_blocks=64, block_size=4)
    b.add_request([1, 2, 3], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))  # b is busy already
    b.step()
    reqs = [a.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    for r in reqs:
        r.handoff = True
    stats = a.step()
    assert sorted(stats.handed_off) == ["r0", "r1", "r2"] and not a.has_unfinished()
    assert a.committed_blocks == sum(len(a.block_manager.device_tables[r.request_id]) for r in reqs)
    for r in reqs:
        b.receive(r)
    assert sorted(b.reserve_incoming()) == ["r0", "r1", "r2"]
    for r in reqs:  # the transfer: every layer's K and V of the request's blocks
        src = a.block_manager.device_tables[r.request_id]
        dst = b.block_manager.device_tables[r.request_id]
        b.runner.device_cache[:, :, dst[:len(src)]] = a.runner.device_cache[:, :, src]
        a.release(r.request_id)
        b.kv_arrived(r.request_id)
    assert a.block_manager.num_free_device == 64 and a.committed_blocks == 0
    while b.has_unfinished():
        b.step()
    assert [r.output_token_ids for r in reqs] == want
    assert b.committed_blocks == 0 and not b.requests


# --- the protocol: nothing leaks, nothing decodes from wrong data ------------------------------------
from servewise.cluster.handoff import HandoffBook, State, combine, layer_checksum, settle  # noqa: E402

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT = [5 + (11 * i) % 300 for i in range(30)]


def _pair():
    a = build_engine(model="tiny-llama", num_device_blocks=32, block_size=4)
    b = build_engine(model="tiny-llama", num_device_blocks=32, block_size=4)
    req = a.add_request(PROMPT, PARAMS, request_id="r")
    req.handoff = True
    assert a.step().handed_off == ["r"]
    b.receive(req)
    assert b.reserve_incoming() == ["r"]
    return a, b, req


def _send(book, a, b, rid, now, layers=None, corrupt=False):
    """Copy layer by layer, as a transport would; returns the transfer id, committed when all went."""
    src, dst = a.block_manager.device_tables[rid], b.block_manager.device_tables[rid]
    n = a.model_config.num_layers
    t = book.begin(rid, n, now)
    sums = []
    for k in range(n if layers is None else layers):
        b.runner.device_cache[k, :, dst[:len(src)]] = a.runner.device_cache[k, :, src]
        sums.append(layer_checksum(a.runner.device_cache, k, src))
        book.layer_sent(t.id, k, now)
    if corrupt:
        b.runner.device_cache[1, 0, dst[0], 0, 0, 0] += 1.0  # one value flipped on the way
    if layers is None:
        book.commit(t.id, combine(sums))
    return t.id, dst[:len(src)]


def _finish(b, req):
    while b.has_unfinished():
        b.step()
    return req.output_token_ids


@pytest.fixture(scope="module")
def want():
    alone = build_engine(model="tiny-llama", num_device_blocks=32, block_size=4)
    return _finish(alone, alone.add_request(PROMPT, PARAMS))


@pytest.mark.parametrize("fault", ["none", "corrupted", "sender stops", "token side aborts"])
def test_a_hand_off_never_leaks_blocks_nor_decodes_wrong_data(fault, want):
    a, b, req = _pair()
    book = HandoffBook(lease_s=2.0)
    if fault == "none":
        tid, blocks = _send(book, a, b, "r", 0.0)
        assert settle(book, tid, a, b, b.runner.device_cache, blocks)
    elif fault == "corrupted":
        tid, blocks = _send(book, a, b, "r", 0.0, corrupt=True)
        assert not settle(book, tid, a, b, b.runner.device_cache, blocks)  # checksum differs: recompute
    elif fault == "sender stops":
        tid, _ = _send(book, a, b, "r", 0.0, layers=2)  # 2 of 4 layers, then nothing
        assert book.expire(1.9) == [] and [t.id for t in book.expire(2.0)] == [tid]
        assert book.transfers[tid].state is State.EXPIRED
        with pytest.raises(ValueError, match="has ended"):
            book.layer_sent(tid, 2, 2.1)  # a late layer is refused
        assert not settle(book, tid, a, b)
    else:  # the token side gives the request up: the prompt side must still free its blocks
        tid, _ = _send(book, a, b, "r", 0.0, layers=1)
        book.abort(tid, "token instance aborted the request")
        assert b.abort_request("r")
        settle(book, tid, a, None)
    assert a.block_manager.num_free_device == 32 and a.committed_blocks == 0 and not a.handoff.held
    if fault == "token side aborts":
        assert req.finish_reason == "abort"
    else:
        assert _finish(b, req) == want  # right tokens, from the KV or recomputed
    assert b.block_manager.num_free_device == 32 and b.committed_blocks == 0 and not b.requests


def test_a_book_keeps_its_live_transfers_and_only_the_latest_ended_ones():
    book = HandoffBook(lease_s=1.0, keep_ended=5)
    live = book.begin("keep", 4, 0.0, leased=False)
    for i in range(40):
        book.abort(book.begin(f"r{i}", 4, 0.0).id, "done")
    assert live.id in book.transfers and book.live == {live.id}
    assert 1 + 5 <= len(book.transfers) <= 1 + 5 + 1 and "r39#41" in book.transfers and "r0#2" not in book.transfers
    assert book.expire(1e9) == []  # not leased until renewed
    book.renew(live.id, 0.0)
    assert [t.id for t in book.expire(2.0)] == [live.id] and not book.live


def test_a_value_flipped_on_the_way_leaves_the_senders_blocks_as_they_were(tmp_path):
    """The shared-memory link's injected corruption: the receiver's copy fails its checksum, and the sender's
    blocks stay as computed (its prefix cache serves them to the next prompt that shares them; damaging them
    there answered a later request of the chaos bench with wrong tokens)."""
    import torch

    from servewise.cluster.instance import Incoming
    from servewise.connectors.shm import map_file
    from servewise.connectors.transport import ShmLink

    shape = (3, 2, 4, 4, 1, 8)  # layer, K/V, block, slot, KV head, head dim
    cache_file, record = str(tmp_path / "cache-a"), str(tmp_path / "r.rec")
    src = map_file(cache_file, shape, torch.float32, create=True)
    src.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    before = src.clone()
    sender, receiver = ShmLink(src, 3), ShmLink(torch.zeros(shape), 3)
    for k in range(3):
        sender.send("r", record, k, [1, 2], corrupt=k == 1)
    assert torch.equal(src, before)
    inc = Incoming((record, cache_file), 3)
    receiver.receive(inc, [3, 0], 2)
    assert inc.copied == 3 and [s == e for s, e in zip(inc.sums, inc.expected)] == [True, False, True]
    assert torch.equal(receiver.cache[:, :, [3, 0]], before[:, :, [1, 2]])  # the data itself came through
