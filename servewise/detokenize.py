"""Incremental detokenization with stop strings, shared by the offline API and the server."""
from __future__ import annotations


class TextStream:
    """Incremental detokenization with stop strings: text is released only when it can no longer turn
    into a stop string or an incomplete UTF-8 character."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops, self.ids, self.sent = tokenizer, stops, [], 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """(new text, whether a stop string ended the output)."""
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            end, stopped = min(hits), True
        else:
            end, stopped = len(text), False
            if not final:
                end -= self.hold
                if text.endswith("\ufffd"):
                    end = min(end, len(text) - 1)
        end = max(end, self.sent)
        out, self.sent = text[self.sent:end], end
        return out, stopped
