"""Completion text for responses: stop strings, and incremental decoding for streams."""

from __future__ import annotations


def stop_index(text: str, stop: list[str], start: int = 0) -> int:
    """Where the first stop string begins in ``text`` (searching from ``start``), or -1."""
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found, default=-1)


class IncrementalText:
    """One row's text as its tokens stream in: each :meth:`add` returns the new text that is
    safe to send (whole characters, not possibly the start of a stop string), cut at the first
    stop string.

    Decodes a short window of recent tokens per step rather than the whole completion: the
    text of ``ids[prefix:]`` minus that of ``ids[prefix:read]``, which also works for
    tokenizers whose tokens decode differently at the start of a sequence.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self._tokenizer, self._stop = tokenizer, stop
        self._hold = max(map(len, stop), default=1) - 1
        self.token_ids: list[int] = []
        self._text = ""
        self._sent = 0
        self._prefix = self._read = 0
        self.stopped = False  # a stop string was found: later tokens are dropped

    def add(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        if self._tokenizer is None:
            return ""
        decode = self._tokenizer.decode
        before = decode(self.token_ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.token_ids[self._prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.token_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """The rest of the text once the row ended."""
        if self.stopped or self._tokenizer is None:
            return ""
        # Exactly what the non-streamed response holds; its sent part is unchanged.
        self._text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        cut = stop_index(self._text, self._stop, max(0, self._sent - self._hold))
        if cut >= 0:
            end, self.stopped = cut, True
        else:
            end = len(self._text) if final else len(self._text) - self._hold
        if end <= self._sent:
            return ""
        piece, self._sent = self._text[self._sent : end], end
        return piece
