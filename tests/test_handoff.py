"""The cluster hand-off on real engines: prefill on one, copy the KV blocks, decode on another; the
tokens are those of one engine doing both."""
from servewise.builder import build_engine
from servewise.sampling_params import SamplingParams


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
