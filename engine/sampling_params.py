"""Per-request sampling settings, validated when constructed. Names, defaults and meanings follow
vLLM's `SamplingParams` (docs/sampling.md describes every field, its limits and the logprob
distribution). No torch: the scheduler, the gateway and the servicers import this.

Checks that need the model (token ids against the vocabulary, bad words through the tokenizer,
n against the decode batch, sizes against the context and KV) run at admission
(`engine.core.EngineCore.add_request`); everything here is a function of the fields alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidArgumentError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
# Below this a temperature is greedy: dividing logits by 1e-40 overflows to inf and softmax to NaN
# (vLLM draws the same line at 1e-5).
TEMPERATURE_FLOOR = 1e-5
MAX_N = 128                       # sequences per request (OpenAI's limit of `n`)
MAX_LOGPROBS = 20                 # top alternatives per token (OpenAI's `top_logprobs` limit)
MAX_LOGIT_BIAS = 1024             # entries of logit_bias
LOGIT_BIAS_LIMIT = 100.0          # |bias| (OpenAI's range)
PENALTY_LIMIT = 2.0               # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 100.0
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 8           # tokens of one bad word (its last token is the one banned)
# structured output: the grammar engine bounds what it compiles; these bound what is accepted at all
MAX_STRUCTURED_CHARS = 1 << 20    # a schema, regex, grammar or structural tag
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output to a language: exactly one kind is set. The engine compiles it with its
    grammar engine (engine/structured, docs/structured-output.md) and masks every sampled token."""

    json_schema: str | None = None      # a JSON Schema document (text)
    json_object: bool = False           # any JSON object
    regex: str | None = None
    grammar: str | None = None          # EBNF (GBNF dialect)
    choice: tuple[str, ...] | None = None
    structural_tag: str | None = None   # smg/xgrammar structural tag JSON (text)

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise InvalidArgumentError("structured_output.choice", "must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise InvalidArgumentError("structured_output.json_object", "must be a boolean")
        kinds = [name for name in ("json_schema", "regex", "grammar", "structural_tag", "choice")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object else [])
        if len(kinds) != 1:
            raise InvalidArgumentError(
                "structured_output", f"exactly one of json_schema, json_object, regex, grammar, choice, "
                f"structural_tag must be set, got {', '.join(kinds) or 'none'}")
        for name in ("json_schema", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise InvalidArgumentError(f"structured_output.{name}", "must be a non-empty string")
            if len(value) > MAX_STRUCTURED_CHARS:
                raise InvalidArgumentError(f"structured_output.{name}",
                                           f"{len(value)} characters exceed the limit of {MAX_STRUCTURED_CHARS}")
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise InvalidArgumentError("structured_output.choice",
                                           f"must hold 1..{MAX_CHOICES} strings, got {len(self.choice)}")
            for c in self.choice:
                if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                    raise InvalidArgumentError("structured_output.choice",
                                               f"each choice must be 1..{MAX_CHOICE_CHARS} characters, got {c!r:.80}")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(n for n in ("json_schema", "regex", "grammar", "choice", "structural_tag")
                    if getattr(self, n) is not None)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, with vLLM's names and defaults (temperature 1.0,
    max_tokens 16). The CLI and the ninfer.v1 protocol keep their own documented defaults
    (greedy, 64 tokens): see docs/sampling.md."""

    n: int = 1                          # sequences from one prompt (one prefill, shared KV blocks)
    max_tokens: int = 16                # 0 only for scoring (prompt_logprobs set): no token is generated
    temperature: float = 1.0            # 0 = greedy
    top_p: float = 1.0                  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0                      # 0 (or -1) = off
    min_p: float = 0.0                  # drop tokens below min_p x the top probability; 0 = off
    presence_penalty: float = 0.0       # subtracted once from every token already in the output
    frequency_penalty: float = 0.0      # subtracted per occurrence in the output
    repetition_penalty: float = 1.0     # divides positive / multiplies negative logits of prompt or output tokens
    seed: int | None = None             # fixes the random stream of this request
    stop: list[str] | str = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0                 # EOS and stop token ids are masked (stop strings ignored) before this
    logprobs: int | None = None         # per output token: its logprob and the top-N alternatives
    prompt_logprobs: int | None = None  # per prompt token (but the first): its logprob and the top-N
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None   # keep the last N prompt tokens (-1: the context limit)
    structured_output: StructuredOutput | None = None
    draft_tokens: int | None = None     # at most the engine's k; None = the engine's

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidArgumentError("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise InvalidArgumentError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not _is_number(t) or t < 0 or math.isinf(t):
            raise InvalidArgumentError("temperature", f"must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not _is_number(p) or not (0.0 < p <= 1.0):
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidArgumentError("top_k", f"must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgumentError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
                raise InvalidArgumentError(name, f"must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {v!r}")
        r = self.repetition_penalty
        if not _is_number(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            raise InvalidArgumentError("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {r!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidArgumentError("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        self._check_stops()
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidArgumentError("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidArgumentError("min_tokens", f"{self.min_tokens} exceeds max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidArgumentError(name, f"must be an integer in [0, {MAX_LOGPROBS}] (the most top "
                                                 f"alternatives per token), got {v!r}")
        if self.max_tokens == 0 and (self.prompt_logprobs is None or self.n != 1):
            raise InvalidArgumentError("max_tokens", "must be >= 1 (0 only scores the prompt: set prompt_logprobs, n = 1)")
        self._check_logit_bias()
        self._check_bad_words()
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(name, f"must be a boolean, got {getattr(self, name)!r}")
        tp = self.truncate_prompt_tokens
        if tp is not None and (not _is_int(tp) or not (tp >= 1 or tp == -1)):
            raise InvalidArgumentError("truncate_prompt_tokens", f"must be an integer >= 1 (or -1: the context "
                                                                 f"limit), got {tp!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidArgumentError("structured_output", "must be a StructuredOutput")
        if self.draft_tokens is not None and (not _is_int(self.draft_tokens) or not 0 <= self.draft_tokens <= 8):
            raise InvalidArgumentError("draft_tokens", f"must be in [0, 8], got {self.draft_tokens!r}")
        self.temperature = float(t) if t >= TEMPERATURE_FLOOR else 0.0
        self.top_p = float(p)
        self.top_k = max(0, self.top_k)
        self.min_p, self.repetition_penalty = float(self.min_p), float(self.repetition_penalty)
        self.presence_penalty, self.frequency_penalty = float(self.presence_penalty), float(self.frequency_penalty)

    def _check_stops(self) -> None:
        if isinstance(self.stop, str):            # one stop string, as in vLLM (not one per character)
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)):
            raise InvalidArgumentError("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
        self.stop = list(self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgumentError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgumentError(
                    "stop", f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters, got {s!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgumentError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}, got {len(self.stop_token_ids)}")
        if any(not _is_int(i) or i < 0 for i in self.stop_token_ids):
            raise InvalidArgumentError("stop_token_ids", "must be non-negative integers")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise InvalidArgumentError("logit_bias", "must map token ids to numbers")
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidArgumentError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        clean: dict[int, float] = {}
        for k, v in bias.items():
            tid = int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k   # JSON keys are strings
            if not _is_int(tid) or tid < 0:
                raise InvalidArgumentError("logit_bias", f"keys must be token ids >= 0, got {k!r}")
            if not _is_number(v) or not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
                raise InvalidArgumentError("logit_bias", f"bias of token {tid} must be in "
                                                         f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {v!r}")
            clean[tid] = float(v)
        self.logit_bias = clean or None

    def _check_bad_words(self) -> None:
        words = self.bad_words
        if words is None:
            return
        if isinstance(words, str) or not isinstance(words, (list, tuple)):
            raise InvalidArgumentError("bad_words", "must be a list of strings")
        if len(words) > MAX_BAD_WORDS:
            raise InvalidArgumentError("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(words)}")
        for w in words:
            if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
                raise InvalidArgumentError("bad_words", f"each word must be 1..{MAX_BAD_WORD_CHARS} characters "
                                                        f"(not only spaces), got {w!r:.80}")
        self.bad_words = list(words) or None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Options applied to the logits before sampling, on the device, from the request's own token
        history and tables (engine.worker.logit_options): penalties, bias, bad words, min_tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.bad_words)

    @property
    def filters(self) -> bool:
        """top-k, top-p or min_p: a sampled row's distribution is cut (the vocabulary is sorted)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """One position of `logprobs` / `prompt_logprobs`: the token there, its log-probability and rank, and the
    most likely tokens. Every value is from the model's raw distribution: log_softmax of the target model's
    logits at that position, before temperature, penalties, bias or filters (vLLM's default, `raw_logprobs`):
    a property of the model and the text alone, which scoring (lm-evaluation-harness' loglikelihood) needs,
    equal for greedy and sampled requests, and under speculation the verify pass's logits, which are the
    target's (docs/sampling.md). Under structured output the grammar's mask comes first: the distribution
    is over the tokens it allows (as vLLM's)."""

    token_id: int
    logprob: float
    rank: int                                   # 1 = the most likely token at this position
    top: tuple[tuple[int, float], ...] = ()     # (token id, logprob), most likely first; len = the N asked for
