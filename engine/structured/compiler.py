"""Compiles grammar specs on a thread pool, off the engine thread, with a cache keyed by the spec.

`compile(spec)` returns a `Future[CompiledGrammar]` at once. Errors -- bad input, a limit, a compile
past the time bound -- arrive through the future as `GrammarError` (INVALID_ARGUMENT naming the
field). Results, failures included (a repeated bad or slow spec costs nothing the second time), stay
in an LRU cache keyed by (kind, text); concurrent requests for one spec share one compile. The native
compile releases the GIL, so the engine thread keeps stepping while it runs.

Two corrections to xgrammar 0.2.9 (found by the prototype that chose it, see docs/structured-output.md):
a JSON string with minLength/maxLength compiles to a character class that admits raw control
characters (invalid JSON), swapped here for the class its unbounded strings use; and `json_object`
uses xgrammar's built-in JSON grammar narrowed to objects (about 10x faster to fill than the
grammar of the schema {"type": "object"}), its whitespace runs bounded so a model cannot loop on
blank lines.
"""

from __future__ import annotations

import heapq
import itertools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass

import xgrammar as xgr

from engine.structured.spec import GrammarError, GrammarLimits, GrammarSpec, check_limits
from engine.structured.vocabulary import GrammarVocabulary

MAX_JSON_WHITESPACE = 16         # longest whitespace run between JSON tokens


@dataclass(frozen=True)
class CompiledGrammar:
    """Immutable; every request with the same spec shares one."""

    spec: GrammarSpec
    handle: xgr.CompiledGrammar
    compile_ms: float

    @property
    def memory_bytes(self) -> int:
        return int(self.handle.memory_size_bytes)


_XGR_LOCATION = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")
_XGR_CHECK = re.compile(r"Check failed:.*? is false:\s*")


def clean_message(err: BaseException, limit: int = 400) -> str:
    """xgrammar's RuntimeError('[time] file.cc:line: Check failed: (...) is false: msg') -> msg, without
    the source location or an echo of the input."""
    msg = _XGR_CHECK.sub("", _XGR_LOCATION.sub("", str(err)))
    msg = " ".join(msg.split("The JSON string is:")[0].split())
    return msg[:limit] or type(err).__name__


def _ebnf_literal(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _json_object_ebnf(max_whitespace: int) -> str | None:
    text = str(xgr.Grammar.builtin_json_grammar())
    new, n = re.subn(r"^root ::= .*$", r'root ::= "{" [ \\n\\r\\t]* members_and_embrace', text, count=1, flags=re.M)
    if n != 1 or "members_and_embrace ::=" not in new:
        return None
    return new.replace("[ \\n\\r\\t]*", f"[ \\n\\r\\t]{{0,{max_whitespace}}}")


_BAD_STRING_CLASS = '[^\\"\\\\\\r\\n]'          # xgrammar 0.2.9's bounded JSON string: admits \x00-\x1f
_GOOD_STRING_CLASS = '[^\\"\\\\\\0-\\x1f]'


def _fixed(grammar: xgr.Grammar) -> str | None:
    text = str(grammar)
    return text.replace(_BAD_STRING_CLASS, _GOOD_STRING_CLASS) if _BAD_STRING_CLASS in text else None


def _structural_tag_json(text: str) -> str:
    """The legacy {"structures": [...], "triggers": [...]} form -> the current {"format": ...} one."""
    tag = json.loads(text)
    if "format" in tag:
        return text
    structures = tag.get("structures")
    if not isinstance(structures, list) or not all(
            isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
            for s in structures):
        raise GrammarError("structural_tag", "'structures' must be a list of objects with string 'begin' and 'end'")
    tags = [{"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s.get("schema", True)},
             "end": s["end"]} for s in structures]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}})


class _Deadlines:
    """One daemon thread that runs callbacks at deadlines (the compile time bound)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def at(self, deadline: float, callback: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._heap, (deadline, next(self._seq), callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-deadlines", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, callback = heapq.heappop(self._heap)
            callback()


def _settle(fut: Future, result=None, error: BaseException | None = None) -> None:
    """Complete `fut` unless it is done already (timed out)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


class GrammarCompiler:
    """`max_workers` specs compile at once; `cache_entries` / `cache_bytes` bound the cache."""

    def __init__(self, vocab: GrammarVocabulary, limits: GrammarLimits = GrammarLimits(), max_workers: int = 2,
                 cache_entries: int = 256, cache_bytes: int = 512 << 20):
        self.vocab = vocab
        self.limits = limits
        self._xgr = xgr.GrammarCompiler(vocab.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._deadlines = _Deadlines()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_entries, self._cache_bytes = cache_entries, cache_bytes
        self._json_object = _json_object_ebnf(MAX_JSON_WHITESPACE)
        self.hits = self.misses = 0

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar (the cached one when present)."""
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                return fut
            self.misses += 1
            fut = self._cache[spec.key] = Future()
            self._evict_locked()
        try:
            check_limits(spec, self.limits)
        except GrammarError as e:
            _settle(fut, error=e)
            return fut
        fut.add_done_callback(lambda _: self._evict())
        self._pool.submit(self._run, spec, fut)
        return fut

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._cache), "hits": self.hits, "misses": self.misses}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, spec: GrammarSpec, fut: Future) -> None:
        timeout = self.limits.compile_timeout_s
        self._deadlines.at(time.monotonic() + timeout, lambda: _settle(fut, error=GrammarError(
            spec.kind, f"compiling took longer than the limit of {timeout:g} s")))
        start = time.perf_counter()
        try:
            handle = self._compile_now(spec)
        except GrammarError as e:
            _settle(fut, error=e)
        except Exception as e:  # noqa: BLE001 - xgrammar reports every input error as RuntimeError/ValueError
            _settle(fut, error=GrammarError(spec.kind, clean_message(e)))
        else:
            _settle(fut, CompiledGrammar(spec, handle, (time.perf_counter() - start) * 1e3))

    def _compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        c = self._xgr
        if spec.kind == "json_schema":
            g = xgr.Grammar.from_json_schema(spec.text, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE,
                                             strict_mode=True)
            return c.compile_grammar(_fixed(g) or g)
        if spec.kind == "json_object":
            if self._json_object is not None:
                return c.compile_grammar(self._json_object)
            return c.compile_json_schema('{"type": "object"}', strict_mode=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "grammar":
            if "::=" in spec.text:
                return c.compile_grammar(spec.text, root_rule_name="root")
            return c.compile_lark(spec.text)
        if spec.kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(_ebnf_literal(s) for s in json.loads(spec.text)))
        text = _structural_tag_json(spec.text)        # structural_tag
        try:
            fixed = _fixed(xgr.Grammar.from_structural_tag(text))
        except Exception:  # noqa: BLE001 - the compile below reports the error with the tokenizer in view
            fixed = None
        return c.compile_grammar(fixed) if fixed else c.compile_structural_tag(text)

    def _evict(self) -> None:
        with self._lock:
            self._evict_locked()

    def _evict_locked(self) -> None:
        while len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)
        while len(self._cache) > 1 and self._bytes_locked() > self._cache_bytes:
            self._cache.popitem(last=False)

    def _bytes_locked(self) -> int:
        return sum(f.result().memory_bytes for f in self._cache.values()
                   if f.done() and not f.cancelled() and f.exception() is None)
