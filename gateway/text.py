"""Token ids in, text deltas out, for one streamed request.

Never splits a multi-byte character (IncrementalDetokenizer holds back a partial one), never sends
text at or after a stop string, and holds back the last `len(longest stop) - 1` characters until they
can no longer turn into a stop string: text once sent is never taken back.
"""

from __future__ import annotations

from engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop


class StreamingText:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stops: list[str]):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._sent = 0                    # characters of the detokenized text already sent
        self._stop_at: int | None = None  # where the first stop string starts

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self._detok.text[:self._sent]

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Append a step's tokens; return the text that may be sent now (flushes all at `final`)."""
        before = len(self._detok.text)
        self._detok.push(token_ids)
        if final:
            self._detok.flush()
        full = self._detok.text
        if self._stop_at is None and self._stops:
            self._stop_at = find_stop(full, self._stops, before)
        if self._stop_at is not None:
            end = self._stop_at
        else:
            end = len(full) if final else len(full) - self._holdback
        if end <= self._sent:
            return ""
        delta = full[self._sent:end]
        self._sent = end
        return delta
