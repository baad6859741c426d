"""The MTP head from another checkpoint (`--speculative-model DIR`, or `--speculative-config` as vLLM spells it:
{"model": DIR, "num_speculative_tokens": k, "method": "mtp"}).

Quantizers drop what transformers does not know: ModelOpt's export, gptqmodel on Qwen3 and AutoAWQ write no
`mtp.*` tensors, so a quantized base cannot speculate alone. The head is then read from another directory --
the bf16 model it was quantized from, or any checkpoint of the same shape, quantized or not (in its own
layout: a GPTQ base may draft with a bf16 or an NVFP4 head). Only its `mtp.*` tensors are read; its config
must describe the base's shape (the head runs on the base's hidden states, embeddings and lm_head), checked
field by field before any weight is read, and its tensors are then checked by name and shape with the base's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import structlog

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.loading.checkpoint import MTP_PREFIX, CheckpointWeights, read_checkpoint

log = structlog.get_logger(__name__)

# the fields the MTP layer's shapes and numerics depend on
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "rms_norm_eps", "is_hybrid", "partial_rotary_factor", "attn_output_gate")


@dataclass(frozen=True)
class MTPHead:
    path: Path
    layers: int                                  # mtp_num_hidden_layers
    weights: CheckpointWeights                   # the mtp.* tensors only
    quant: object                                # its QuantScheme (resolved over the mtp.* tensors), or None


def read_mtp_head(path: str | Path, base: ModelConfig) -> MTPHead:
    where = f"--speculative-model {path}"
    try:
        path, cfg, weights = read_checkpoint(path)
    except ModelLoadError as e:
        raise ModelLoadError(f"{where}: {e}") from None
    head = weights.only(MTP_PREFIX)
    names = list(head.shapes())
    if not names:
        raise ModelLoadError(f"{where}: the checkpoint has no mtp.* tensors (an MTP head to draft with)")
    wrong = [f"{f} {getattr(cfg, f)!r} (the base model's: {getattr(base, f)!r})"
             for f in SHAPE_FIELDS if getattr(cfg, f) != getattr(base, f)]
    if wrong:
        raise ModelLoadError(f"{where}: its MTP head does not fit the base model: {'; '.join(wrong)}")
    layers = cfg.mtp_num_hidden_layers or len({n.split(".")[2] for n in names if n.startswith("mtp.layers.")})
    quant = cfg.quant
    if quant is not None:
        from engine.quant.scheme import resolve_checkpoint
        try:
            quant = resolve_checkpoint(quant, head)
        except ModelLoadError as e:
            raise ModelLoadError(f"{where}: {e}") from None
    return MTPHead(path, layers, head, quant)


def with_mtp_head(config: ModelConfig, weights, head: MTPHead, online: str | None = None):
    """(config, weights) of the base with `head` as its MTP layers; an unquantized head is quantized at load
    too when the base is (`online`: the --quantization method)."""
    from engine.quant.scheme import joined
    if any(n.startswith(MTP_PREFIX) for n in weights.shapes()):
        log.info("mtp_head_replaced", source=str(head.path), detail="the base's own mtp.* tensors are not used")
    quant = head.quant
    if quant is None and online is not None:
        from engine.quant.online import online_scheme
        quant = online_scheme(online, replace(config, quant=None), head.weights.shapes())
    log.info("mtp_head", source=str(head.path), layers=head.layers,
             quantized=quant.format if quant is not None else None)
    merged = weights.without(MTP_PREFIX).merged(head.weights)
    return replace(config, mtp_num_hidden_layers=head.layers, quant=joined(config.quant, MTP_PREFIX, quant)), merged
