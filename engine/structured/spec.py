"""What a request asks the grammar engine for, checked before anything is compiled. No torch.

`GrammarSpec(kind, text)` is one constraint of `SamplingParams.structured_output`, in the form the
compile cache is keyed by. Construction checks the shape of the text (JSON where JSON is expected, a
non-empty list of strings for `choice`); `check_limits` rejects inputs whose compile time grows with
a bound written in them (xgrammar expands `{m,n}`, `maxLength`, `maxItems` into grammar rules:
`[a-z]{1,5000}` takes about 2 s at a 152k vocabulary) before any compile starts. Every error is an
`InvalidArgumentError` whose field is `structured_output.<kind>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidArgumentError
from engine.sampling_params import StructuredOutput

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")


class GrammarError(InvalidArgumentError):
    """A constraint that cannot be compiled or is over a limit; `kind` is the constraint's field."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"structured_output.{kind}", message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds checked before compiling, and the compile's wall-clock bound (a compile cannot be
    interrupted: past `compile_timeout_s` the request is refused and the compile's result dropped)."""

    max_text_bytes: int = 256 * 1024
    max_repeat: int = 2048           # largest {m,n}, maxLength, maxItems, ... accepted
    max_json_depth: int = 64         # nesting of a JSON schema document
    max_choices: int = 4096
    compile_timeout_s: float = 10.0


def _json(kind: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(kind, f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise GrammarError(kind, "nested too deeply to parse") from None


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: `kind` (one of GRAMMAR_KINDS) and its text (`json_object` has none; `choice`
    is a JSON list of strings). Equal specs share one compiled grammar."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(str(self.kind), f"unknown constraint; expected one of {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(self.text, str):
            raise GrammarError(self.kind, f"must be a string, not {type(self.text).__name__}")
        if self.kind == "json_object":
            object.__setattr__(self, "text", "")
            return
        if not self.text.strip():
            raise GrammarError(self.kind, "must not be empty")
        if self.kind == "json_schema":
            if not isinstance(_json(self.kind, self.text), (dict, bool)):
                raise GrammarError(self.kind, "a JSON schema must be an object or a boolean")
        elif self.kind == "structural_tag":
            tag = _json(self.kind, self.text)
            if not isinstance(tag, dict) or ("format" not in tag and "structures" not in tag):
                raise GrammarError(self.kind, "must be a JSON object with 'format' (or the legacy "
                                              "'structures' and 'triggers')")
        elif self.kind == "choice":
            choices = _json(self.kind, self.text)
            if not isinstance(choices, list) or not choices:
                raise GrammarError(self.kind, "must be a non-empty list of strings")
            for i, c in enumerate(choices):
                if not isinstance(c, str) or not c:
                    raise GrammarError(self.kind, f"choice {i} must be a non-empty string")

    @classmethod
    def from_choices(cls, choices) -> "GrammarSpec":
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def from_structured_output(cls, so: StructuredOutput) -> "GrammarSpec":
        """The one constraint a request's `structured_output` sets (exactly one must be)."""
        chosen = [k for k in GRAMMAR_KINDS if (getattr(so, k) not in (None, False))]
        if len(chosen) != 1:
            raise InvalidArgumentError("structured_output", f"set exactly one of {', '.join(GRAMMAR_KINDS)}; "
                                                            f"got {', '.join(chosen) or 'none'}")
        kind = chosen[0]
        if kind == "json_object":
            return cls(kind)
        if kind == "choice":
            if isinstance(so.choice, str):
                raise GrammarError(kind, "must be a list of strings, not one string")
            return cls.from_choices(so.choice)
        return cls(kind, getattr(so, kind))

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)


# -- limits (cheap, before any compile) ---------------------------------------------------------------

_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_JSON_BOUNDS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties")


def _check_repeats(kind: str, text: str, limit: int, where: str = "") -> None:
    for m in _REPEAT.finditer(text):
        for n in m.groups():
            if n and int(n) > limit:
                raise GrammarError(kind, f"repetition bound {int(n)}{where} is over the limit of {limit}")


def _check_schema(kind: str, node: Any, limits: GrammarLimits, depth: int = 0) -> None:
    if depth > limits.max_json_depth:
        raise GrammarError(kind, f"nested deeper than {limits.max_json_depth} levels")
    if isinstance(node, dict):
        for key in _JSON_BOUNDS:
            v = node.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > limits.max_repeat:
                raise GrammarError(kind, f"{key} {v} is over the limit of {limits.max_repeat}")
        for key in ("pattern", "regex", "grammar"):
            if isinstance(node.get(key), str):
                _check_repeats(kind, node[key], limits.max_repeat, f" in {key}")
        for v in node.values():
            _check_schema(kind, v, limits, depth + 1)
    elif isinstance(node, list):
        for v in node:
            _check_schema(kind, v, limits, depth + 1)


def check_limits(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """Raise GrammarError when `spec` is over one of `limits`."""
    size = len(spec.text.encode("utf-8"))
    if size > limits.max_text_bytes:
        raise GrammarError(spec.kind, f"{size} bytes is over the limit of {limits.max_text_bytes}")
    if spec.kind in ("regex", "grammar"):
        _check_repeats(spec.kind, spec.text, limits.max_repeat)
    elif spec.kind in ("json_schema", "structural_tag"):
        _check_schema(spec.kind, _json(spec.kind, spec.text), limits)
    elif spec.kind == "choice":
        n = len(json.loads(spec.text))
        if n > limits.max_choices:
            raise GrammarError(spec.kind, f"{n} choices is over the limit of {limits.max_choices}")
