"""Tokenizers: a model directory's own, or a built-in byte tokenizer that needs no download."""
from __future__ import annotations

import os

BYTE_OFFSET = 4  # ids below this are reserved for special tokens


class ByteTokenizer:
    """UTF-8 bytes map to ids 4..259; ids the model produces beyond that decode as `<id>`."""

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None):
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"the byte tokenizer needs a vocabulary of at least {BYTE_OFFSET + 256}")
        self.vocab_size, self.bos_token_id, self.eos_token_id = vocab_size, bos_token_id, eos_token_id

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return ([self.bos_token_id] if add_special and self.bos_token_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                buf.append(i - BYTE_OFFSET)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
            if i not in (self.bos_token_id, self.eos_token_id):
                out.append(f"<{i}>")
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A model directory's tokenizer.json through the `tokenizers` library."""

    def __init__(self, path: str, eos_token_id: int | None):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str | None, vocab_size: int, bos: int | None, eos: int | None):
    if model_dir is not None and os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return HFTokenizer(os.path.join(model_dir, "tokenizer.json"), eos)
    return ByteTokenizer(vocab_size, bos, eos)
