"""Incremental detokenization of one request's output, with stop strings cut out of the text."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns output tokens into text deltas.

    Only a short window of tokens is decoded per new token: the tokens since the last clean boundary, compared with
    the same window without the new token. A window that ends inside a multi-byte character decodes to U+FFFD and
    waits for more tokens. With stop strings, the last (longest stop - 1) characters are held back until they can
    no longer start a stop string, so streamed text never has to be taken back.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        # the Rust tokenizer's own decode skips the Python wrapper's per-call work (it runs twice per token)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = (
            (lambda ids: backend.decode(ids, skip_special_tokens=True)) if backend is not None
            else (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        )
        self.stop = list(stop or [])
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0  # characters of `text` already handed out

    def add(self, token_id: int) -> bool:
        """Append one token; True when the text now contains a stop string (the text is cut before it)."""
        self.token_ids.append(token_id)
        before = len(self.text)
        self.text += self._delta(final=False)
        return self._cut_at_stop(before)

    def flush(self) -> bool:
        """Decode whatever was waiting for more bytes (the request is ending)."""
        before = len(self.text)
        self.text += self._delta(final=True)
        return self._cut_at_stop(before)

    def take(self, finished: bool) -> str:
        """Text not handed out yet; while running, the hold-back tail stays."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold_back)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def _delta(self, final: bool) -> str:
        decode = self._decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = decode(self.token_ids[self.prefix_offset :])
        if not full:
            # ids that decode to nothing at all (special or unknown tokens): no later token can join them into
            # text, so the window restarts after them instead of growing with every such token
            self.prefix_offset = self.read_offset = len(self.token_ids)
            return ""
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full[len(prefix) :]
        return ""

    def _cut_at_stop(self, before: int) -> bool:
        if not self.stop:
            return False
        hits = []
        for s in self.stop:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0:
                hits.append(i)
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.emitted = min(self.emitted, len(self.text))
        return True
