"""CUDA C kept in `.cu` files beside the Python that compiles (NVRTC, through CuPy) and launches it."""

from __future__ import annotations

from pathlib import Path


def read_cuda_source(anchor: str, name: str, **defines: int) -> str:
    """The text of the `.cu` file `name` in the directory of the module file `anchor`, preceded by one
    `#define KEY VALUE` line per keyword: the constants that Python (buffer sizes, argument layouts) and
    the kernel must agree on are defined once, in Python."""
    text = (Path(anchor).resolve().parent / name).read_text()
    return "".join(f"#define {key} {value}\n" for key, value in defines.items()) + text
