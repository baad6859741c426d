"""Which kernel family each operation takes on a device: decided once, from the compute capability and the
dtypes, in this one place.

The kernels were built and measured on an H200 (sm90): TMA descriptors, programmatic dependent launch (PDL),
FP8 `cvt.e4m3x2` decodes and FP8 tensor cores, bf16 throughout. Older GPUs lack some of these:

    sm70 (V100)        no bf16, no FP8, no TMA, no PDL           -> fp16, weight-only dequantising quantized linears
    sm75 (T4)          as sm70 (bf16 only emulated)              -> fp16, weight-only dequantising quantized linears
    sm80/86 (A100/A10) bf16; no FP8, no TMA, no PDL              -> the non-TMA attention, dequantising FP8/NVFP4
    sm89 (L40S, L4)    bf16, FP8 tensor cores; no TMA, no PDL    -> the non-TMA attention, the FP8/NVFP4 GEMV kernels
    sm90 (H100, H200)  everything                                -> TMA prefill attention, PDL, the CUDA C MMA GEMV

The MoE kernels (routing, sort, grouped GEMM, combine) and the integer weight-only GEMV/GEMM compile for every
capability of the matrix; FP8 and NVFP4 experts are decoded in registers with integer operations (weight-only:
no FP8 tensor-core MoE kernel exists), so they run from sm70 on. Below sm80 Triton 3.6 lowers `tl.dot` to FMA
(CUDA cores; checked in the PTX). The P2P all-reduce kernels (CUDA C, compiled at run time by NVRTC through
CuPy) compile from sm75: CUDA 13's NVRTC has no sm70 target, so V100s all-reduce with NCCL.

A family is selectable on a capability only where its kernels compile for it (tests/kernels/test_compile_matrix.py
compiles them offline for sm70..sm90 and checks this table against the results). A setting the device cannot
honour is refused here, naming it, before anything is loaded. No torch at import: the gateway and the
services read the `KernelPaths` this returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import envs
from engine.errors import InvalidArgumentError

# capabilities the compile matrix covers; newer majors (Blackwell) take the sm90 rules where they are
# supersets and the portable forms where they are not (the TMA kernels are Hopper-only code).
COMPILED_CAPABILITIES = ((7, 0), (7, 5), (8, 0), (8, 9), (9, 0))
# the oldest target CUDA 13's NVRTC compiles for (the CUDA C kernels: P2P all-reduce, the MMA GEMV)
NVRTC_MIN_CAPABILITY = (7, 5)


@dataclass(frozen=True)
class KernelPaths:
    """The kernel family of each operation on one device. Field values are short family names (docs/hardware.md)."""

    capability: str                   # "sm90", or "cpu"
    dtype: str                        # the activation / weight dtype the engine runs in
    dtype_fallback: str               # why `dtype` differs from what "auto" means on a newer GPU; "" = none
    attention_decode: str             # "triton-paged" | "torch"
    attention_prefill: str            # "triton-tma-prefill" | "triton-paged" | "torch"
    pdl: bool                         # programmatic dependent launch between decode kernels
    fp8_linear: str                   # "fp8-gemv+scaled-mm" | "torch-dequantize" | "torch"
    nvfp4_linear: str                 # "mma-gemv+triton-gemv" | "triton-gemv" | "torch-dequantize" | "torch"
    fp8_activation_quant: bool        # the fused Triton FP8 activation quantizer (needs e4m3 on the device)
    dense_linear: str                 # 16-bit weights, 1-16 rows: "triton-gemv+skinny" | "torch"; more rows: cuBLAS
    elementwise: str                  # "triton" | "torch"
    gated_delta: str                  # "triton" | "torch"
    moe_experts: str                  # 16-bit/fp32 experts, routing, sort, combine: "triton-grouped-gemm" | "torch"
    moe_fp8_experts: str              # "triton-grouped-gemm-dequant" (weight-only, in registers) | "torch"
    moe_nvfp4_experts: str            # "triton-grouped-gemm-dequant" (weight-only, in registers) | "torch"
    int_linear: str                   # GPTQ/AWQ/pack-quantized: "triton-int-gemv+gemm" | "torch-dequantize" | "torch"
    tp_allreduce: str                 # "p2p-one-shot+nccl" (CUDA C one-shot, NCCL above its size) | "nccl" | "local"
    residual_dtype: str = ""          # the decoder's residual stream (residual_dtype_name(dtype)); set from dtype

    def __post_init__(self):
        if not self.residual_dtype:
            object.__setattr__(self, "residual_dtype", residual_dtype_name(self.dtype))

    @property
    def fp8_tensor_cores(self) -> bool:
        return self.fp8_linear == "fp8-gemv+scaled-mm"

    def as_dict(self) -> dict[str, str]:
        """Every field as text: the log line at start-up and ModelInfo.kernel_paths."""
        return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in self.__dict__.items()}


def residual_dtype_name(dtype: str) -> str:
    """The dtype of the decoder's residual stream for activations in `dtype`: float32 under float16, whose
    range (+-65504) bfloat16-trained checkpoints exceed there (engine.layers.norm says why); else `dtype`."""
    return "float32" if dtype == "float16" else dtype


def capability_name(capability: tuple[int, int] | None) -> str:
    return "cpu" if capability is None else f"sm{capability[0]}{capability[1]}"


def resolve_dtype(capability: tuple[int, int] | None, dtype: str) -> tuple[str, str]:
    """The dtype the engine runs in for an `--dtype` value, and why it is not bfloat16 where "auto" chose
    otherwise. bfloat16 below sm80 is refused (sm70 has none; sm75 only emulates it)."""
    if capability is None:
        return ("float32" if dtype == "auto" else dtype), ""
    if capability >= (8, 0):
        return ("bfloat16" if dtype == "auto" else dtype), ""
    if dtype == "bfloat16":
        raise InvalidArgumentError(
            "dtype", f"bfloat16 is not supported on {capability_name(capability)} (needs sm80 or newer); "
                     "use --dtype float16")
    if dtype == "auto":
        return "float16", f"{capability_name(capability)} has no bfloat16: auto means float16 here"
    return dtype, ""


def select_paths(capability: tuple[int, int] | None, dtype: str = "auto", kv_dtype: str = "auto",
                 quant_format: str | None = None) -> KernelPaths:
    """Every operation's kernel family for a device of `capability` ((major, minor); None = the CPU), the
    `--dtype` and `--kv-cache-dtype` values and the checkpoint's quantized format ("fp8", "nvfp4" or None).
    Raises InvalidArgumentError naming the setting the device cannot honour."""
    run_dtype, fallback = resolve_dtype(capability, dtype)
    if kv_dtype.startswith("fp8"):
        if capability is not None and capability < (8, 9):
            raise InvalidArgumentError("kv_dtype", f"FP8 KV needs sm89 or newer (e4m3); {capability_name(capability)} "
                                                   "has none: use int8")
        raise InvalidArgumentError("kv_dtype", "FP8 KV cache is not implemented; use int8")
    if kv_dtype not in ("auto", "int8", "float32", "bfloat16", "float16"):
        raise InvalidArgumentError("kv_dtype", f"{kv_dtype!r} is not implemented on any device")
    if kv_dtype == "bfloat16" and capability is not None and capability < (8, 0):
        raise InvalidArgumentError("kv_dtype", f"bfloat16 KV is not supported on {capability_name(capability)}; "
                                               "use float16 or int8")
    if capability is None:
        return KernelPaths("cpu", run_dtype, fallback, attention_decode="torch", attention_prefill="torch", pdl=False,
                           fp8_linear="torch", nvfp4_linear="torch", fp8_activation_quant=False, dense_linear="torch",
                           elementwise="torch", gated_delta="torch", moe_experts="torch", moe_fp8_experts="torch",
                           moe_nvfp4_experts="torch", int_linear="torch", tp_allreduce="local")
    hopper = capability[0] == 9
    fp8 = capability >= (8, 9)
    half = run_dtype in ("bfloat16", "float16")
    tma = hopper and half
    if quant_format == "fp8" and run_dtype == "float32":
        raise InvalidArgumentError("dtype", "an FP8 checkpoint on CUDA needs --dtype bfloat16 or float16")
    return KernelPaths(
        capability=capability_name(capability), dtype=run_dtype, dtype_fallback=fallback,
        attention_decode="triton-paged",
        attention_prefill="triton-tma-prefill" if tma else "triton-paged",
        pdl=capability[0] >= 9,
        fp8_linear="fp8-gemv+scaled-mm" if fp8 and half else "torch-dequantize",
        # NVFP4's group scales are e4m3: the Triton decode of them (cvt.e4m3x2) needs sm89
        nvfp4_linear=("mma-gemv+triton-gemv" if capability[0] >= 9 and half
                      else "triton-gemv" if fp8 and half else "torch-dequantize"),
        fp8_activation_quant=fp8,
        dense_linear="triton-gemv+skinny", elementwise="triton", gated_delta="triton",
        # the MoE kernels compile for sm70..sm90 in every expert format (quantized bytes decode with integer ops)
        moe_experts="triton-grouped-gemm", moe_fp8_experts="triton-grouped-gemm-dequant",
        moe_nvfp4_experts="triton-grouped-gemm-dequant",
        # the integer kernels take 16-bit activations (float32 dequantizes by torch, as on the CPU)
        int_linear="triton-int-gemv+gemm" if half else "torch-dequantize",
        tp_allreduce="p2p-one-shot+nccl" if capability >= NVRTC_MIN_CAPABILITY else "nccl")


def moe_family(paths: KernelPaths, experts_format: str | None) -> str:
    """The family of a sparse MoE block whose experts are in `experts_format` (None, "fp8" or "nvfp4")."""
    return {None: paths.moe_experts, "fp8": paths.moe_fp8_experts, "nvfp4": paths.moe_nvfp4_experts}[experts_format]


_DEVICE_PATHS: dict[Any, KernelPaths] = {}


def device_capability(device: Any) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device (torch.device or "cuda[:N]"), None for the CPU."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    actual: tuple[int, int] = tuple(torch.cuda.get_device_capability(device))  # type: ignore[assignment]
    return capability_override(envs.KERNEL_CAPABILITY.read(), actual)


def capability_override(setting: str, actual: tuple[int, int]) -> tuple[int, int]:
    """The capability the paths are chosen for: the device's, or an older one NINFER_KERNEL_CAPABILITY names
    ("8.0"), to run an older GPU's paths on a newer one. A newer one would launch code the device cannot run."""
    if not setting:
        return actual
    try:
        major, minor = (int(part) for part in setting.strip().split("."))
    except ValueError:
        raise ValueError(f"NINFER_KERNEL_CAPABILITY={setting!r}: takes major.minor, e.g. 8.0") from None
    if (major, minor) > actual:
        raise ValueError(f"NINFER_KERNEL_CAPABILITY={setting!r} is newer than the device's "
                         f"{capability_name(actual)}: only an older GPU's paths can run here")
    return major, minor


def paths_for(device: Any, dtype: str = "auto") -> KernelPaths:
    """The kernel families of a torch device (cached per device): what the kernels consult before launching."""
    key = (device, dtype)                  # the kernels ask per launch: a dict hit, no torch call
    hit = _DEVICE_PATHS.get(key)
    if hit is None:
        import torch
        resolved = torch.device(device)
        if resolved.type == "cuda" and resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        hit = _DEVICE_PATHS[key] = select_paths(device_capability(resolved), dtype)
    return hit


def engine_paths(config: Any, model: Any) -> KernelPaths:
    """The kernel families of an engine (EngineConfig, ModelConfig): the oldest capability among its TP ranks'
    devices decides (ranks on mixed GPUs run the common subset)."""
    quant_format = model.quant.format if getattr(model, "quant", None) is not None else None
    if config.device == "cpu":
        capability = None
    else:
        import torch
        first = torch.device(config.device).index or 0      # the ranks' devices, as the executor numbers them
        ranks = range(first, min(first + config.tensor_parallel_size, max(torch.cuda.device_count(), first + 1)))
        capability = min(device_capability(torch.device("cuda", i)) for i in ranks)
    paths = select_paths(capability, config.dtype, config.kv_dtype, quant_format)
    check_tp_comm(paths, config.tp_comm, config.tensor_parallel_size)
    return paths


def check_tp_comm(paths: KernelPaths, tp_comm: str, tensor_parallel_size: int) -> None:
    """Refuse `--tp-comm p2p` where the P2P all-reduce kernels are not selected (before anything loads);
    `auto` takes NCCL there (engine.distributed.cuda_communicator.make_communicator)."""
    if tp_comm == "p2p" and tensor_parallel_size > 1 and paths.tp_allreduce == "nccl":
        raise InvalidArgumentError("tp_comm", f"the P2P all-reduce kernels are not selected on {paths.capability} "
                                              "(CUDA 13's NVRTC starts at sm75): use --tp-comm nccl or auto")
