"""Run the CUDA kernels of ``kernels/`` on the host, to check their logic without a GPU (tests).

The kernel sources are compiled by the host C++ compiler against ``emulation/host_cuda.h`` (one
std::thread per CUDA thread, barriers for ``__syncthreads``/``__syncwarp``/shuffles) and launched
through ctypes with the argument tuples that :mod:`._launch` builds for the real launches, packed
the way CUDA packs kernel parameters (an array of pointers to each argument). Each argument's size
is checked against the kernel's parameter list, so a scalar of the wrong width or a swapped
pointer/scalar is caught here, not only on a GPU.

What it cannot check: races and memory-model effects of real warps, NVRTC/ptxas behaviour,
performance, and anything about the CuPy/torch side of a launch (streams, DLPack). Slow: every
CUDA thread is an OS thread; keep the shapes small.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np

from subspace_ref.host_build import build_shared_library
from subspace_ref_cupy import _kernels as K
from subspace_ref_cupy import _launch as L

EMULATION_DIR = Path(__file__).resolve().parent / "emulation"
_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float32): ctypes.c_float, np.dtype(np.uint64): ctypes.c_uint64}

_CALL = """
#include <cstddef>
#include <utility>

template <class... P, std::size_t... I>
static void emu_call(void (*f)(P...), void** args, std::index_sequence<I...>) {
    f(*static_cast<P*>(args[I])...);
}

template <class... P>
static void emu_launch(void (*f)(P...), unsigned gx, unsigned gy, unsigned gz, unsigned threads, std::size_t smem, void** args) {
    emu::launch(emu::Dim3{gx, gy, gz}, emu::Dim3{threads, 1, 1}, smem,
                [=] { emu_call(f, args, std::index_sequence_for<P...>{}); });
}

template <class... P>
static int emu_sizes(void (*)(P...), std::size_t* out) {
    std::size_t sizes[] = {sizeof(P)...};
    for (std::size_t i = 0; i < sizeof...(P); ++i) out[i] = sizes[i];
    return static_cast<int>(sizeof...(P));
}

extern "C" int emu_copy_errors() {
    return emu::copy_errors.exchange(0);
}

extern "C" int emu_shared_overrun() {
    const int v = emu::shared_overrun;
    emu::shared_overrun = 0;
    return v;
}
"""


def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include directory (for cuda_fp16.h / cuda_bf16.h), or None."""
    candidates = [os.environ.get(v) for v in ("CUDA_PATH", "CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_bf16.h").is_file():
            return Path(c) / "include"
    return None


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def availability() -> tuple[bool, str]:
    """(True, "") when a host C++20 compiler and the CUDA headers are present, else (False, why)."""
    if not (EMULATION_DIR / "host_cuda.h").is_file():
        return False, f"{EMULATION_DIR / 'host_cuda.h'} is missing (it ships with the source tree, not with installed wheels)"
    if compiler() is None:
        return False, "no host C++ compiler (g++ or clang++, or $CXX) found"
    if cuda_include_dir() is None:
        return False, "CUDA headers (cuda_bf16.h) not found under $CUDA_PATH, $CUDA_HOME, nvcc's toolkit or /usr/local/cuda"
    return True, ""


def host_source() -> str:
    """Both kernel files as one host translation unit: dynamic shared memory becomes the block's
    buffer and static ``__shared__`` arrays become function statics (blocks run one at a time)."""
    seen: set[str] = set()
    text = "\n".join(K.source_text(f, seen) for f in K.SOURCES)
    text = text.replace("extern __shared__ float smem[];", "float* smem = emu::dynamic_smem();")
    return text.replace("__shared__", "static")


class Library:
    """A host build of the kernels for a fixed list of name expressions."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        symbols = {n: f"emu_{i}" for i, n in enumerate(self.names)}
        lines = ['#include "host_cuda.h"', host_source(), _CALL]
        for n, sym in symbols.items():
            lines.append(
                f'extern "C" void {sym}(unsigned gx, unsigned gy, unsigned gz, unsigned t, std::size_t smem, void** args)'
                f" {{ emu_launch(&{n}, gx, gy, gz, t, smem, args); }}"
            )
            lines.append(f'extern "C" int {sym}_sizes(std::size_t* out) {{ return emu_sizes(&{n}, out); }}')
        unit = "\n".join(lines) + "\n"
        flags = ["-std=c++20", "-O1", "-pthread", "-w", f"-I{EMULATION_DIR}", f"-I{cuda_include_dir()}"]
        lib_path = build_shared_library(unit, compiler(), flags, "cuda_emulation", suffix=".cpp", depends=[EMULATION_DIR / "host_cuda.h"])
        self._lib = ctypes.CDLL(str(lib_path))
        self._symbols = symbols

    def launch(self, name: str, grid: tuple[int, int, int], threads: int, shared_bytes: int, args: tuple) -> None:
        """Launch ``name`` with ``args`` packed as CUDA packs them; sizes checked first."""
        sym = self._symbols[name]
        sizes = (ctypes.c_size_t * 64)()
        count = getattr(self._lib, f"{sym}_sizes")(sizes)
        if count != len(args):
            raise TypeError(f"{name} takes {count} parameters; the launch passes {len(args)}")
        boxes = []
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                box = ctypes.c_void_p(a.ctypes.data)
            elif isinstance(a, np.generic) and a.dtype in _SCALARS:
                box = _SCALARS[a.dtype](a.item())
            else:
                raise TypeError(f"argument {i} of {name} is a {type(a).__name__}; launches pass arrays and typed NumPy scalars")
            if ctypes.sizeof(box) != sizes[i]:
                raise TypeError(f"argument {i} of {name} has {ctypes.sizeof(box)} bytes; the parameter has {sizes[i]}")
            boxes.append(box)
        packed = (ctypes.c_void_p * len(boxes))(*[ctypes.cast(ctypes.pointer(b), ctypes.c_void_p) for b in boxes])
        fn = getattr(self._lib, sym)
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
        fn(*grid, threads, shared_bytes, packed)
        if self._lib.emu_shared_overrun():
            raise RuntimeError(f"{name} wrote past the {shared_bytes} bytes of dynamic shared memory it was launched with")
        if self._lib.emu_copy_errors():
            raise RuntimeError(f"{name}: a thread ended with asynchronous copies it never waited for, or issued a misaligned one")


_libraries: dict[tuple[str, ...], Library] = {}
_lock = threading.Lock()


def library(names: list[str]) -> Library:
    key = tuple(sorted(set(names)))
    with _lock:
        if key not in _libraries:
            _libraries[key] = Library(list(key))
        return _libraries[key]


# ------------------------------------------------------------------------------ host launches
# Host arrays stand in for device arrays: float32/float16 as themselves, bfloat16 as its uint16 bits.


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def bf16_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def attend(
    q: np.ndarray, dtype: str, arrays: L.CoefArrays, scale: float, splits: tuple[int, int] | None = None, sm_count: int = 4, lib: Library | None = None
) -> np.ndarray:
    """:func:`._launch.attend` with host arrays: the same plan, argument tuples and launch order
    (:func:`._launch.run_attention`). ``lib``: a prebuilt :class:`Library` holding the kernels
    needed (else one is built)."""
    plan = L.plan_attend(dtype, q.shape, arrays, sm_count, splits)
    lib = lib or library(plan.kernel_names())
    return L.run_attention(plan, q, arrays, scale, np, lib.launch)


def project(
    dtype: str,
    keys,
    values,
    key_bases,
    value_bases,
    num_chunks,
    key_coef,
    value_coef,
    offset: int,
    key_scale=None,
    value_scale=None,
    lib: Library | None = None,
):
    """:func:`._launch.project` with host arrays (the coefficient buffers are written in place)."""
    N, H, n_new, _ = keys.shape
    cfg = L.project_config(dtype, keys.shape, values.shape, key_coef.shape, value_coef.shape, key_scale is not None)
    rho_k = np.empty((N, H, n_new), dtype=np.float32)
    rho_v = np.empty_like(rho_k)
    args = L.project_args(keys, values, key_bases, value_bases, num_chunks, key_coef, value_coef, key_scale, value_scale, rho_k, rho_v, offset)
    if n_new:
        (lib or library([cfg.project_name])).launch(cfg.project_name, L.project_grid(keys.shape), K.PROJECT_THREADS, 0, args)
    return rho_k, rho_v


def host_state_arrays(state: Any, dtype: str) -> L.CoefArrays:
    """:func:`host_arrays` of a state's layout with what the layout does not hold: a pre-RoPE
    state's rotation (spec/rope.md P3, positions from S, spec/window.md W10) and the exact
    segments (sinks, recent window; spec/window.md W3, W8) in ``dtype`` storage."""
    from dataclasses import replace

    from subspace_ref.window import first_compressed_position

    arrays = host_arrays(state.layout, dtype)
    rope = getattr(state.policy, "rope", None)
    if rope is not None:
        arrays = replace(arrays, **L.rope_fields(rope, state.d, first_compressed_position(state)))
    exact = tuple((_store(k, dtype), _store(v, dtype)) for k, v in L.exact_segments(state))
    return replace(arrays, exact=exact)


def _store(x, dtype: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    return bf16_bits(x) if dtype == "bfloat16" else x.astype(dtype)


def host_arrays(layout: Any, dtype: str) -> L.CoefArrays:
    """A NumPy packed layout (spec A9) in the storage the kernels read: bases and floating
    coefficients in ``dtype`` (bfloat16 as bits); INT8 coefficients and their float32 scales
    (spec A10) and int4/int2 codes with their float16 scales and zero points (spec/quantization.md
    Q2) as they are; each side in its own format (a layout with a format per side, Q0)."""

    def store(x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        return bf16_bits(x) if dtype == "bfloat16" else x.astype(dtype)

    half = lambda x: np.ascontiguousarray(x, dtype=np.float16)  # noqa: E731
    fmt = {side: _side_format(layout, side) for side in ("key", "value")}
    int8 = {side: f.per_token_scale for side, f in fmt.items()}
    bits = {side: f.low_bits for side, f in fmt.items()}
    coef = {side: (np.ascontiguousarray if int8[side] or bits[side] else store)(getattr(layout, f"{side}_coef")) for side in fmt}
    kb, vb = bits["key"], bits["value"]
    return L.CoefArrays(
        key_coef=coef["key"],
        value_coef=coef["value"],
        key_bases=store(layout.key_bases),
        value_bases=store(layout.value_bases),
        chunk_starts=np.ascontiguousarray(layout.chunk_starts, dtype=np.int64),
        num_chunks=np.ascontiguousarray(layout.num_chunks, dtype=np.int64),
        gamma=np.ascontiguousarray(layout.gamma, dtype=np.float32),
        num_tokens=int(layout.num_tokens),
        key_scale=np.ascontiguousarray(layout.key_scale, dtype=np.float32) if int8["key"] else None,
        value_scale=np.ascontiguousarray(layout.value_scale, dtype=np.float32) if int8["value"] else None,
        low_bits=kb if kb == vb else 0,
        key_low_bits=None if kb == vb else kb,
        value_low_bits=None if kb == vb else vb,
        key_group=int(layout.group) if kb else 0,
        key_group_scale=half(layout.key_group_scale) if kb else None,
        key_group_zero=half(layout.key_group_zero) if kb else None,
        key_tail=store(layout.key_tail) if kb else None,
        value_token_scale=half(layout.value_token_scale) if vb else None,
        value_token_zero=half(layout.value_token_zero) if vb else None,
    )


def _side_format(layout: Any, side: str):
    """The subspace_ref.formats record of a layout side (layouts from before per-side formats:
    int8 scales, else float)."""
    from subspace_ref.formats import FORMATS

    if hasattr(layout, "side_format"):
        return layout.side_format(side)
    return FORMATS["int8" if getattr(layout, f"{side}_scale", None) is not None else "float"]
