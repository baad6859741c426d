"""Embedding checkpoints: how a model directory says it is an embedder, and how its weights load.

Qwen3-Embedding is published as a sentence-transformers model: `config.json` names the decoder
(`Qwen3ForCausalLM`), and `modules.json` lists the pipeline -- the transformer, a `Pooling` module whose
`1_Pooling/config.json` sets `pooling_mode_lasttoken`, and a `Normalize` module (L2). vLLM reads the same
file to pick its pooler (`--runner auto`); here it is the one signal: a directory with a Pooling module
embeds, one without is generative and its `Embed` answers UNIMPLEMENTED.

The embedding is the final-normed hidden state of the prompt's last token (the transformer's
`last_hidden_state[-1]`), L2-normalised when the pipeline has a Normalize module. Checkpoints saved
from the bare transformer (`embed_tokens.weight`, `layers.0...`, no `model.` prefix and no lm_head)
load as Qwen3ForCausalLM weights with the prefix added and the head tied to the embedding (its logits
are never read).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...]           # pooling_mode_* set true in the Pooling module's config ("lasttoken", ...)
    normalize: bool                  # a Normalize module follows

    @property
    def last_token(self) -> bool:
        return self.modes == ("lasttoken",)


def read_pooling(path: Path) -> Pooling | None:
    """The directory's sentence-transformers pooling, or None (a generative model)."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        pool = next((m for m in modules if m.get("type") == POOLING_MODULE), None)
        if pool is None:
            return None
        config = json.loads((path / pool.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ModelLoadError(f"{modules_file}: unreadable sentence-transformers pipeline ({e})") from None
    modes = tuple(sorted(k[len("pooling_mode_"):] for k, v in config.items()
                         if k.startswith("pooling_mode_") and v is True))
    return Pooling(modes, any(m.get("type") == NORMALIZE_MODULE for m in modules))


def embedder_weights(weights):
    """A bare-transformer checkpoint's tensors under Qwen3ForCausalLM names (`model.` prefixed)."""
    names = list(weights.shapes())
    if any(n.startswith("model.") for n in names) or "embed_tokens.weight" not in names:
        return weights
    return weights.renamed(lambda n: n if n.startswith(("model.", "lm_head.", "mtp.")) else "model." + n)
