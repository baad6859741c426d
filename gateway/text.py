"""Token ids in, text deltas out, for one streamed request.

Never splits a multi-byte character (IncrementalDetokenizer holds back a partial one), never sends
text at or after a stop string, and holds back the last `len(longest stop) - 1` characters until they
can no longer turn into a stop string: text once sent is never taken back.
"""

from __future__ import annotations

from engine.tokenizer import IncrementalDetokenizer, Tokenizer, stop_cut


class StreamingText:
    """`include_stop`: the text ends after the stop string, not before it (include_stop_str_in_output);
    `min_tokens`: stop strings count only from that many tokens on (as the engine counts them)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stops: list[str], include_stop: bool = False,
                 min_tokens: int = 0, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, spaces_between_special_tokens)
        self._stops = stops
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._tokens = 0
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._sent = 0                    # characters of the detokenized text already sent
        self._stop_at: int | None = None  # where the text ends at the first stop string

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self._detok.text[:self._sent]

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Append a step's tokens; return the text that may be sent now (flushes all at `final`)."""
        for tok in token_ids:                        # one at a time: a stop counts from min_tokens on
            before = len(self._detok.text)
            self._detok.push([tok])
            self._tokens += 1
            if self._stop_at is None and self._stops and self._tokens > self._min_tokens:
                self._stop_at = stop_cut(self._detok.text, self._stops, before, self._include_stop)
        if final:
            before = len(self._detok.text)
            self._detok.flush()
            if self._stop_at is None and self._stops and self._tokens > self._min_tokens:
                self._stop_at = stop_cut(self._detok.text, self._stops, before, self._include_stop)
        full = self._detok.text
        if self._stop_at is not None:
            end = self._stop_at
        else:
            end = len(full) if final else len(full) - self._holdback
        if end <= self._sent:
            return ""
        delta = full[self._sent:end]
        self._sent = end
        return delta
