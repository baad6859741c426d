"""A strong decode peer: the Qwen3 decode step in plain PyTorch, run the way gpt-fast runs its own.

gpt-fast (pytorch-labs/gpt-fast, generate.py; ideas only, written here from the model's equations):

- a static KV cache per layer, `[kv_heads, max_len, head_dim]` buffers for one sequence; a step
  writes its key and value at `pos` and attends over the whole cache with the mask `key <= pos`;
- attention written out (scores, mask, softmax, weighted sum: what the math SDPA backend computes,
  which gpt-fast selects for decode so that Inductor generates the attention itself);
- the **whole step** -- embedding, every layer, the final norm, lm_head, argmax, the next token and
  position written back on the device -- is one module's forward, compiled whole by
  `torch.compile(fullgraph=True)` (one graph, no Python between layers);
- Inductor as gpt-fast configures it (`INDUCTOR_SETTINGS`): `coordinate_descent_tuning` -- without
  it Inductor leaves one-row matmuls to cuBLAS; with it they become reductions it tunes --, unique
  kernel names and the FX graph cache;
- mode `max-autotune-no-cudagraphs` (autotuning on) with the compiled step captured here as one
  `torch.cuda.CUDAGraph` and replayed, or `reduce-overhead` (Inductor's own CUDA graph per call, as
  gpt-fast's generate.py decodes; captured here instead where Inductor declines its graph, so no
  timed step runs launch by launch); warmed up before anything is timed.

ms per token = wall time of n steps / n, one synchronisation at the end (the step feeds itself).
On the CPU (the bench's dry run, the tests) the same module runs eagerly, or compiled by a backend
that needs no compiler (`backend="eager"`: Dynamo still traces the whole step with fullgraph, so a
graph break fails there); a CPU figure means nothing and says so.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.config import ModelConfig

MODES = ("max-autotune-no-cudagraphs", "reduce-overhead")
DEFAULT_MODE = MODES[0]
INDUCTOR_SETTINGS = {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True, "fx_graph_cache": True}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [heads, D]; cos, sin [D/2]: the half-split rotary form of Qwen3
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [kv, group, D]; k, v [kv, max_len, D]; mask [max_len] bool -> [kv, group, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5      # [kv, group, max_len]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
    return torch.matmul(probs, v)


class DecoderLayer(torch.nn.Module):
    """One layer's weights (q/k/v fused into one matrix, gate/up into another) and its KV cache."""

    def __init__(self, cfg: ModelConfig, rand, ones, max_len: int):
        super().__init__()
        h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        self.heads, self.kv_heads, self.d, self.eps = cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.rms_norm_eps
        param = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.in_norm, self.post_norm, self.q_norm, self.k_norm = param(ones(h)), param(ones(h)), param(ones(d)), param(ones(d))
        self.qkv = param(rand((self.heads + 2 * self.kv_heads) * d, h))
        self.o = param(rand(h, self.heads * d))
        self.gate_up = param(rand(2 * f, h))
        self.down = param(rand(h, f))
        kv_shape = (self.kv_heads, max_len, d)
        self.register_buffer("k_cache", torch.zeros(kv_shape, dtype=self.qkv.dtype, device=self.qkv.device))
        self.register_buffer("v_cache", torch.zeros(kv_shape, dtype=self.qkv.dtype, device=self.qkv.device))

    def forward(self, x, pos, cos, sin, mask):
        """x [1, hidden]; pos [1] int64; cos, sin [D/2]; mask [max_len] bool -> [1, hidden]. The
        matmuls are F.linear on a one-row activation, as gpt-fast writes them."""
        heads, kv_heads, d = self.heads, self.kv_heads, self.d
        h = rms_norm(x, self.in_norm, self.eps)
        q, k, v = F.linear(h, self.qkv)[0].split([heads * d, kv_heads * d, kv_heads * d])
        q = rotate(rms_norm(q.view(heads, d), self.q_norm, self.eps), cos, sin)
        k = rotate(rms_norm(k.view(kv_heads, d), self.k_norm, self.eps), cos, sin)
        self.k_cache.index_copy_(1, pos, k.unsqueeze(1))
        self.v_cache.index_copy_(1, pos, v.view(kv_heads, 1, d))
        o = attend(q.view(kv_heads, heads // kv_heads, d), self.k_cache, self.v_cache, mask)   # [kv, group, D]
        x = x + F.linear(o.reshape(1, heads * d), self.o)
        gate, up = F.linear(rms_norm(x, self.post_norm, self.eps), self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)


class DecodeStep(torch.nn.Module):
    """The whole decode step of one sequence; its state (the token it reads, the position it writes)
    lives in buffers on the device, so a step needs no input and no host read."""

    def __init__(self, cfg: ModelConfig, device: str, dtype: torch.dtype, max_len: int, seed: int = 11):
        super().__init__()
        gen = torch.Generator(device).manual_seed(seed)

        def rand(*shape):    # N(0, 1/fan_in), like the bench's other random models
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * shape[-1] ** -0.5

        def ones(n):
            return torch.ones(n, device=device, dtype=dtype)

        self.eps = cfg.rms_norm_eps
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, rand, ones, max_len) for _ in range(cfg.num_hidden_layers))
        self.embed = torch.nn.Parameter(rand(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        self.final_norm = torch.nn.Parameter(ones(cfg.hidden_size), requires_grad=False)
        self.lm_head = torch.nn.Parameter(rand(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        d = cfg.head_dim
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        angles = torch.arange(max_len, device=device, dtype=torch.float32).unsqueeze(1) * inv   # [max_len, D/2]
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        self.register_buffer("positions", torch.arange(max_len, device=device))
        self.register_buffer("token", torch.zeros(1, dtype=torch.int64, device=device))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.int64, device=device))

    def forward(self) -> None:
        """Decode one token: read `token` at `pos`, write the argmax back, advance `pos`."""
        x = self.embed.index_select(0, self.token)                       # [1, hidden]
        cos, sin = self.cos.index_select(0, self.pos)[0], self.sin.index_select(0, self.pos)[0]
        mask = self.positions <= self.pos                                 # [max_len]
        for layer in self.layers:
            x = layer(x, self.pos, cos, sin, mask)
        logits = F.linear(rms_norm(x, self.final_norm, self.eps), self.lm_head)[0]      # [V]
        self.token.copy_(logits.argmax().view(1))
        self.pos.add_(1)


class CompiledDecodePeer:
    """`DecodeStep` compiled whole and replayed one CUDA graph per step (mode None: eager)."""

    def __init__(self, cfg: ModelConfig, device: str, dtype: torch.dtype, max_len: int,
                 mode: str | None = DEFAULT_MODE, backend: str = "inductor", model: DecodeStep | None = None):
        """`model`: an existing step to compile (its weights and caches shared), else a new random one."""
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)} or None (eager), got {mode!r}")
        self.device, self.mode, self.backend = torch.device(device), mode, backend
        self.model = model if model is not None else DecodeStep(cfg, device, dtype, max_len)
        if mode is None:
            self.step_fn = self.model
        elif backend == "inductor":
            self.step_fn = torch.compile(self.model, fullgraph=True, dynamic=False, mode=mode)
        else:                                          # a compiler-free backend: Dynamo's whole-graph trace only
            self.step_fn = torch.compile(self.model, fullgraph=True, dynamic=False, backend=backend)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.cudagraph_skips = 0                       # Inductor declined its CUDA graph (reduce-overhead)
        self.timings: dict[str, float] = {}

    @property
    def pos(self) -> torch.Tensor:
        return self.model.pos

    @property
    def token(self) -> torch.Tensor:
        return self.model.token

    @torch.inference_mode()
    def step(self) -> None:
        self.step_fn()

    def _settings(self):
        import torch._inductor.config as inductor_config
        return inductor_config.patch(INDUCTOR_SETTINGS)

    def warm(self, steps: int = 3) -> None:
        """Compile (the first call) and warm up; on CUDA, then make sure every timed step is one CUDA
        graph: with `max-autotune-no-cudagraphs` one step is captured here; with `reduce-overhead`
        Inductor records its own, and where it declines (its `cudagraph_skips` counter moved: it then
        runs the compiled kernels one launch at a time, a weaker peer than gpt-fast's) the step is
        captured here all the same. Inductor's settings hold while it compiles, tunes and records."""
        from torch._dynamo.utils import counters
        cuda = self.device.type == "cuda"
        skips_before = counters["inductor"]["cudagraph_skips"]
        with self._settings():
            t0 = time.perf_counter()
            if cuda and self.mode != "reduce-overhead":
                side = torch.cuda.Stream()          # a manual capture wants its warm-up off the capture stream
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(steps):
                        self.step()
                torch.cuda.current_stream().wait_stream(side)
            else:                                   # Inductor's CUDA graph trees manage their own streams
                for _ in range(steps):
                    self.step()
            if cuda:
                torch.cuda.synchronize()
            self.timings["compile_and_warm_s"] = time.perf_counter() - t0
            self.cudagraph_skips = counters["inductor"]["cudagraph_skips"] - skips_before
            if cuda and self.mode is not None and (self.mode != "reduce-overhead" or self.cudagraph_skips):
                t0 = time.perf_counter()
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph), torch.inference_mode():
                    self.step_fn()
                torch.cuda.synchronize()
                self.timings["capture_s"] = time.perf_counter() - t0

    def run(self, start: int, n: int) -> float:
        """n steps from position `start` (the cache before it holds what earlier steps wrote: the same
        work as a real prompt of that length). -> seconds."""
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

    def describe(self) -> dict:
        cuda = self.device.type == "cuda"
        compiled = self.mode is not None and self.backend == "inductor"
        return {"compiled": compiled and cuda, "mode": self.mode, "backend": self.backend, "fullgraph": self.mode is not None,
                "inductor_settings": INDUCTOR_SETTINGS if compiled else None,
                "cuda_graph": ("one torch.cuda.CUDAGraph per step (captured here)" if self.graph is not None else
                               "Inductor's CUDA graph per call" if cuda and self.mode == "reduce-overhead" else None),
                "inductor_cudagraph_skips": self.cudagraph_skips,
                "static_kv_cache": True, "attention": "written out (the math SDPA backend's computation)",
                **{k: round(v, 2) for k, v in self.timings.items()}}


def build(cfg: ModelConfig, device: str, dtype: torch.dtype, max_len: int, mode: str | None = DEFAULT_MODE) -> CompiledDecodePeer:
    """The peer ready to time: compiled, warmed and captured on CUDA; eager on the CPU (dry run)."""
    peer = CompiledDecodePeer(cfg, device, dtype, max_len, mode=mode if device != "cpu" else None)
    peer.warm()
    return peer
