"""Arrival processes, the loaders on the real files (row counts from the data README), presets."""
import numpy as np
import pytest

from servewise.models.tokenizer import ByteTokenizer
from servewise.workloads import PRESETS, arrival_times, preset_workload
from servewise.workloads.datasets import load_arxiv, load_azure_trace, load_lengths_csv, load_sharegpt

TOK = ByteTokenizer(32000, 1, 2)


def test_arrival_processes():
    assert arrival_times(3) == [0.0, 0.0, 0.0]
    p = np.diff([0.0] + arrival_times(20000, "poisson", rate=4.0, seed=1))
    assert p.mean() == pytest.approx(0.25, rel=0.03) and p.std() / p.mean() == pytest.approx(1.0, rel=0.05)
    g = np.diff([0.0] + arrival_times(20000, "gamma", rate=4.0, cv=3.0, seed=1))
    assert g.mean() == pytest.approx(0.25, rel=0.06) and g.std() / g.mean() == pytest.approx(3.0, rel=0.1)
    assert arrival_times(5, "poisson", rate=2.0, seed=7) == arrival_times(5, "poisson", rate=2.0, seed=7)
    assert arrival_times(3, "trace", timestamps=[10.0, 10.5, 12.0, 99.0]) == [0.0, 0.5, 2.0]


@pytest.mark.parametrize("kw", [dict(process="poisson"), dict(process="poisson", rate=0), dict(process="x", rate=1),
                                dict(process="gamma", rate=1, cv=0), dict(process="trace", timestamps=[1.0])])
def test_arrival_processes_reject_bad_input(kw):
    with pytest.raises(ValueError):
        arrival_times(2, **kw)


def test_azure_trace(data_dir):
    reqs = load_azure_trace(f"{data_dir}/AzureLLMInferenceTrace_conv.csv.gz")
    assert len(reqs) == 19366
    assert reqs[0].arrival == 0.0 and reqs[0].prompt_len == 374 and reqs[0].output_len == 44
    assert reqs[1].arrival == pytest.approx(4.314579, abs=1e-6)  # 18:15:50.9951690 - 18:15:46.6805900
    assert reqs[-1].arrival == pytest.approx(3502, abs=1)
    assert np.mean([r.output_len for r in reqs]) == pytest.approx(211, abs=1)


def test_sharegpt_pairs(data_dir):
    reqs = load_sharegpt(f"{data_dir}/sharegpt_v3_first_turn_pairs.jsonl.gz", TOK)
    assert len(reqs) == 17366
    assert reqs[0].prompt.startswith("Summarize the main ideas of Jeff Walker")
    assert reqs[0].prompt_len == len(TOK.encode(reqs[0].prompt))


def test_arxiv_and_length_csv(data_dir):
    arx = load_arxiv(f"{data_dir}/apex_arxiv_summarization_llama_rate0.5.jsonl.gz")
    assert len(arx) == 1302 and arx[0].output_len == 79 and arx[0].prompt_len == 2457
    assert all(b.arrival >= a.arrival for a, b in zip(arx, arx[1:]))
    vid = load_lengths_csv(f"{data_dir}/vidur_arxiv_summarization_stats_llama2.csv.gz")
    assert len(vid) == 28257 and (vid[0].prompt_len, vid[0].output_len) == (3772, 54)


def test_loader_names_missing_columns(tmp_path):
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="ContextTokens"):
        load_azure_trace(str(bad))


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_reproducible_and_near_the_paper_means(name, data_dir):
    for d in (None, data_dir):
        w = preset_workload(name, 400, TOK, 32000, seed=3, data_dir=d, max_output_len=128)
        assert w == preset_workload(name, 400, TOK, 32000, seed=3, data_dir=d, max_output_len=128)
        lens = [r.prompt_len for r in w]
        assert np.mean(lens) == pytest.approx(PRESETS[name].mean_in, rel=0.15)
        assert all(len(r.prompt) == r.prompt_len and 1 <= r.output_len <= 128 for r in w)
    assert preset_workload(name, 50, TOK, 32000, seed=4) != preset_workload(name, 50, TOK, 32000, seed=5)
