"""The engine's entry to structured output: one compiler per engine, built at the first constrained
request (the vocabulary takes about 0.1 s at 152k tokens), and a matcher per request.

    grammars = Grammars(tokenizer_json, vocab_size, eos_token_ids)
    future = grammars.compile(params.structured_output)   # any thread; GrammarError at once for bad shapes
    state = grammars.matcher(future.result(), stop_token_ids)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from engine.errors import UnsupportedError
from engine.sampling_params import StructuredOutput
from engine.structured.spec import GrammarLimits, GrammarSpec


class Grammars:
    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int],
                 limits: GrammarLimits = GrammarLimits(), max_workers: int = 2):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.limits = limits
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._compiler = None

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    @property
    def compiler(self):
        """engine.structured.compiler.GrammarCompiler, built on first use (xgrammar imported then)."""
        with self._lock:
            if self._compiler is None:
                from engine.structured.compiler import GrammarCompiler
                from engine.structured.vocabulary import GrammarVocabulary
                vocab = GrammarVocabulary.from_tokenizer_json(self._tokenizer_json(), self.vocab_size,
                                                              self.eos_token_ids)
                self._compiler = GrammarCompiler(vocab, self.limits, self._max_workers)
            return self._compiler

    def compile(self, so: StructuredOutput) -> Future:
        """Future[CompiledGrammar]; a spec of the wrong shape raises GrammarError here, a grammar that
        does not compile (or not in time) fails the future with one; UnsupportedError without xgrammar."""
        spec = GrammarSpec.from_structured_output(so)
        try:
            compiler = self.compiler
        except ImportError as e:
            raise UnsupportedError(f"structured_output: needs the xgrammar package ({e}); see "
                                   "docs/structured-output.md for the install") from None
        return compiler.compile(spec)

    def matcher(self, grammar, stop_token_ids: Sequence[int]):
        """A fresh engine.structured.matcher.GrammarState; the grammar ends where a stop token may come
        (the request's, else the model's EOS)."""
        from engine.structured.matcher import GrammarState
        stops = [t for t in stop_token_ids if 0 <= t < self.vocab_size] or list(self.eos_token_ids)
        return GrammarState(grammar, stops, self.words)

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
