"""`servewise bench detokenize`: what it reports, and that both methods stream the same text."""
import json

import pytest

from servewise.bench.detokenize import METHODS, output_ids, stream
from servewise.cli import main as cli
from servewise.models.tokenizer import ByteTokenizer


def test_the_command_times_both_methods_at_each_length(tmp_path, capsys):
    out = tmp_path / "detokenize.json"
    cli(["bench", "detokenize", "--lengths", "16,48", "--repeat", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["settings"]["lengths"] == [16, 48] and r["settings"]["stops"] == ["<|im_end|>", "\n\nUser:"]
    assert [x["tokens"] for x in r["rows"]] == [16, 48]
    for x in r["rows"]:
        assert set(x["s_per_token"]) == {"quadratic", "incremental"} and min(x["s_per_token"].values()) > 0
        assert x["identical"] is True and x["ratio"] > 0 and x["chars"] > 0
    assert "incremental s/token" in capsys.readouterr().out


def test_both_methods_stream_the_same_text():
    tok = ByteTokenizer(32000, 1, 2)
    ids = output_ids(tok, 300, seed=1)
    assert len(ids) == 300 and any(i >= 0x80 + 4 for i in ids)  # multi-byte characters among them
    whole = tok.decode(ids)
    for stops in ([], ["<|im_end|>"], [whole[100:104]], [whole[250:251], whole[180:182]]):
        quadratic, incremental = (stream(cls, tok, ids, stops) for cls in METHODS.values())
        assert incremental == quadratic
        text = "".join(p for p, _ in incremental)
        assert incremental[-1][1] == any(s in whole for s in stops) and whole.startswith(text)
        assert text == whole or incremental[-1][1]


def test_bad_lengths_stop_with_status_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["bench", "detokenize", "--lengths", "0"])
    assert e.value.code == 2 and "--lengths" in capsys.readouterr().err
