"""Incremental detokenization with stop strings, shared by the offline API and the server."""
from __future__ import annotations

import weakref

from servewise.models.tokenizer import HFTokenizer

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


class TextStream:
    """Incremental detokenization with stop strings: text is released only when it can no longer turn
    into a stop string or an incomplete UTF-8 character.

    A push costs the few tokens it adds, not the whole output. A token's text can depend on its
    neighbours (a decode drops a leading space, bytes join into one character), so the text of the
    unsettled tokens is read as what they add to the last settled chunk, decoded with them: the
    difference between decoding `context_ids + pending` and `context_ids` alone. Tokens settle, and
    become the next context, once the text they add is not empty and does not end in U+FFFD (a
    character that the next bytes may still complete), and the last of them is not one that the next
    token can join (`_joining_ids`); the text before them then never changes. So for the byte
    tokenizer and the decoders of `tokenizers` that the served families use (byte-level BPE,
    SentencePiece pieces with byte fallback, WordPiece) the text is at every push exactly that of
    decoding all the ids at once, as the release rules below have always read it. (A run of tokens that
    stays unsettled, such as a long run of byte pieces, is decoded whole at each push until it ends.)

    Stop strings are searched for only where one can newly appear: no stop string lay in the text of
    the previous push, so a new one ends past the settled text and starts at most `hold` characters
    before its end. include_stop: the stop string found stays in the text (vLLM's
    include_stop_str_in_output); min_tokens: no stop string is looked for in the text of the first
    min_tokens tokens.
    """

    def __init__(self, tokenizer, stops: list[str], include_stop: bool = False, min_tokens: int = 0):
        self.tok, self.stops, self.ids, self.sent = tokenizer, stops, [], 0
        self.include_stop, self.min_tokens, self.floor = include_stop, min_tokens, 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.joining = _joining_ids(tokenizer)
        self.context_ids: list[int] = []  # the last settled chunk: decoded again for context
        self.context = ""  # its text, decoded alone
        self.pending: list[int] = []  # the tokens after it, not settled yet
        self.settled = 0  # length of the settled tokens' text
        self.base = 0  # where in the whole text `self.text` starts
        self.text = ""  # the settled text from `base` on: all that release and stop search still need
        self.stopped = False

    def push(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """(new text, whether a stop string ended the output)."""
        self.ids.extend(ids)
        if self.stopped:  # the output ended before the stop string: all after it stays unsent
            return "", True
        self.pending.extend(ids)
        fresh = self.tok.decode(self.context_ids + self.pending)[len(self.context):]
        text = self.text + fresh  # the whole text from `base` on
        length = self.base + len(text)
        if len(self.ids) <= self.min_tokens:  # (the text so far cannot hold a stop string)
            self.floor = length
        start = max(self.settled - self.hold, self.floor, 0) - self.base
        hits = [(i, len(s)) for i, s in ((text.find(s, start), s) for s in self.stops) if i >= 0]
        if hits:
            at, size = min(hits)
            end, self.stopped = self.base + at + (size if self.include_stop else 0), True
        else:
            end = length
            if not final:
                end -= self.hold
                if text.endswith(REPLACEMENT):
                    end = min(end, length - 1)
        end = max(end, self.sent)
        out, self.sent = text[self.sent - self.base:end - self.base], end
        self._settle(fresh, text)
        return out, self.stopped

    def _settle(self, fresh: str, text: str) -> None:
        if fresh and not fresh.endswith(REPLACEMENT) and self.pending[-1] not in self.joining:
            self.context_ids, self.pending = self.pending, []
            self.context = self.tok.decode(self.context_ids)
            self.settled += len(fresh)
            self.text = text
        elif not fresh and self.context:
            # Tokens that add no text after a settled chunk (end-of-sequence, skipped special tokens) need
            # not stay in the window: a long run of them would otherwise widen every decode.
            self.pending = []
        keep = min(self.sent, max(self.settled - self.hold, 0))  # the next push reads nothing before this
        if keep > self.base:
            self.text, self.base = self.text[keep - self.base:], keep


_JOINING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _joining_ids(tokenizer) -> frozenset[int]:
    """Ids whose text can still change with the token after them, beyond an incomplete character (which
    shows as U+FFFD). A byte-fallback decoder turns a whole run of byte pieces ("<0xE2>") into U+FFFDs,
    one a byte, as soon as one byte of the run is not valid UTF-8, so text that looked whole (an "é" of
    two byte pieces) turns into U+FFFDs when an incomplete character follows it; and skipped special
    tokens vanish before decoding, so that byte pieces on both sides of one join into one run."""
    if not isinstance(tokenizer, HFTokenizer):
        return frozenset()  # the byte tokenizer: a character, once whole, stays as it is
    if tokenizer not in _JOINING:
        tok = tokenizer.tok
        ids = {tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
        ids |= {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        _JOINING[tokenizer] = frozenset(ids - {None})
    return _JOINING[tokenizer]
