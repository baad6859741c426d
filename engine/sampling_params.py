"""Per-request sampling settings, validated when constructed."""

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


@dataclass(frozen=True)
class StructuredOutput:
    json_schema: str | None = None      # a JSON Schema document (text)
    json_object: bool = False           # any JSON object
    regex: str | None = None
    grammar: str | None = None          # EBNF (GBNF dialect)
    choice: tuple[str, ...] | None = None
    structural_tag: str | None = None   # smg/xgrammar structural tag JSON (text)


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0            # 0 = greedy
    top_p: float = 1.0                  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0                      # 0 = off
    seed: int | None = None             # fixes the random stream of this request
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    draft_tokens: int | None = None     # at most the engine's k; None = the engine's
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise InvalidArgumentError("temperature", f"must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not (0.0 < p <= 1.0):
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InvalidArgumentError("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgumentError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgumentError(
                    "stop", f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters, got {s!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgumentError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}, got {len(self.stop_token_ids)}")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.stop_token_ids):
            raise InvalidArgumentError("stop_token_ids", "must be non-negative integers")
        if self.draft_tokens is not None and (
                isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int)
                or not 0 <= self.draft_tokens <= 8):
            raise InvalidArgumentError("draft_tokens", f"must be in [0, 8], got {self.draft_tokens!r}")
        self.temperature = float(t) if t >= TEMPERATURE_FLOOR else 0.0
        self.top_p = float(p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
