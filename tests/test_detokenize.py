"""`TextStream` streams, push by push, exactly the text and stop flags of the whole-output method it replaced
(the bench's baseline, the oracle here), for the built-in byte tokenizer and `tokenizers` tokenizers of each decoder
family, while decoding only a few tokens a push."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servewise.bench.detokenize import QuadraticTextStream as OracleTextStream  # the method before
from servewise.detokenize import TextStream
from servewise.models.tokenizer import ByteTokenizer, HFTokenizer

from conftest import random_prompts


def pushes(cls, tok, ids, stops, sizes=None):
    """Every push's (text, stopped) up to the first stop, after which callers push no more: `sizes` ids a
    push (default one), the last push final."""
    s, out, i = cls(tok, list(stops)), [], 0
    for n in sizes or [1] * len(ids):
        out.append(s.push(ids[i:i + n], i + n >= len(ids)))
        i += n
        if out[-1][1]:
            return out
    if i < len(ids) or not out:
        out.append(s.push(ids[i:], True))
    return out


def assert_same(tok, ids, stops, sizes=None):
    want = pushes(OracleTextStream, tok, ids, stops, sizes)
    assert pushes(TextStream, tok, ids, stops, sizes) == want
    return want


# --- tokenizers: the built-in models' byte tokenizer, and one of each `tokenizers` decoder family

CORPUS = ["The quick brown fox jumps over the lazy dog. Paged attention is a memory manager, isn't it?",
          "Café, naïve, façade — €5 für Grüße; 日本語のテキスト と 中文",
          "def push(self, ids): return self.tok.decode(ids)  # stop strings </s> and ###\n\tindent"] * 8
EMOJI = "emoji 😀🚀 and more 🎉"  # left out of the byte-fallback vocabulary: byte pieces stand for them
TEXTS = ["Paged attention is a memory manager.", "é😀日本語€€ x", "Grüße 😀🚀 — ok", "ab 🚀🚀🚀 cd", "😀😀 hi",
         "line\n\nnext </s> ###", "  two spaces, isn't it ?"]


def _train(path, tok, trainer, corpus):
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tokenizers")
    # byte-level BPE (GPT-2, OPT, Llama 3, Qwen): every byte a symbol, joined by a lossy UTF-8 decode
    bl = Tokenizer(models.BPE())
    bl.pre_tokenizer, bl.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    _train(d / "byte_level.json", bl, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"],
        show_progress=False), CORPUS + [EMOJI])
    # SentencePiece pieces with byte fallback (Llama 2, Mistral): "▁" for spaces, "<0xE2>" byte pieces
    sp = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    _train(d / "pieces.json", sp, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                      show_progress=False), CORPUS)
    spec = json.loads((d / "pieces.json").read_text())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    (d / "pieces.json").write_text(json.dumps(spec))
    # WordPiece (BERT): "##" continues a word, a space between words
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.pre_tokenizer, wp.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    _train(d / "wordpiece.json", wp, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"],
                                                               show_progress=False), CORPUS + [EMOJI])
    from servewise.models.loader import load_model_config

    return {"byte": load_model_config("tiny-llama")[1],
            **{name: HFTokenizer(str(d / f"{name}.json"), None) for name in ("byte_level", "pieces", "wordpiece")}}


def vocab_size(tok) -> int:
    return 300 if isinstance(tok, ByteTokenizer) else tok.tok.get_vocab_size()  # (bytes, BOS/EOS and some `<id>`s)


# --- random token ids, push sizes and stop strings


@st.composite
def cases(draw, vocab: int):
    ids = draw(st.lists(st.integers(0, vocab - 1), max_size=40))
    sizes = draw(st.none() | st.lists(st.integers(1, 5), max_size=12))
    return ids, sizes


def draw_stops(data, text: str) -> list[str]:
    """Up to three stop strings: pieces of the whole text (so that they are hit, across token boundaries too)
    or strings of characters that the text holds around incomplete characters."""
    cut = st.integers(0, max(len(text) - 1, 0))
    piece = st.builds(lambda i, n: text[i:i + n], cut, st.integers(1, 5)).filter(bool) if text else st.nothing()
    other = st.text(alphabet="ab €é😀\ufffd<>.", min_size=1, max_size=4)
    return data.draw(st.lists(piece | other, max_size=3))


@pytest.mark.parametrize("name", ["byte", "byte_level", "pieces", "wordpiece"])
@settings(max_examples=300)
@given(data=st.data())
def test_random_token_ids_stream_as_the_oracle_does(toks, name, data):
    tok = toks[name]
    ids, sizes = data.draw(cases(vocab_size(tok)))
    assert_same(tok, ids, draw_stops(data, tok.decode(ids)), sizes)


@pytest.mark.parametrize("name", ["byte", "byte_level", "pieces", "wordpiece"])
@given(data=st.data())
def test_encoded_text_streams_as_the_oracle_does(toks, name, data):
    tok = toks[name]
    text = data.draw(st.sampled_from(TEXTS)) + data.draw(st.text(alphabet="a é€😀日\n.", max_size=12))
    ids = tok.encode(text, add_special=False)
    sizes = data.draw(st.none() | st.lists(st.integers(1, 5), max_size=12))
    assert_same(tok, ids, draw_stops(data, tok.decode(ids)), sizes)


# --- hand-picked cases on the byte tokenizer (one id a byte)


def byte_ids(text: str) -> list[int]:
    return list(ByteTokenizer(300, 1, 2).encode(text, add_special=False))


def test_a_character_split_across_tokens_is_held_until_whole():
    tok = ByteTokenizer(300, 1, 2)
    assert assert_same(tok, byte_ids("a€b"), []) == [("a", False), ("", False), ("", False), ("€", False),
                                                     ("b", False)]
    # invalid bytes stay U+FFFD: released once a character follows them, or at the end
    assert "".join(p for p, _ in assert_same(tok, [0xFF + 4, 0xE2 + 4, 0x82 + 4, 0x41 + 4], [])) == "\ufffd\ufffdA"


@pytest.mark.parametrize("text, stops, sizes, want", [
    ("hello world", ["o w"], None, "hell"),  # across token boundaries
    ("hello world", ["xyz", "lo", "wor"], None, "hel"),  # the first stop string to appear wins
    ("hello world", ["o w"], [11], "hell"),  # all ids in one push
    ("hello world", ["o w"], [3, 3, 5], "hell"),
    ("grüße 😀🚀!", ["e 😀🚀!"], None, "grüß"),  # stop strings of multi-byte characters
    # The rule as it was: with a stop string's last character incomplete (U+FFFD), the characters before it
    # go out, as the hold is one character short then; they stay out when the stop string completes.
    ("grüße 😀🚀!", ["😀🚀"], None, "grüße 😀"),
    ("ax€y", ["x€"], None, "ax"),
    ("grüße 😀🚀!", ["\U0001f680!"], [2, 7, 9], "grüße 😀"),
    ("abcd", ["cde"], None, "abcd"),  # a stop string's beginning at the end: released by the final push
    ("a\U0001f600", ["b"], None, "a\U0001f600"),
])
def test_stop_strings_end_the_text_as_before(text, stops, sizes, want):
    got = assert_same(ByteTokenizer(300, 1, 2), byte_ids(text), stops, sizes)
    assert "".join(p for p, _ in got) == want and got[-1][1] == any(s in text for s in stops)


def test_pushes_after_a_stop_add_nothing():
    s = TextStream(ByteTokenizer(300, 1, 2), ["two"])
    got = [s.push(byte_ids(t), False) for t in ("on", "e t", "wo t", "hree", " four")]
    assert got == [("", False), ("one", False), (" ", True), ("", True), ("", True)]


def test_special_and_unknown_ids_between_bytes():
    tok = ByteTokenizer(300, 1, 2)  # 1, 2: BOS and EOS (no text); 0, 3 and 260 up: "<id>"
    for ids in ([0xE2 + 4, 2, 0x82 + 4, 0xAC + 4], [0x61 + 4, 2, 2, 2, 0x62 + 4], [2, 2, 0x61 + 4],
                [0xC3 + 4, 270, 0xA9 + 4, 3, 0x41 + 4]):
        assert_same(tok, ids, ["<2", "a\ufffd"])
        assert_same(tok, ids, [])


def test_byte_pieces_next_to_each_other(toks):
    """A byte-fallback decoder writes a whole run of byte pieces as U+FFFDs once a byte of it is not valid
    UTF-8, so a whole character can turn back into U+FFFDs: as long as the whole decode does."""
    tok = toks["pieces"]
    for text in ("😀😀 hi", "é😀日本語€€ x", "ab 🚀🚀🚀 cd"):
        ids = tok.encode(text, add_special=False)
        assert_same(tok, ids, [])
        assert_same(tok, ids, ["hi", "cd"], [2] * len(ids))


# --- the outputs of the built-in model, as the parity tests generate them


@pytest.fixture(scope="module")
def tiny_llama_outputs():
    from servewise import LLM, SamplingParams

    llm = LLM("tiny-llama", num_device_blocks=64)
    prompts = ["Paged attention is", "abc", "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"]
    outs = llm.generate(prompts + random_prompts(3, 4, 20, seed=9),
                        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    return llm.tokenizer, [o.token_ids for o in outs]


def test_the_built_in_models_outputs_stream_as_before(tiny_llama_outputs):
    tok, outputs = tiny_llama_outputs
    for ids in outputs:
        text = tok.decode(ids)
        for stops in ([], ["\x00never\x00"], [text[5:7]], [text[12:15], "\x00never\x00"], [text[40:41], text[30:33]]):
            for sizes in (None, [3] * 22, [1, 7, 2, 30, 24]):
                assert_same(tok, ids, stops, sizes)


# --- the cost: a push decodes a few ids and keeps a few characters, however long the output


@pytest.mark.parametrize("name", ["byte", "byte_level", "pieces"])
def test_a_push_decodes_a_few_ids_however_long_the_output(toks, name, monkeypatch):
    tok, decoded = toks[name], []
    monkeypatch.setattr(tok, "decode", lambda ids, decode=tok.decode: decoded.append(len(ids)) or decode(ids))
    ids = tok.encode(" ".join(TEXTS[:4] * 40), add_special=False)
    s, kept = TextStream(tok, ["\x00never\x00"]), 0
    for i, t in enumerate(ids):
        s.push([t], i == len(ids) - 1)
        kept = max(kept, len(s.text))
    # decoding the whole output every push would decode about len(ids) ** 2 / 2 ids
    assert len(ids) > 1000 and sum(decoded) < 40 * len(ids) and max(decoded) < 40
    assert kept < 64  # the text kept for stop strings and release: a few characters, not the output
