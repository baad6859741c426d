"""How close a checkpoint's activations come to float16's range, layer by layer: run before `--dtype float16`.

    python -m tools.dev.float16_headroom MODEL [--device cuda --dtype bfloat16] [--json out.json]

Runs the engine (float32 on the CPU by default) on a few prompts and greedy continuations with forward hooks
on every decoder layer (they observe, nothing changes) and reports, per layer, the largest |value| of

- the residual stream the layer hands on, and the final stream the last norm reads;
- the outputs that the engine keeps in float16 under `--dtype float16` and adds into the stream: attention's
  o_proj, the Gated DeltaNet's out_proj, a sparse MoE block's output;
- the dense MLP's SwiGLU product (down_proj's input; with the neuron that holds the peak) and its down_proj
  output;
- and counts the token positions whose final hidden state is not finite (run it with `--dtype float16` to see
  whether anything overflowed).

Under `--dtype float16` the engine keeps the stream in float32 (engine.layers.norm) and computes the dense
MLP's SwiGLU in float32, dividing each row whose peak exceeds 4096 by a power of two before down_proj and
handing the output on in float32 (engine.layers.mlp). So the stream, the SwiGLU product and the dense down_proj
output may exceed 65504; the float16 outputs above must not. The verdict line says which case a model is in.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from engine import LLM, SamplingParams
from engine.loading.checkpoint import FLOAT16_MAX
from tools.dev.capability_check import PROMPTS

# a decoder layer's modules whose float16 output is added into the stream ("mlp": a sparse MoE block)
FLOAT16_WRITERS = ("self_attn.o_proj", "linear_attn.out_proj", "mlp")


@dataclass
class Headroom:
    """Largest |value| seen, per decoder layer (index) and over the model."""

    stream: dict[int, float] = field(default_factory=lambda: defaultdict(float))        # after layer i
    final_stream: float = 0.0                                                            # what the last norm reads
    writers: dict[str, float] = field(default_factory=lambda: defaultdict(float))       # "3.self_attn.o_proj"
    swiglu: dict[int, tuple[float, int]] = field(default_factory=dict)                   # layer -> (peak, neuron)
    mlp_outputs: dict[int, float] = field(default_factory=lambda: defaultdict(float))   # dense down_proj outputs
    stream_dtypes: set[str] = field(default_factory=set)
    nonfinite_rows: int = 0          # token positions whose final hidden state holds inf or NaN (an overflow)

    @property
    def stream_peak(self) -> float:
        return max([self.final_stream, *self.stream.values()])

    @property
    def writer_peak(self) -> float:
        return max(self.writers.values(), default=0.0)

    @property
    def swiglu_peak(self) -> float:
        return max((peak for peak, _ in self.swiglu.values()), default=0.0)

    def verdict(self) -> str:
        if self.nonfinite_rows:
            return f"{self.nonfinite_rows} token positions overflowed: their final hidden states hold inf or NaN"
        if self.writer_peak >= FLOAT16_MAX:
            worst = max(self.writers, key=self.writers.get)
            return (f"{worst} writes {self.writer_peak:.0f}, beyond float16's {FLOAT16_MAX:.0f}: --dtype float16 "
                    "would overflow there (use bfloat16 or float32)")
        beyond = [f"the stream reaches {self.stream_peak:.0f}"] if self.stream_peak >= FLOAT16_MAX else []
        if self.swiglu_peak >= FLOAT16_MAX:
            layer = max(self.swiglu, key=lambda i: self.swiglu[i][0])
            beyond.append(f"layer {layer}'s SwiGLU product reaches {self.swiglu_peak:.0f} (neuron "
                          f"{self.swiglu[layer][1]})")
        if beyond:
            return (f"{' and '.join(beyond)}: float16 runs only because the engine keeps the stream in float32 and "
                    f"rescales SwiGLU rows; the largest float16 output is {self.writer_peak:.0f}")
        peak = max(self.stream_peak, self.writer_peak, self.swiglu_peak, 1e-9)
        return (f"fits float16: stream peak {self.stream_peak:.1f}, float16 output peak {self.writer_peak:.1f}, "
                f"SwiGLU peak {self.swiglu_peak:.1f} ({FLOAT16_MAX / peak:.0f}x headroom)")

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(stream=dict(self.stream), writers=dict(self.writers), mlp_outputs=dict(self.mlp_outputs),
                 swiglu={i: list(v) for i, v in self.swiglu.items()}, stream_dtypes=sorted(self.stream_dtypes),
                 stream_peak=self.stream_peak, writer_peak=self.writer_peak, swiglu_peak=self.swiglu_peak,
                 verdict=self.verdict())
        return d


class HeadroomProbe:
    """Forward hooks on the decoder of an LLM's rank-0 model; `close()` removes them."""

    def __init__(self, llm: LLM):
        decoder = llm.engine.executor.driver.model.model          # rank 0's decoder
        self.found = Headroom()
        self._hooks = [decoder.norm.register_forward_pre_hook(self._on_final_norm),
                       decoder.register_forward_hook(self._on_decoder)]
        for i, layer in enumerate(decoder.layers):
            self._hooks.append(layer.register_forward_hook(lambda m, a, out, i=i: self._on_layer(i, out)))
            modules = dict(layer.named_modules())
            for name in FLOAT16_WRITERS:
                module = modules.get(name)
                if module is not None and not (name == "mlp" and hasattr(module, "down_proj")):
                    self._hooks.append(module.register_forward_hook(
                        lambda m, a, out, key=f"{i}.{name}": self._on_writer(key, out)))
            down = modules.get("mlp.down_proj")
            if down is not None:                                     # a dense MLP
                self._hooks.append(down.register_forward_pre_hook(lambda m, a, i=i: self._on_swiglu(i, a[0])))
                self._hooks.append(down.register_forward_hook(lambda m, a, out, i=i: self._on_mlp_output(i, out)))

    def _on_layer(self, i: int, out) -> None:
        x, residual = out                        # the layer's output (partial with TP > 1) and the stream so far
        self.found.stream[i] = max(self.found.stream[i], float(residual.abs().max()))
        self.found.stream_dtypes.add(str(residual.dtype).removeprefix("torch."))

    def _on_final_norm(self, module, args) -> None:
        x, residual = args if len(args) == 2 else (args[0], None)
        final = x.float() + residual.float() if residual is not None else x.float()
        self.found.final_stream = max(self.found.final_stream, float(final.abs().max()))

    def _on_decoder(self, module, args, out) -> None:
        self.found.nonfinite_rows += int((~torch.isfinite(out)).any(-1).sum())

    def _on_writer(self, key: str, out) -> None:
        self.found.writers[key] = max(self.found.writers[key], float(out.abs().max()))

    def _on_swiglu(self, i: int, product: torch.Tensor) -> None:
        # product: [T, f], as down_proj receives it (under float16, rows already divided by their scale)
        peaks = product.float().abs().amax(0)
        neuron = int(peaks.argmax())
        if float(peaks[neuron]) > self.found.swiglu.get(i, (0.0, -1))[0]:
            self.found.swiglu[i] = (float(peaks[neuron]), neuron)

    def _on_mlp_output(self, i: int, out) -> None:
        self.found.mlp_outputs[i] = max(self.found.mlp_outputs[i], float(out.abs().max()))

    def close(self) -> Headroom:
        for h in self._hooks:
            h.remove()
        return self.found


def measure(llm: LLM, prompts: list[str] = PROMPTS, max_tokens: int = 32) -> Headroom:
    probe = HeadroomProbe(llm)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    finally:
        found = probe.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_capacity=8192, enforce_eager=True)
    found = measure(llm, max_tokens=args.max_tokens)
    for i in sorted(found.stream):
        writers = {k.split(".", 1)[1]: round(v, 1) for k, v in found.writers.items() if k.split(".")[0] == str(i)}
        swiglu = found.swiglu.get(i)
        mlp = (f"  SwiGLU {swiglu[0]:.1f} (neuron {swiglu[1]}), down_proj {found.mlp_outputs[i]:.1f}"
               if swiglu else "")
        print(f"layer {i:3d}  stream {found.stream[i]:12.1f}  float16 outputs {writers}{mlp}")
    print(f"final stream {found.final_stream:.1f}")
    print(found.verdict())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, **found.as_dict()}, f, indent=2)


if __name__ == "__main__":
    main()
