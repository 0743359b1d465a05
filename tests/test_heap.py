"""A serving process's heap: free chunks given back, kernels counted by shape, the engine loop trimming
after steps that built kernels and every few seconds."""
import logging
import multiprocessing as mp
import threading

import pytest
import torch

from servewise.engine.heap import TrimSchedule, _resident_bytes, release_free_heap
from servewise.models import linear
from servewise.runners.torch_runner import keep_freed_memory
from servewise.sampling_params import SamplingParams
from servewise.server.engine_loop import engine_main, single_engine


def test_free_heap_chunks_go_back_to_the_system():
    if "kept" not in keep_freed_memory():  # large blocks from the heap, kept when freed: as in the engine
        pytest.skip("no glibc malloc here")
    blocks = [bytearray(b"\x01") * (1 << 20) for _ in range(64)]  # 64 MiB written, so resident
    held = _resident_bytes()
    del blocks
    assert _resident_bytes() > held - (16 << 20)  # freed, but the kept heap holds the pages
    assert release_free_heap() >= 32 << 20


def test_trims_fall_due_on_new_kernel_shapes_and_at_most_every_interval_otherwise():
    due = TrimSchedule(10.0, now=100.0, shapes=5)
    assert [due.due(t, 5) for t in (101.0, 109.9)] == [False, False]
    assert due.due(110.0, 5)  # ten seconds since the start's trim
    assert not due.due(115.0, 5)
    assert due.due(116.0, 7) and due.shapes == 7  # new shapes: at once, and the interval counts from here
    assert not due.due(125.0, 7)
    assert due.due(126.0, 7)


@pytest.mark.skipif(not linear.packing_available(torch.zeros(1)), reason="no prepacked oneDNN weights here")
def test_kernel_shapes_count_row_counts_after_padding(monkeypatch):
    monkeypatch.setattr(linear, "PANELS_ON_THIS_CPU", False)  # (fp32 weights: oneDNN's path, not the panel kernel)
    lin = linear.Linear(torch.randn(24, 40))
    before = linear.kernel_shapes()
    lin(torch.randn(3, 40))
    lin(torch.randn(3, 40))
    assert linear.kernel_shapes() == before + 1
    lin(torch.randn(70, 40))
    lin(torch.randn(75, 40))  # both padded to 80 rows: one kernel
    assert linear.kernel_shapes() == before + 2
    linear.Linear(torch.randn(24, 40))(torch.randn(3, 40))  # another weight of the same shape: the same kernel
    assert linear.kernel_shapes() == before + 2


@pytest.mark.skipif(not linear.packing_available(torch.zeros(1)), reason="no prepacked oneDNN weights here")
def test_the_engine_loop_returns_the_free_heap_after_steps_that_built_kernels(caplog, monkeypatch):
    monkeypatch.setattr(linear, "PANELS_ON_THIS_CPU", False)  # (fp32 weights: oneDNN's path, not the panel kernel)
    level = logging.getLogger("servewise").level  # engine_main sets it; put back after
    cmds_out, cmds_in = mp.Pipe()
    outs_in, outs_out = mp.Pipe()
    loop = threading.Thread(target=engine_main, args=(
        {"model": "tiny-llama", "num_device_blocks": 64, "seed": 0, "device": "cpu"}, torch.get_num_threads(), None,
        single_engine, logging.DEBUG, cmds_out, outs_in), daemon=True)
    linear._KERNEL_SHAPES.clear()  # every shape new to the loop, whatever earlier tests ran in this process
    with caplog.at_level(logging.DEBUG, logger="servewise"):
        loop.start()
        assert outs_out.recv()[0] == "ready"
        seen = linear.kernel_shapes()
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        cmds_in.send(("add", "a", list(range(5, 5 + 263)), params))
        finished, trims = False, []
        while not finished:
            msg = outs_out.recv()
            assert msg[0] == "out", msg
            finished = any(o[3] for o in msg[1])  # (rid, new ids, logprobs, finished, reason)
            trims.append(msg[2].heap_trims)
        cmds_in.send(("add", "b", [5, 6], params))  # its report carries the trims after "a"'s steps
        while (msg := outs_out.recv()) and not any(o[3] for o in msg[1]):
            trims.append(msg[2].heap_trims)
        trims.append(msg[2].heap_trims)
        cmds_in.send(("stop",))
        loop.join(30)
    logging.getLogger("servewise").setLevel(level)
    assert not loop.is_alive() and linear.kernel_shapes() > seen
    assert any("kernel shapes;" in r.getMessage() and "MiB of free heap returned" in r.getMessage()
               for r in caplog.records)
    # the reports count the trims: one at start, then one after each step that built new kernels
    logged = sum("MiB of free heap returned" in r.getMessage() for r in caplog.records)
    assert trims[0] >= 1 and trims == sorted(trims) and trims[-1] == 1 + logged
