"""Completion text for responses: stop strings, incremental decoding, and which tokens the
returned text is made of (so token ids, log-probs and usage describe exactly that text, streamed
or not)."""

from __future__ import annotations

import re

from ..chat import completion_text

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte fallback


def stop_index(text: str, stop: list[str], start: int = 0) -> int:
    """Where ``text`` ends at its first stop string (searching from ``start``), or -1: the start
    of the occurrence that ends first, as generation meets them (of those ending together, the
    longest). The earliest start instead would cut a whole text, not streamed, at a stop string
    that a shorter one inside it had ended before it was complete: streamed, the shorter one
    cut first."""
    found = [(i + len(s), i) for s, i in ((s, text.find(s, start)) for s in stop) if i >= 0]
    return min(found)[1] if found else -1


class IncrementalText:
    """One row's text as its tokens arrive: each :meth:`add` returns the new text that is
    safe to send (whole characters, not possibly the start of a stop string), cut at the first
    stop string; :attr:`kept` is how many tokens make the text sent so far.

    Decodes a short window of recent tokens per token rather than the whole completion: the
    text of ``ids[prefix:]`` minus that of ``ids[prefix:read]``, which also works for
    tokenizers whose tokens decode differently at the start of a sequence.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self._tokenizer, self._stop = tokenizer, stop
        self._hold = max(map(len, stop), default=1) - 1
        self.token_ids: list[int] = []
        # ends[i]: the text's length (characters) once token i is decoded.
        self.ends: list[int] = []
        self._text = ""
        self._sent = 0
        self._prefix = self._read = 0
        self.stopped = False  # a stop string was found: later tokens are dropped
        self.finished = False  # the row ended (finish() ran)

    @property
    def text(self) -> str:
        """The text sent so far."""
        return self._text[: self._sent]

    @property
    def kept(self) -> int:
        """The fewest tokens whose text covers what was sent: the tokens the response
        describes (later ones were generated past a stop string, or are not sent yet)."""
        if self._tokenizer is None or (self.finished and not self.stopped):
            return len(self.token_ids)
        for k, end in enumerate(self.ends):
            if end >= self._sent:
                return k + 1 if self._sent else 0
        return len(self.token_ids)

    def start_offset(self, token: int) -> int:
        """Where token ``token``'s text begins in the row's text."""
        return min(self.ends[token - 1], self._sent) if token else 0

    def add(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        if self._tokenizer is None:
            self.token_ids.extend(token_ids)
            return ""
        for token in token_ids:
            self.token_ids.append(token)
            before = completion_text(self._tokenizer, self.token_ids[self._prefix : self._read])
            after = completion_text(self._tokenizer, self.token_ids[self._prefix :])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self._text += after[len(before) :]
                self._prefix, self._read = self._read, len(self.token_ids)
            self.ends.append(len(self._text))
        return self._emit(final=False)

    def finish(self) -> str:
        """The rest of the text once the row ended."""
        self.finished = True
        if self.stopped or self._tokenizer is None:
            return ""
        # Exactly what the whole completion decodes to; its sent part is unchanged.
        self._text = completion_text(self._tokenizer, self.token_ids)
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


class TokenBytes:
    """Each token's own bytes (a token may hold part of a character: its decoded text would be
    the replacement character), for byte-level BPE and sentencepiece byte-fallback tokenizers;
    the decoded text's bytes for others."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        self._byte_of: dict[str, int] | None = None
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if decoder is not None and type(decoder).__name__ == "ByteLevel":
            from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

            self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def __call__(self, token: int) -> bytes:
        if token not in self._cache:
            self._cache[token] = self._bytes(token)
        return self._cache[token]

    def _bytes(self, token: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token)
        if token in self._tokenizer.all_special_ids or not isinstance(piece, str):
            return self._tokenizer.decode([token]).encode()
        if self._byte_of is not None and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return self._tokenizer.decode([token]).encode()
