"""`bench splitwisesim`: SplitwiseSim's per-request results read back, and servewise run on the same trace."""
import json
import os

import numpy as np
import pytest

from servewise.bench.splitwisesim import Settings, main


def sim_dir(tmp_path, n=24):
    """A SplitwiseSim folder as its runs leave it: a trace, and the per-request CSV of a run on it."""
    rng = np.random.default_rng(0)
    (tmp_path / "traces").mkdir()
    arrivals = np.cumsum(rng.exponential(0.5, n))
    prompts, outputs = rng.integers(16, 512, n), rng.integers(4, 64, n)
    with open(tmp_path / "traces" / "t.csv", "w") as f:
        f.write("request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size\n")
        for i in range(n):
            f.write(f"{i},2,0,{arrivals[i]},1,{prompts[i]},{outputs[i]}\n")
    out = tmp_path / "results" / "0" / "splitwise_2_1" / "t" / "3_0" / "bloom-176b" / "mixed_pool" / "detailed"
    out.mkdir(parents=True)
    ttft, e2e = rng.uniform(0.1, 1.0, n), rng.uniform(2.0, 9.0, n)
    with open(out / "0.csv", "w") as f:
        f.write("request_ids,response_times,queue_times,ttft_times,tbt_times\n")
        for i in range(n):
            f.write(f"{i},{e2e[i]},0.0,{ttft[i]},{(e2e[i] - ttft[i]) / outputs[i]}\n")
    return tmp_path, ttft, e2e


def test_reads_splitwisesim_and_compares_a_servewise_run(tmp_path):
    d, ttft, e2e = sim_dir(tmp_path)
    out = str(tmp_path / "cmp.json")
    res = main(Settings(sim_dir=str(d), trace="t", prompt_machines=2, token_machines=1, assumptions=("splitwisesim",),
                        perf_table=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "splitwise",
                                                "perf_model.csv.gz"), out=out))
    ref = res["splitwisesim"]
    assert ref["requests"] == 24 and ref["wall_s"] is None  # not run here: its results read back
    assert ref["ttft_p90_s"] == pytest.approx(np.percentile(ttft, 90))
    assert ref["e2e_p99_s"] == pytest.approx(np.percentile(e2e, 99))
    row = res["servewise"]["splitwisesim"]
    assert row["requests"] + row["rejected"] == 24 and row["wall_s"] > 0
    assert row["differs"]["e2e_p50_s"] == pytest.approx(row["e2e_p50_s"] / ref["e2e_p50_s"] - 1)
    saved = json.load(open(out))
    assert saved["servewise"]["splitwisesim"]["ttft_p50_s"] == row["ttft_p50_s"] and "provenance" in saved
    assert "SPLITWISESIM_DIR" in saved["settings"]["sim_dir"]  # no machine path in what is kept


def test_bad_input_is_one_line(tmp_path):
    d, _, _ = sim_dir(tmp_path)
    with pytest.raises(ValueError, match="no trace"):
        main(Settings(sim_dir=str(d), trace="missing", assumptions=()))
    with pytest.raises(ValueError, match="no SplitwiseSim results"):
        main(Settings(sim_dir=str(d), trace="t", prompt_machines=27, token_machines=13, assumptions=()))
    with pytest.raises(ValueError, match="no SplitwiseSim results"):  # 2 + 1 is not 2 + 11's folder
        os.rename(d / "results" / "0" / "splitwise_2_1", d / "results" / "0" / "splitwise_2_11")
        main(Settings(sim_dir=str(d), trace="t", prompt_machines=2, token_machines=1, assumptions=()))
    with pytest.raises(ValueError, match="unknown --assumptions"):
        main(Settings(sim_dir=str(d), trace="t", assumptions=("vidur",)))
