"""Incremental detokenization of one request: text split on whole UTF-8 characters, stop strings.

:class:`TextStream` turns the token ids an engine commits, step by step, into text deltas. The text
is the tokenizer's decoding of all output tokens so far (special tokens skipped); a trailing
U+FFFD (the bytes of a character not yet complete: a byte-level token may carry part of one) is
held back until the character is complete, so every delta is whole characters. Text that could be
the start of a stop string is held back too, so the streamed text equals the non-streamed one.

Stop strings (OpenAI's ``stop``): when the text first contains one, the response ends where it
begins (the string itself is not returned). A verify step commits several tokens at once, so the
string may end inside a step's commit: the engine ends the request after that step (its record
keeps the whole step's tokens, what token forcing checks) and :attr:`TextStream.stop_tokens`
counts the output tokens up to and including the one that completed the string (the tokens the
response covers: ``usage.completion_tokens``).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    """Text deltas of one request's output tokens (module docstring).

    Args:
        tokenizer: a transformers tokenizer (``decode(ids, skip_special_tokens=True)``).
        stops: stop strings (non-empty), earliest occurrence wins.
    """

    def __init__(self, tokenizer: Any, stops: list[str] | None = None):
        self.tokenizer, self.stops = tokenizer, [s for s in (stops or []) if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the text sent so far
        self.text = ""  # the response text so far (cut at a stop string once found)
        self.stop: str | None = None  # the stop string found
        self.stop_tokens: int | None = None  # output tokens up to the one completing it
        # incremental decoding (vLLM's detokenizer, detokenize_incrementally): the text of
        # ids[:read] is self.text; new tokens are decoded with the step's tokens before them
        # (ids[prefix:]), so a tokenizer that treats a sequence's first token specially (a leading
        # space) decodes them as within the whole, and a step costs a few tokens' decoding
        self._prefix = self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text_upto(self, k: int) -> tuple[str, bool]:
        """(the text of ids[:k], whether it ends on a whole character), decoding only from the prefix."""
        if k <= self._read:
            return self.text, True
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:k])
        if after.endswith(REPLACEMENT) or len(after) < len(before):
            return self.text + after[len(before):].rstrip(REPLACEMENT), False
        return self.text + after[len(before):], True

    def feed(self, ids: list[int]) -> tuple[str, bool]:
        """Add one step's token ids; returns (text that can be sent now, whether a stop string ended
        the response). After a stop string nothing more is taken."""
        if self.stop is not None:
            return "", True
        before = len(self.ids)
        self.ids.extend(ids)
        text, whole = self._text_upto(len(self.ids))
        hit = self._find(text)
        if hit is not None:
            pos, s = hit
            self.stop_tokens = next(k for k in range(before + 1, len(self.ids) + 1)
                                    if self._find(self._text_upto(k)[0]) is not None)
            self.stop, self.text = s, text[:pos]
            return self._take(len(self.text)), True
        if whole:  # the text of every token so far is final: later tokens decode from here
            self.text, self._prefix, self._read = text, self._read, len(self.ids)
        return self._take(len(text) - self._held(text), text), False

    def flush(self) -> str:
        """The rest of the response text once the request finished (an incomplete character's
        bytes as the tokenizer decodes them)."""
        if self.stop is None and self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix:self._read])
            self.text += self._decode(self.ids[self._prefix:])[len(before):]
            self._read = len(self.ids)
        return self._take(len(self.text))

    def _find(self, text: str) -> tuple[int, str] | None:
        hits = [(text.find(s), s) for s in self.stops if s in text]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _take(self, upto: int, text: str | None = None) -> str:
        text = self.text if text is None else text
        if upto <= self.sent:
            return ""
        out, self.sent = text[self.sent:upto], upto
        return out
