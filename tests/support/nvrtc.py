"""CUDA C -> cubin for a chosen target with NVRTC through ctypes: no GPU, no driver, no CuPy.

libnvrtc comes from the NVIDIA wheel (`nvidia-cuda-nvrtc`, CUDA 13: sm75 and newer; its 12.x wheel reaches
sm50), found under site-packages' nvidia/*/lib, or named by NINFER_NVRTC_LIB. Not in the CPU install (the
library is ~100 MB): tests that need it skip without it."""

from __future__ import annotations

import ctypes
import glob
import os
import site


def find_libnvrtc() -> str | None:
    from engine import envs
    named = envs.NVRTC_LIB.read()
    if named:
        return named
    for root in site.getsitepackages():
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so.*"))
                      + glob.glob(os.path.join(root, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*")))
        hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
        if hits:
            return hits[0]
    return None


class NvrtcError(RuntimeError):
    pass


def compile_cubin(lib_path: str, source: str, capability: int, name_expressions: tuple[str, ...] = (),
                  options: tuple[str, ...] = ("-std=c++17",)) -> bytes:
    """The cubin NVRTC makes of `source` for sm_<capability>, with each templated kernel name instantiated."""
    for builtins in glob.glob(os.path.join(os.path.dirname(lib_path), "libnvrtc-builtins.so.*")):
        if ".alt." not in builtins:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)     # NVRTC opens it by name at compile time
    lib = ctypes.CDLL(lib_path)
    program = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernel.cu", 0, None, None):
        raise NvrtcError("nvrtcCreateProgram failed")
    try:
        for name in name_expressions:
            lib.nvrtcAddNameExpression(program, name.encode())
        args = [o.encode() for o in (*options, f"-arch=sm_{capability}")]
        if lib.nvrtcCompileProgram(program, len(args), (ctypes.c_char_p * len(args))(*args)):
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            text = log.value.decode(errors="replace").strip() or "nvrtcCompileProgram failed"
            if "libnvrtc-builtins" in text:
                raise RuntimeError(f"a broken NVRTC install, not a compile error: {text}")
            raise NvrtcError(text)
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(program, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))
