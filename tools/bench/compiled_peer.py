"""A strong decode peer: the Qwen3 decode step written plainly, compiled, one CUDA graph per step.

The style of gpt-fast (pytorch-labs/gpt-fast: a static KV cache, torch.compile, the whole decode
step replayed as one CUDA graph), written here from the model's equations:

- weights as plain tensors in the engine's dtype, random N(0, 1/fan_in) like the bench's other
  random models (q/k/v fused into one matrix, gate/up into another: one GEMV each);
- a static KV cache [kv_heads, max_len, head_dim] per layer for one sequence; a step writes its key
  and value at `pos` and attends over the whole cache with a mask `key position <= pos`;
- one decoder layer is a function compiled by torch.compile (Inductor fuses the norms, rotary and
  the residual adds; the same compiled code serves every layer: the weights are its arguments);
- the whole step (embedding, every layer, the final norm, lm_head, argmax, the next position) is
  captured in one `torch.cuda.CUDAGraph` and replayed, its token and position living on the device.

ms per token = wall time of n replays / n (one synchronisation at the end: the step feeds itself).
On the CPU (the bench's dry run) the same functions run eagerly on the tiny shape, uncompiled and
without a graph, so the code path is exercised; the figure then means nothing and says so.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.config import ModelConfig


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [heads, D]; cos, sin [D/2]: the half-split rotary form of Qwen3
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def decoder_layer(x, pos, cos, sin, mask, k_cache, v_cache, w, cfg_tuple):
    """One layer for one token. x [1, hidden]; pos [1] int64; cos, sin [D/2]; mask [max_len] bool;
    k_cache, v_cache [kv_heads, max_len, D] (written at pos); w: this layer's weights. The matmuls are
    F.linear on a one-row activation, as gpt-fast writes them (cuBLAS's GEMM at M = 1; a 1-D `w @ h`
    is a matrix-vector product that Inductor may decompose into its own reduction)."""
    heads, kv_heads, d, eps = cfg_tuple
    h = rms_norm(x, w["in_norm"], eps)
    qkv = F.linear(h, w["qkv"])[0]                                       # [(heads + 2 kv) * D]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d])
    q = rotate(rms_norm(q.view(heads, d), w["q_norm"], eps), cos, sin)
    k = rotate(rms_norm(k.view(kv_heads, d), w["k_norm"], eps), cos, sin)
    k_cache.index_copy_(1, pos, k.unsqueeze(1))
    v_cache.index_copy_(1, pos, v.view(kv_heads, 1, d))
    o = F.scaled_dot_product_attention(q.view(kv_heads, heads // kv_heads, d), k_cache, v_cache,
                                       attn_mask=mask.view(1, 1, -1))             # [kv, group, D]
    x = x + F.linear(o.reshape(1, heads * d), w["o"])
    h = rms_norm(x, w["post_norm"], eps)
    gate, up = F.linear(h, w["gate_up"]).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w["down"])


class CompiledDecodePeer:
    def __init__(self, cfg: ModelConfig, device: str, dtype: torch.dtype, max_len: int, compile: bool = True):
        self.cfg, self.device, self.max_len = cfg, torch.device(device), max_len
        gen = torch.Generator(device).manual_seed(11)
        h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * shape[-1] ** -0.5

        ones = lambda n: torch.ones(n, device=device, dtype=dtype)  # noqa: E731
        self.layers = [dict(in_norm=ones(h), post_norm=ones(h), q_norm=ones(d), k_norm=ones(d),
                            qkv=rand(qkv_rows, h), o=rand(h, cfg.num_attention_heads * d),
                            gate_up=rand(2 * f, h), down=rand(h, f)) for _ in range(cfg.num_hidden_layers)]
        self.embed = rand(cfg.vocab_size, h)
        self.final_norm = ones(h)
        self.lm_head = rand(cfg.vocab_size, h)
        # one tensor per layer (not views of one): the compiled layer sees identical inputs every layer
        kv_shape = (cfg.num_key_value_heads, max_len, d)
        self.k_cache = [torch.zeros(kv_shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(kv_shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        angles = torch.arange(max_len, device=device, dtype=torch.float32).unsqueeze(1) * inv   # [max_len, D/2]
        self.cos, self.sin = angles.cos(), angles.sin()
        self.positions = torch.arange(max_len, device=device)
        self.cfg_tuple = (cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.rms_norm_eps)
        self.layer_fn = torch.compile(decoder_layer, fullgraph=True, dynamic=False) if compile else decoder_layer
        # the step's state on the device: the token it reads and the position it writes
        self.token = torch.zeros(1, dtype=torch.int64, device=device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    @torch.inference_mode()
    def step(self) -> None:
        """Decode one token: read self.token at self.pos, write the argmax back, advance pos."""
        x = self.embed.index_select(0, self.token)                       # [1, hidden]; no host read of the token
        cos, sin = self.cos.index_select(0, self.pos)[0], self.sin.index_select(0, self.pos)[0]
        mask = self.positions <= self.pos
        for i, w in enumerate(self.layers):
            x = self.layer_fn(x, self.pos, cos, sin, mask, self.k_cache[i], self.v_cache[i], w, self.cfg_tuple)
        logits = F.linear(rms_norm(x, self.final_norm, self.cfg.rms_norm_eps), self.lm_head)[0]
        self.token.copy_(logits.argmax().view(1))
        self.pos.add_(1)

    def capture(self, warmup: int = 3) -> None:
        """Warm the compiled code on a side stream, then capture one step as a CUDA graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def run(self, start: int, n: int) -> float:
        """n steps from position `start` (the cache before it holds whatever earlier steps wrote: the
        same work as a real prompt of that length). -> seconds."""
        self.pos.fill_(start)
        self.token.fill_(1)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()
        sync()
        return time.perf_counter() - t0


def measure(cfg: ModelConfig, device: str, dtype: torch.dtype, context: int, new_tokens: int,
            repeats: int = 3) -> dict:
    """The peer's ms per token at batch 1 around `context` (graph + compile on CUDA, eager on CPU)."""
    cuda = device != "cpu"
    t0 = time.perf_counter()
    peer = CompiledDecodePeer(cfg, device, dtype, max_len=context + new_tokens + 8, compile=cuda)
    if cuda:
        peer.capture()
    setup_s = time.perf_counter() - t0
    runs = [peer.run(context, new_tokens) for _ in range(repeats)]
    ms = [r / new_tokens * 1e3 for r in runs]
    return {"context": context, "new_tokens": new_tokens, "ms_per_token_best": min(ms), "ms_per_token": ms,
            "compiled": cuda, "cuda_graph": cuda, "setup_s": round(setup_s, 2),
            "note": None if cuda else "CPU dry run: eager, uncompiled, no graph (a code-path check, not a figure)"}
