"""Structured output: OpenAI's `response_format` (`json_object`, `json_schema`) as a JSON schema that the
output must follow, enforced by masking the logits at every step with xgrammar's token masks (the library
vLLM and SGLang use). An optional extra: `pip install "servewise[structured]"`.

The server turns a `response_format` into a schema's text and checks that it compiles (`schema_for`); the
engine's runner keeps one grammar matcher per request (`Grammars.constraint`), and the sampler, on the CPU
and the GPU alike, feeds each matcher the tokens the request produced since the last step and masks the
tokens it does not allow (`apply`). Once the JSON is complete only end-of-sequence tokens are allowed.
"""
from __future__ import annotations

import functools
import json

import torch

MISSING = ("{} needs the structured-output extra, which is not installed: "
           "pip install \"servewise[structured]\" (xgrammar)")
ANY_OBJECT = json.dumps({"type": "object"})  # json_object: any JSON object, as OpenAI's JSON mode


def _xgrammar(field: str = "response_format"):
    try:
        import xgrammar
    except ImportError:
        raise ValueError(MISSING.format(field)) from None
    return xgrammar


def schema_for(response_format: dict | None) -> str | None:
    """The JSON schema's text that an OpenAI `response_format` asks for (None: free text). Raises ValueError
    naming `response_format` when the extra is missing or the schema is not one xgrammar can enforce."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = ANY_OBJECT
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        inner = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(inner, dict):
            raise ValueError("response_format: json_schema needs a `schema` object")
        schema = json.dumps(inner)
    else:
        raise ValueError(f"response_format: type must be text, json_object or json_schema, got {kind!r}")
    return checked(schema, "response_format")


def checked(schema: str, field: str) -> str:
    """The schema's text, once xgrammar has compiled it; a ValueError naming the field if it cannot."""
    xgr = _xgrammar(field)
    try:
        xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    except (RuntimeError, ValueError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"{field}: the schema cannot be enforced: {reason}") from None
    return schema


def _tokenizer_info(tokenizer, vocab_size: int, stop_ids: list[int]):
    """xgrammar's view of the vocabulary: each id's bytes (the byte tokenizer's ids 4..259 are the 256 bytes,
    every other id a special token that no grammar allows: ids past the list are) or a tokenizer.json's, through
    transformers."""
    xgr = _xgrammar()
    from servewise.models.tokenizer import BYTE_OFFSET, ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        vocab = [b""] * (BYTE_OFFSET + 256)
        for b in range(256):
            vocab[BYTE_OFFSET + b] = bytes([b])
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids)
    from transformers import PreTrainedTokenizerFast

    return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer.tok),
                                              vocab_size=vocab_size, stop_token_ids=stop_ids)


class Constraint:
    """One request's grammar state: the matcher and how many of the request's output tokens it has taken."""

    __slots__ = ("matcher", "taken", "broken")

    def __init__(self, matcher):
        self.matcher, self.taken, self.broken = matcher, 0, False

    def catch_up(self, output: list[int]) -> bool:
        """Feed the matcher the tokens produced since the last step; whether it still constrains the next
        token (not once the grammar has ended, nor after a token it refused)."""
        while self.taken < len(output) and not self.broken:
            self.broken = not self.matcher.accept_token(output[self.taken])
            self.taken += 1
        return not self.broken and not self.matcher.is_terminated()


class Grammars:
    """One engine's compiled grammars (by schema, the most recent 64 kept) and the matchers built from them."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(_tokenizer_info(tokenizer, vocab_size, stop_ids))
        self._compiled = functools.lru_cache(maxsize=64)(
            lambda schema: self.compiler.compile_json_schema(schema, any_whitespace=False))

    def constraint(self, schema: str) -> Constraint:
        return Constraint(_xgrammar().GrammarMatcher(self._compiled(schema)))


def apply(logits: torch.Tensor, reqs: list) -> list[int]:
    """Mask in place the logits [B, V] of the requests (one a row) whose grammar still constrains their next
    token; a request here has output_token_ids and a `grammar` (a Constraint, or None: free text). Returns
    the rows masked."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.catch_up(r.output_token_ids)]
    if not rows:
        return rows
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(*logits.shape)
    for i in rows:
        reqs[i].grammar.matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return rows
