"""`servewise bench offline`: each engine in its own process, rounds alternated, outputs hashed."""
import json

import pytest

from servewise.bench.offline import Settings, make_prompts
from servewise.cli import main


def test_shared_prefix_prompts_share_their_heads():
    s = Settings(workload="shared-prefix", num_prompts=6, prefixes=2, prefix_len=5, input_len=3)
    ps = make_prompts(s, 100)
    assert [len(p) for p in ps] == [8] * 6
    assert ps[0][:5] == ps[2][:5] == ps[4][:5] != ps[1][:5] == ps[3][:5]
    assert len({tuple(p[5:]) for p in ps}) == 6


def test_multi_turn_prompts_carry_their_conversation_so_far():
    s = Settings(workload="multi-turn", num_prompts=12, turns=4, input_len=16, output_len=16)
    ps = make_prompts(s, 1000)
    assert len(ps) == 12
    # each conversation's later turns extend its earlier one: 3 conversations x 3 later turns
    later = [p for p in ps if any(len(q) < len(p) and p[:len(q)] == q for q in ps)]
    assert len(later) == 9


@pytest.mark.slow
def test_caching_on_and_off_give_the_same_tokens_and_every_round_is_saved(tmp_path):
    """Each round's engine (a process of its own) generates the tokens servewise generates in this process
    for the same prompts, 6 prompts x 6 tokens, caching on or off: their hash is saved; the best rate
    saved is the highest of the timed runs'."""
    import hashlib

    from servewise import LLM, SamplingParams
    from servewise.models.loader import hf_config

    runs = {}
    for caching in ("--prefix-caching", "--no-prefix-caching"):
        out = tmp_path / f"{caching}.json"
        main(["bench", "offline", "--workload", "shared-prefix", "--num-prompts", "6", "--prefixes", "2",
              "--prefix-len", "40", "--input-len", "8", "--output-len", "6", "--rounds", "2", "--runs", "2",
              "--threads", "1", caching, "--out", str(out)])
        runs[caching] = json.loads(out.read_text())
    s = Settings(workload="shared-prefix", num_prompts=6, prefixes=2, prefix_len=40, input_len=8, output_len=6)
    prompts = make_prompts(s, hf_config("tiny-llama")["vocab_size"])
    outs = [list(o.token_ids) for o in LLM("tiny-llama", dtype="float32").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    assert len(outs) == 6 and all(len(o) == 6 for o in outs)
    expected = hashlib.sha1(json.dumps(outs).encode()).hexdigest()[:16]
    for caching, r in runs.items():
        assert r["settings"]["prefix_caching"] == (caching == "--prefix-caching") and r["settings"]["runs"] == 2
        assert len(r["rounds"]) == 2 and r["identical_outputs"]
        for row in r["rounds"]:
            x = row["servewise"]
            assert set(row) == {"servewise"} and x["engine"] == "servewise" and x["block_size"] == 16
            assert len(x["output_tok_s"]) == 2 and x["best"] == max(x["output_tok_s"]) and min(x["output_tok_s"]) > 0
            assert x["outputs_hash"] == expected


@pytest.mark.slow
def test_the_block_size_reaches_the_engine_and_leaves_the_tokens_alone(tmp_path):
    rows = {}
    for size in (None, "64"):
        out = tmp_path / f"{size}.json"
        main(["bench", "offline", "--num-prompts", "4", "--input-len", "80", "--output-len", "8", "--rounds", "1",
              "--runs", "1", "--out", str(out)] + (["--block-size", size] if size else []))
        rows[size] = json.loads(out.read_text())["rounds"][0]["servewise"]
    assert rows[None]["block_size"] == 16 and rows["64"]["block_size"] == 64
    assert rows[None]["outputs_hash"] == rows["64"]["outputs_hash"]


@pytest.mark.parametrize("bad", ["0", "-16", "x"])
def test_a_bad_block_size_is_status_2(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "offline", "--block-size", bad])
    assert e.value.code == 2 and "--block-size" in capsys.readouterr().err


def test_an_unknown_workload_is_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "offline", "--workload", "chat"])
    assert e.value.code == 2 and "invalid choice: 'chat'" in capsys.readouterr().err
