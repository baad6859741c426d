"""`ninfer quantize --format nvfp4|fp8 --model DIR --out DIR`: a quantized copy of a bf16/fp32
Hugging Face checkpoint in the exact layouts the engine (and vLLM, SGLang, TensorRT-LLM) load.

Every linear layer is rounded to nearest with absmax scales (`engine.quant.formats`); the
embeddings and lm_head stay as they are (ModelOpt and Qwen's FP8 releases keep them too). The MTP
layer's linears (its `fc` and decoder layer) are quantized like the main model's -- the draft runs k
times a round, so its bytes count -- unless `--keep-mtp` lists `mtp` among the excluded modules.

Shard files are converted one at a time, so memory holds one shard and its quantized copy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from engine.errors import ModelLoadError
from engine.quant.scheme import NVFP4, QuantScheme

FORMATS = ("nvfp4", "fp8")
FLOAT_DTYPES = ("BF16", "F16", "F32")


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="ninfer quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", required=True, choices=FORMATS, help="nvfp4 (ModelOpt) or fp8 (128x128 blocks)")
    parser.add_argument("--model", required=True, help="bf16/fp32 Hugging Face checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory (created; must be empty if it exists)")
    parser.add_argument("--keep-mtp", action="store_true", help="leave the MTP layer's linears unquantized")
    parser.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                        help="also leave these modules unquantized (a name or an fnmatch pattern, e.g. "
                             "'*.in_proj_b'; repeatable), as ModelOpt's exclude_modules")
    parser.add_argument("--scale-search", action="store_true",
                        help="NVFP4 calibration: per group of 16, also try the absmax scale x 0.95..0.75 and keep "
                             "the one with the smallest squared error (slower; off = plain round to nearest)")
    return parser


# the fractions of the absmax group scale that --scale-search tries besides 1
SEARCH_FRACTIONS = (0.95, 0.9, 0.85, 0.8, 0.75)


def quantize_checkpoint(model: Path, out: Path, fmt: str, keep_mtp: bool = False,
                        scale_search: bool = False, exclude: tuple[str, ...] = ()) -> QuantScheme:
    """Write the quantized checkpoint of `model` to `out`; returns the scheme it used."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.loading.checkpoint import CheckpointWeights
    from engine.quant.random_weights import quantize_tensor

    config = json.loads((model / "config.json").read_text())
    if config.get("quantization_config"):
        raise ModelLoadError(f"{model}/config.json: quantization_config is set; the input must be bf16 or fp32")
    weights = CheckpointWeights.from_dir(model)
    dtypes = weights.dtypes()
    not_float = sorted(n for n, d in dtypes.items() if d not in FLOAT_DTYPES)
    if not_float:
        raise ModelLoadError(f"{model}: {not_float[0]} has dtype {dtypes[not_float[0]]}; the input must be bf16/fp16/fp32")
    exclude = ("lm_head",) + (("mtp",) if keep_mtp else ()) + tuple(exclude)
    scheme = QuantScheme(fmt, exclude=exclude).over_linears(weights.shapes())
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ModelLoadError(f"--out {out}: the directory is not empty")

    weight_map: dict[str, str] = {}
    for file, names in weights._by_file().items():
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(file, "pt") as f:
            for name in names:
                t = f.get_tensor(name)
                if name.endswith(".weight") and name[:-len(".weight")] in scheme.modules:
                    tensors.update(quantize_tensor(name, t, scheme, SEARCH_FRACTIONS if scale_search else ()))
                else:
                    tensors[name] = t.contiguous()
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})
        _readable_as_created(out / file.name)
        weight_map.update({n: file.name for n in tensors})
    if (model / "model.safetensors.index.json").exists():
        total = sum((out / f).stat().st_size for f in set(weight_map.values()))
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for extra in model.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                "config.json", "model.safetensors.index.json", "hf_quant_config.json", "README.md"):
            shutil.copyfile(extra, out / extra.name)
    config["quantization_config"] = scheme.to_hf()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if fmt == NVFP4:
        (out / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "ninfer", "version": "quantize"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": list(exclude)}}, indent=2) + "\n")
    return scheme


def _readable_as_created(path: Path) -> None:
    """safetensors creates its files 0600; give them the mode any new file gets (0666 less the umask), so that
    a checkpoint written for a server running as another user can be read by it."""
    import os
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The command on parsed arguments (`build_parser(subparser)` then `run(args)` for a `ninfer quantize`)."""
    try:
        if args.scale_search and args.format != "nvfp4":
            raise ModelLoadError("--scale-search applies to --format nvfp4 only")
        scheme = quantize_checkpoint(Path(args.model), Path(args.out), args.format, args.keep_mtp, args.scale_search,
                                     tuple(args.exclude))
    except ModelLoadError as e:
        print(f"ninfer quantize: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(scheme.modules)} linear layers in {args.format}, "
          f"kept: embeddings, {', '.join(scheme.exclude)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
