"""Hugging Face checkpoint directories: config, tokenizer, and safetensors weights (single or sharded).

Tensor names and shapes are checked from the safetensors headers before any weight is read, so a
wrong checkpoint fails with one error naming every problem and nothing half-loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError

log = structlog.get_logger(__name__)

MTP_PREFIX = "mtp."


class CheckpointWeights:
    """Tensors of one checkpoint, read lazily file by file."""

    def __init__(self, files: dict[str, Path], stored: dict[str, str] | None = None):
        self._file_of = files                        # tensor name -> file
        self._stored = stored or {}                  # tensor name -> name in the file, where renamed

    @classmethod
    def from_dir(cls, path: Path) -> "CheckpointWeights":
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: path / fname for name, fname in weight_map.items()}
            absent = sorted({str(f.name) for f in files.values() if not f.exists()})
            if absent:
                raise ModelLoadError(f"{path}: index names missing shard files: {', '.join(absent)}")
            return cls(files)
        if single.exists():
            with safe_open(single, "pt") as f:
                return cls({name: single for name in f.keys()})
        raise ModelLoadError(f"{path}: no model.safetensors or model.safetensors.index.json")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for file, names in self._by_file().items():
            with safe_open(file, "pt") as f:
                present = set(f.keys())
                for name in names:
                    stored = self._stored.get(name, name)
                    if stored not in present:
                        raise ModelLoadError(f"{file.name}: the index lists {stored} but the file lacks it")
                    out[name] = tuple(f.get_slice(stored).get_shape())
        return out

    def dtypes(self) -> dict[str, str]:
        """The safetensors header dtype of every tensor ("BF16", "U8", "F8_E4M3", ...)."""
        out: dict[str, str] = {}
        for file, names in self._by_file().items():
            with safe_open(file, "pt") as f:
                for name in names:
                    out[name] = f.get_slice(self._stored.get(name, name)).get_dtype()
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file, names in self._by_file().items():
            with safe_open(file, "pt") as f:
                for name in names:
                    yield name, f.get_tensor(self._stored.get(name, name))

    def without(self, prefix: str) -> "CheckpointWeights":
        return CheckpointWeights({n: f for n, f in self._file_of.items() if not n.startswith(prefix)}, self._stored)

    def only(self, prefix: str) -> "CheckpointWeights":
        return CheckpointWeights({n: f for n, f in self._file_of.items() if n.startswith(prefix)}, self._stored)

    def merged(self, other: "CheckpointWeights") -> "CheckpointWeights":
        """These tensors and `other`'s (names must not repeat), each read from its own files."""
        both = set(self._file_of) & set(other._file_of)
        if both:
            raise ModelLoadError(f"tensors in both checkpoints: {', '.join(sorted(both)[:4])}")
        return CheckpointWeights({**self._file_of, **other._file_of}, {**self._stored, **other._stored})

    def renamed(self, rename: Callable[[str], str | None]) -> "CheckpointWeights":
        """The tensors under new names (`rename` returns None to drop one); nothing is read."""
        files, stored = {}, {}
        for name, file in self._file_of.items():
            new = rename(name)
            if new is not None:
                files[new], stored[new] = file, self._stored.get(name, name)
        return CheckpointWeights(files, stored)

    def _by_file(self) -> dict[Path, list[str]]:
        grouped: dict[Path, list[str]] = {}
        for name, file in self._file_of.items():
            grouped.setdefault(file, []).append(name)
        return grouped


class TensorWeights:
    """Weights held in memory (the embedded default model, random benchmark weights)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self._tensors.items()}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._tensors.items())

    def without(self, prefix: str) -> "TensorWeights":
        return TensorWeights({n: t for n, t in self._tensors.items() if not n.startswith(prefix)})


class RandomWeights:
    """Seeded random tensors made on the target device, one at a time (benchmarks of large shapes:
    speed does not depend on the values). Norm weights are ones; matrices have std 1/sqrt(fan_in)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: str = "cpu", seed: int = 0):
        self._shapes, self.device, self.seed = shapes, device, seed

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        gen = torch.Generator(self.device).manual_seed(self.seed)
        for name, shape in sorted(self._shapes.items()):
            if len(shape) == 1:
                yield name, torch.ones(shape, device=self.device)
            else:
                t = torch.randn(shape, generator=gen, device=self.device, dtype=torch.bfloat16)
                yield name, t.mul_(shape[1] ** -0.5)

    def on(self, device) -> "RandomWeights":
        """The same tensors, made on another device (each tensor-parallel rank makes its own)."""
        return RandomWeights(self._shapes, str(device), self.seed)

    def without(self, prefix: str) -> "RandomWeights":
        return RandomWeights({n: s for n, s in self._shapes.items() if not n.startswith(prefix)},
                             self.device, self.seed)


@dataclass
class ModelDir:
    path: Path
    config: ModelConfig
    tokenizer_file: Path
    weights: CheckpointWeights


def read_model_dir(path: str | Path) -> ModelDir:
    path, config, weights = read_checkpoint(path)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.exists():
        raise ModelLoadError(f"{path}: no tokenizer.json")
    return ModelDir(path, config, tokenizer_file, weights)


def read_checkpoint(path: str | Path) -> tuple[Path, ModelConfig, "CheckpointWeights"]:
    """A checkpoint directory's config (with its quantization, ModelOpt's hf_quant_config.json included)
    and its weights (a Qwen3.5 vision-language checkpoint's as its language model); no tokenizer needed."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path}: no config.json")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file}: not valid JSON ({e})") from None
    modelopt = path / "hf_quant_config.json"
    if modelopt.exists() and not hf.get("quantization_config"):
        from engine.quant.scheme import from_hf_quant_config
        hf["quantization_config"] = from_hf_quant_config(json.loads(modelopt.read_text()))
    eos: tuple[int, ...] = ()
    gen = path / "generation_config.json"
    if gen.exists():
        value = json.loads(gen.read_text()).get("eos_token_id")
        eos = tuple(value) if isinstance(value, list) else (() if value is None else (int(value),))
    config = ModelConfig.from_hf(hf, eos)
    weights = CheckpointWeights.from_dir(path)
    if config.model_type in ("qwen3_5", "qwen3_5_moe"):
        weights = language_model_weights(weights, path)
    return path, config, weights


def language_model_weights(weights: CheckpointWeights, path: Path) -> CheckpointWeights:
    """A Qwen3_5(Moe)ForConditionalGeneration checkpoint as its language model: `model.language_model.X`
    becomes `model.X`; the vision tower (`model.visual.*`) is skipped."""
    skipped = []

    def rename(name: str) -> str | None:
        if name.startswith(("model.visual.", "visual.")):
            skipped.append(name)
            return None
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        return name
    renamed = weights.renamed(rename)
    if skipped:
        log.info("vision_tower_skipped", model=str(path), tensors=len(skipped),
                 detail="ninfer serves the language model of Qwen3_5ForConditionalGeneration; images are not supported")
    return renamed


FLOAT_DTYPES = ("F32", "BF16", "F16")


def check_dtypes(found: dict[str, str], where: str) -> None:
    """Unquantized checkpoints only: one error naming every tensor stored in another dtype."""
    wrong = sorted(f"{n} {d}" for n, d in found.items() if d not in FLOAT_DTYPES)
    if wrong:
        shown = ", ".join(wrong[:8]) + (f" and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        raise ModelLoadError(f"{where}: tensors of an unsupported dtype ({len(wrong)}; supported: "
                             f"{', '.join(FLOAT_DTYPES)}): {shown}")


def check_tensors(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], where: str) -> None:
    """One error naming every missing, unexpected and wrongly shaped tensor."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(n for n in set(found) - set(expected) if not n.endswith("rotary_emb.inv_freq"))
    wrong = sorted(f"{n} {list(found[n])} (expected {list(expected[n])})"
                   for n in set(expected) & set(found) if tuple(found[n]) != tuple(expected[n]))
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            problems.append(f"{label} tensors ({len(names)}): {shown}")
    if problems:
        raise ModelLoadError(f"{where}: " + "; ".join(problems))


FLOAT16_MAX = 65504.0


def checked_for_float16(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a checkpoint loaded into a float16 model (--dtype float16: GPUs without bfloat16), each
    refused, by name, when a finite value lies beyond float16's range (it would load as infinity). bfloat16
    keeps float32's exponent, so a trained weight may; Qwen3's and Qwen3.5's do not (the tests load both).
    Quantized codes and FP8 scales (|x| <= 448) pass unchecked."""
    for name, tensor in weights:
        if tensor.dtype in (torch.bfloat16, torch.float32, torch.float64) and tensor.numel():
            largest = float(tensor.abs().amax())
            if FLOAT16_MAX < largest < float("inf"):
                raise ModelLoadError(f"{name}: holds {largest:.6g}, beyond float16's range (+-{FLOAT16_MAX:.0f}); "
                                     "this checkpoint cannot load with --dtype float16: use bfloat16 or float32")
        yield name, tensor
