"""The embedded default model: a tiny Qwen3 with one MTP layer and a byte-level tokenizer, built
deterministically in well under a second, so that `ninfer` runs anywhere with no download.

Its weights are random (seeded): it serves plumbing, demos and tests, not text quality. The
embedding rows of printable ASCII bytes are scaled up so that the (tied) lm_head mostly emits
readable characters, and the end-of-text row is scaled down so that demos stream for a while.
"""

from __future__ import annotations

import torch
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from engine.config import ModelConfig
from engine.loading.checkpoint import TensorWeights
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "ninfer-embedded-tiny"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID = 0
SEED = 20261130

DEFAULT_CONFIG = ModelConfig(
    vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1_000_000.0,
    rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
    mtp_num_hidden_layers=1, eos_token_ids=(EOS_ID,),
)


def _byte_to_unicode() -> dict[int, str]:
    """The printable stand-in for each byte that byte-level BPE vocabularies use (GPT-2 convention)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_default_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in _byte_to_unicode().items():
        vocab[ch] = len(SPECIAL_TOKENS) + b
    inner = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return Tokenizer(inner, DEFAULT_CONFIG.eos_token_ids)


def build_default_weights(cfg: ModelConfig = DEFAULT_CONFIG) -> TensorWeights:
    gen = torch.Generator().manual_seed(SEED)
    shapes = _shapes(cfg)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * (1.0 / shape[1] ** 0.5)
    embed = tensors["model.embed_tokens.weight"]
    row_scale = torch.full((cfg.vocab_size,), 0.3)
    printable = [len(SPECIAL_TOKENS) + b for b in [*range(0x20, 0x7F), 0x0A]]
    row_scale[printable] = 3.0
    row_scale[EOS_ID] = 0.1
    tensors["model.embed_tokens.weight"] = embed * row_scale.unsqueeze(1)
    return TensorWeights(tensors)


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return Qwen3ForCausalLM(cfg, with_mtp=True).checkpoint_shapes()
