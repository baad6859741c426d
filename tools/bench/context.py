"""The state one run shares between its sections: plan, device, shape, results, the engine pool,
the current section's budget, and the rates measured so far (which predict the next points' time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.bench import derive, report, shapes
from tools.bench.plan import Plan
from tools.bench.progress import Budget
from tools.bench.session import EnginePool, EngineSpec

# Guesses used only to predict a point's time before anything was measured on this device.
GUESS_MFU = 0.25                     # of the measured matmul rate, for a first prefill
GUESS_ENGINE_BUILD_S = {"cuda": 30.0, "cpu": 3.0}
GUESS_PEER_DECODE_S = {"cuda": 0.1, "cpu": 0.02}


class Bench:
    def __init__(self, plan: Plan, device: str, results: dict[str, Any], out_dir: Path,
                 acceptance_model: Path | None, write_plots: bool = True):
        self.plan = plan
        self.device = device
        self.kind = "cpu" if device == "cpu" else "cuda"
        self.shape = plan.shape
        self.cfg = shapes.model_config(plan.shape)
        self.results = results
        self.out_dir = out_dir
        self.acceptance_model = acceptance_model
        self.write_plots = write_plots
        self.pool = EnginePool()
        self.budget = Budget(1e9)
        self._flops_rate: dict[str, float] = {}       # who -> achieved prefill FLOP/s (latest)

    # -- results --------------------------------------------------------------------------------

    def section(self, name: str) -> dict[str, Any]:
        return self.results["sections"].setdefault(name, {})

    def save(self, full: bool = False) -> None:
        """Derive the figures and write results.json (and, when `full`, the summary and plots).
        Called after every figure, so a run cut short keeps what it measured."""
        derive.annotate(self.results)
        report.write(self.results, self.out_dir, summary=full, plots=full and self.write_plots)

    # -- the engine under test ------------------------------------------------------------------

    @property
    def model(self) -> str:
        return f"preset:{self.shape}"

    def engine_spec(self, **overrides) -> EngineSpec:
        base = dict(model=self.model, device=self.device, prefill_chunk=self.plan.chunk,
                    kv_capacity=self.plan.kv_capacity, max_model_len=self.plan.kv_capacity)
        base.update(overrides)
        return EngineSpec(**base)

    def gpu_count(self) -> int:
        if self.kind == "cpu":
            return 0
        import torch
        return torch.cuda.device_count()

    def build_guess_s(self) -> float:
        """Predicted seconds to build and warm an engine: the last build's, else a guess."""
        return self.pool.last_setup_s or GUESS_ENGINE_BUILD_S[self.kind]

    # -- limits and predictions -----------------------------------------------------------------

    def roofline(self) -> tuple[float | None, float | None]:
        """(copy bandwidth B/s, matmul FLOP/s) measured in this run (or a merged one), else None."""
        return derive.roofline_of(self.results, self.results["run"]["run_id"])

    def floor_ms(self, context: float, kv_dtype: str = "bfloat16", tp: int = 1, cfg=None) -> float | None:
        bw, _ = self.roofline()
        if bw is None:
            return None
        dtype = "bfloat16" if self.kind == "cuda" else "float32"
        kv = dtype if kv_dtype in ("auto", None) else kv_dtype
        return shapes.decode_floor_ms(cfg or self.cfg, context, bw, dtype, kv, tp)

    def mfu_text(self, P: int, tok_s: float) -> str:
        _, mm = self.roofline()
        return "-" if mm is None else f"{shapes.mfu(self.cfg, P, tok_s, mm):.2f}"

    def note_prefill_rate(self, who: str, P: int, tok_s: float, cfg=None) -> None:
        if tok_s > 0:
            self._flops_rate[who] = shapes.prefill_flops_per_token(cfg or self.cfg, P) * tok_s

    def estimate_prefill_s(self, P: int, who: str = "engine", cfg=None) -> float:
        """Predicted seconds of one prefill of P tokens; 0 when nothing is known yet (CPU dry runs)."""
        rate = next((self._flops_rate[w] for w in (who, "engine", "engine-with-decode", "peer") if w in self._flops_rate),
                    None)
        if rate is None:
            _, mm = self.roofline()
            if mm is None or self.kind == "cpu":
                return 0.0
            rate = GUESS_MFU * mm
        return shapes.prefill_flops(cfg or self.cfg, P) / rate

    def peer_decode_guess_s(self) -> float:
        return GUESS_PEER_DECODE_S[self.kind]
