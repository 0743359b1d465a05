"""Every bad input a user can type or a file can hold: one line naming it, exit status 2, no
traceback; nothing changed silently. Then fuzzing of the loaders and the command line."""
import gzip
import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servewise.cli import main
from servewise.workloads.datasets import load_azure_trace, load_splitwise_trace, load_trace

from conftest import refused

HDR = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:15:46.6805900,{},{}\n"


def run(argv, tmp_path):
    """(exit status, the path of the JSON it was told to write)."""
    out = tmp_path / "out.json"
    out.unlink(missing_ok=True)
    try:
        main([*argv, "--out", str(out)])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, out


def simulate(*extra):
    return ["simulate", "--model", "llama-2-13b", "--hardware", "h100-80g", *extra]


def write(tmp_path, name, text):
    p = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(p, "wt") as f:
            f.write(text)
    else:
        p.write_text(text)
    return str(p)


@pytest.mark.parametrize("case, message", [
    (lambda d: ["--workload", "azure", "--data", str(d / "missing.csv")], "missing.csv: no such file"),
    (lambda d: ["--workload", "azure", "--data", str(d)], "a directory, not a data file"),
    (lambda d: ["--workload", "azure", "--data", write(d, "two.csv", HDR + "2023-11-16 18:15:46.68,374\n")],
     "two.csv, line 2: expected 3 fields"),
    (lambda d: ["--workload", "azure", "--data", write(d, "h.csv", HDR)], "h.csv: no requests in it"),
    (lambda d: ["--workload", "trace", "--data", write(d, "e.jsonl", "\n")], "e.jsonl: no requests in it"),
    (lambda d: ["--workload", "azure", "--data", write(d, "abc.csv", HDR + ROW.format("abc", 12))],
     "abc.csv, line 2: ContextTokens must be a whole number >= 1, got 'abc'"),
    (lambda d: ["--block-size", "0"], "block_size must be >= 1, got 0"),
    (lambda d: ["--max-prompt-len", "0"], "max_prompt_len must be >= 1, got 0"),
    (lambda d: ["--max-output-len", "-1"], "max_output_len must be >= 1, got -1"),
    (lambda d: ["--num-requests", "0"], "num_requests must be >= 1, got 0"),
    (lambda d: ["--request-rate", "5", "--arrival", "all"], "--request-rate 5 sets Poisson or gamma arrivals; "
                                                            "--arrival all has none"),
    (lambda d: ["--num-device-blocks", "0"], "num_device_blocks must be >= 1, got 0"),
    (lambda d: ["--num-device-blocks", "-3"], "num_device_blocks must be >= 1, got -3"),
    (lambda d: ["--model", "llama-65b"], "not a configuration for simulation (opt-13b"),
    (lambda d: ["--batching", "magnus", "--chunked-prefill"], "request-level batching (--batching) does not combine"),
    (lambda d: ["--batching", "slo-odbs", "--slo-weights", "0,0"], "slo_weights must be two non-negative numbers"),
    (lambda d: ["--batch-size", "0"], "batch_size must be >= 1, got 0"),
    (lambda d: ["--model", "llama-2-70b"],
     "tensor parallelism over 4 GPUs would leave room for KV (--tensor-parallel-size 4)"),
])
def test_each_bad_input_gets_one_clear_line_and_status_2(case, message, tmp_path, capsys):
    code, out = run(simulate(*case(tmp_path)), tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not out.exists()


def test_preemption_mode_is_named_as_such(tmp_path, capsys):
    code, _ = run(simulate("--preemption", "bogus"), tmp_path)
    assert code == 2 and "--preemption: invalid choice: 'bogus'" in capsys.readouterr().err


def test_clipped_outputs_and_rejected_requests_are_counted(tmp_path, capsys):
    # prompts of 4,000 and 4,095 tokens on a 4,096-token model: one output clipped, one request rejected
    rows = ROW.format(4000, 200) + ROW.format(100, 20) + ROW.format(5000, 10)
    data = write(tmp_path, "t.csv", HDR + rows)
    code, out = run(simulate("--workload", "azure", "--data", data), tmp_path)
    text = capsys.readouterr().out
    m = json.loads(out.read_text())
    assert code == 0 and m["completed"] == 2 and m["rejected"] == 1 and "#2: prompt has 5000 tokens" in m["rejected_examples"][0]
    assert m["outputs_clipped"] == 1 and m["output_tokens_clipped"] == 200 - 96
    assert "1 outputs clipped (104 tokens fewer than the workload asks for)" in text
    code, out = run(simulate("--workload", "azure", "--data", data, "--max-prompt-len", "3000",
                             "--max-output-len", "50"), tmp_path)
    m = json.loads(out.read_text())
    assert (m["prompts_truncated"], m["outputs_capped"], m["outputs_clipped"], m["rejected"]) == (2, 1, 0, 0)


def test_a_trace_in_any_columns_replays(tmp_path):
    jsonl = "".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
                    for t, i, o, h in ((1000, 30, 5, [1, 2]), (1500, 40, 6, [1, 3]), (4000, 10, 2, [])))
    items = load_trace(write(tmp_path, "m.jsonl.gz", jsonl), hash_column="hash_ids")
    assert [(it.arrival, it.prompt_len, it.output_len, it.prefix_hashes) for it in items] == [
        (0.0, 30, 5, [1, 2]), (0.5, 40, 6, [1, 3]), (3.0, 10, 2, [])]
    csv_path = write(tmp_path, "c.csv", "t_us,in,out\n5,3,4\n2000005,6,7\n")
    items = load_trace(csv_path, "t_us", "us", "in", "out")
    assert [(it.arrival, it.prompt_len, it.output_len) for it in items] == [(0.0, 3, 4), (2.0, 6, 7)]
    code, out = run(simulate("--workload", "trace", "--data", csv_path, "--time-column", "t_us", "--time-unit", "us",
                             "--input-column", "in", "--output-column", "out"), tmp_path)
    assert code == 0 and json.loads(out.read_text())["completed"] == 2
    with pytest.raises(ValueError, match="line 2: output_length must be a whole number >= 1, got 2.5"):
        load_trace(write(tmp_path, "f.jsonl", '{"timestamp":1,"input_length":3,"output_length":4}\n'
                                              '{"timestamp":2,"input_length":3,"output_length":2.5}\n'))


# --- fuzzing ---------------------------------------------------------------------------------------
cells = st.one_of(st.integers(-5, 10**6).map(str), st.text(string.printable, max_size=8),
                  st.sampled_from(["", "2023-11-16 18:15:46.6805900", "1e3", "nan", "inf", "-0", "3.0"]))
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _loads_or_says_why(loader, path):
    try:
        items = loader(path)
    except ValueError as e:
        assert str(e).startswith(path)  # names the file (and the line where there is one)
        return
    assert items and all(it.prompt_len >= 1 and it.output_len >= 1 for it in items)
    assert all(it.arrival is None or it.arrival == it.arrival for it in items)


@FUZZ
@given(header=st.lists(st.sampled_from(["TIMESTAMP", "ContextTokens", "GeneratedTokens", "timestamp",
                                        "input_length", "output_length", "arrival_timestamp", "prompt_size",
                                        "token_size", "x"]), min_size=0, max_size=5),
       rows=st.lists(st.lists(cells, min_size=0, max_size=5), max_size=4))
def test_fuzzed_csv_files_load_or_fail_clearly(tmp_path, header, rows):
    path = write(tmp_path, "fuzz.csv", ",".join(header) + "\n" + "".join(",".join(r) + "\n" for r in rows))
    for loader in (load_azure_trace, load_trace, load_splitwise_trace):
        _loads_or_says_why(loader, path)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**5) | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3), max_leaves=5)


@FUZZ
@given(lines=st.lists(st.one_of(st.dictionaries(st.sampled_from(["timestamp", "input_length", "output_length",
                                                                 "hash_ids", "y"]), json_values).map(json.dumps),
                                st.text(max_size=10)), max_size=4))
def test_fuzzed_jsonl_files_load_or_fail_clearly(tmp_path, lines):
    path = write(tmp_path, "fuzz.jsonl", "\n".join(lines) + "\n")
    _loads_or_says_why(lambda p: load_trace(p, hash_column=None), path)


flags = st.lists(st.tuples(st.sampled_from(["--num-prompts", "--num-requests", "--input-len", "--output-len",
                                            "--max-output-len", "--max-prompt-len", "--block-size",
                                            "--num-device-blocks", "--max-num-seqs", "--max-num-batched-tokens",
                                            "--request-rate", "--rate", "--burstiness", "--arrival", "--watermark",
                                            "--preemption"]),
                           st.sampled_from(["0", "1", "3", "-2", "64", "0.5", "x", "poisson", "swap", "all"])),
                 max_size=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=flags)
def test_fuzzed_command_lines_run_or_fail_clearly(tmp_path, capsys, pairs):
    argv = simulate("--num-prompts", "4", "--input-len", "16", "--output-len", "4",
                    *[x for pair in pairs for x in pair])
    code, out = run(argv, tmp_path)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code == 2:
        assert "error: " in err and not out.exists()
    else:  # every request of the workload is accounted for
        n = int(([v for f, v in pairs if f in ("--num-prompts", "--num-requests")] or ["4"])[-1])
        m = json.loads(out.read_text())
        assert code == 0 and m["completed"] + m["failed"] + m["rejected"] == n


@pytest.mark.parametrize("argv, message", [
    (["experiment", "banaserve", "--rates", "2,abc"], "expected a number, got 'abc'"),
    (["experiment", "banaserve", "--rates", "0"], "must be > 0, got 0"),
    (["experiment", "banaserve", "--instances", "1"], "must be >= 2, got 1"),
    (["experiment", "banaserve", "--systems", "vllm"], "unknown system 'vllm'"),
    (["experiment", "banaserve", "--workload", "azure-conv"], "needs --trace"),
    (["experiment", "uellm-placement", "--sets", "8xh100"], "unknown device set '8xh100'"),
    (["experiment", "uellm-placement", "--models", "llama-65b"], "not a configuration for simulation"),
    (["experiment", "adaptivellm", "--max-output-lens", "64,0"], "must be >= 1, got 0"),
    (["experiment", "adaptivellm", "--num-host-blocks", "-1"], "must be >= 0, got -1"),
    (["experiment", "adaptivellm-gap", "--sections", "table,speed"], "unknown section(s) speed"),
    (["experiment", "adaptivellm-gap", "--seeds", "0"], "must be >= 1, got 0"),
    (["experiment", "adaptivellm-gap", "--loads", "0.5,-1"], "must be > 0, got -1"),
    (["experiment", "adaptivellm-gap", "--swap-model", "nvme"], "invalid choice: 'nvme'"),
    (["experiment", "adaptivellm-gap", "--sim-models", ""], "needs at least one simulated model"),
    (["bench", "fidelity", "--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    (["bench", "fidelity", "--repeat", "0"], "argument --repeat: must be >= 1, got 0"),  # (the old name)
    (["bench", "fidelity", "--request-rate", "3", "-1"], "must be > 0, got -1"),
    (["bench", "fidelity", "--rate", "3", "-1"], "must be > 0, got -1"),
    (["bench", "fidelity", "--interval", "nan"], "must be >= 0, got nan"),
])
def test_bad_options_of_the_cluster_experiments_and_fidelity_bench(argv, message, tmp_path, capsys):
    try:
        main([*argv, "--out-dir" if argv[0] == "experiment" else "--out", str(tmp_path / "out")])
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


class Started(Exception):
    """What the fuzzed `serve` raises in place of serving, once its engine has been built."""


serve_flags = st.lists(st.tuples(
    st.sampled_from(["--num-device-blocks", "--num-host-blocks", "--block-size", "--max-num-seqs", "--max-model-len",
                     "--max-num-batched-tokens", "--max-waiting", "--port", "--max-restarts", "--max-request-bytes",
                     "--body-timeout", "--preemption", "--policy", "--instances", "--lease", "--router",
                     "--kv-transport", "--served-model-name"]),
    st.sampled_from(["0", "1", "-3", "64", "0.5", "nan", "inf", "x", "swap", "fcfs", "prompt=1,token=1", "2", ""])),
    max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=serve_flags)
def test_fuzzed_serve_flags_start_or_fail_clearly(monkeypatch, capsys, pairs):
    """`serve` with random flags: one `error:` line and exit 2, or an engine built from what was asked
    (the engine is built here in-process, then the test stops before any port is opened)."""
    import servewise.commands.serve as serve
    from servewise.builder import build_engine

    def build_then_stop(model, engine_kwargs, *args, **kw):
        build_engine(model=model, **engine_kwargs)
        raise Started

    monkeypatch.setattr(serve, "make_app", build_then_stop)
    try:
        main(["serve", "--model", "tiny-llama", *[x for pair in pairs for x in pair]])
        code = 0
    except SystemExit as e:
        code = e.code
    except Started:
        code = None
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code is None or (code == 2 and "error: " in err), (pairs, code, err)


bench_serve_flags = st.lists(st.tuples(
    st.sampled_from(["--num-prompts", "--num-requests", "--input-len", "--output-len", "--request-rate", "--burstiness",
                     "--max-concurrency", "--arrival", "--workload", "--seed", "--max-output-len", "--tokenizer"]),
    st.sampled_from(["0", "1", "-3", "64", "0.5", "nan", "inf", "-inf", "x", "poisson", "all", "chatbot", ""])),
    max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=bench_serve_flags)
def test_fuzzed_bench_serve_flags_fail_clearly(tmp_path, capsys, pairs):
    """`bench serve` at a port where nothing listens: whatever the flags, one `error:` line and exit 2 (a bad
    setting is named before the absent server), and no JSON written."""
    out = tmp_path / "bench.json"
    try:
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--out", str(out),
              *[x for pair in pairs for x in pair]])
        code = 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err and code == 2 and "error: " in err, (pairs, code, err)
    assert not out.exists()


def test_a_missing_file_is_one_line_and_threads_are_given_back(tmp_path, capsys):
    import torch

    before = torch.get_num_threads()
    line = refused(["bench", "prefix", "--threads", str(before + 1), "--predictors", str(tmp_path / "missing.pkl"),
                    "--out", str(tmp_path / "p.json")], capsys)
    assert line.startswith("error:") and "missing.pkl" in line
    assert torch.get_num_threads() == before and not (tmp_path / "p.json").exists()
