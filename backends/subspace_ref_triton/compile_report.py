"""Ahead-of-time compiles for NVIDIA targets on a machine without a GPU, as the kernels will
launch, and the resources ptxas gives them.

* Triton: :func:`compile_launch` specialises a :class:`~subspace_ref_triton._common.Launch`
  exactly as ``JITFunction.run`` does on a device (Triton's own binder: 16-byte divisibility of
  pointers and integers, integers equal to 1 as constants; the launch's constexprs and warps),
  compiles it with ``triton.compile`` for ``GPUTarget("cuda", arch, 32)`` and runs Triton's
  bundled ptxas with ``-v`` on the PTX. Compiling the bare signature instead (no divisibility
  attributes) measures a different kernel: scalar loads, no cp.async pipelining, more registers.
* CUDA: :func:`nvcc_resources` compiles the CuPy backend's instantiation units
  (``subspace_ref_cupy._kernels.explicit_instantiation_unit``) with ``nvcc -Xptxas -v``.

Both return :class:`Resources` parsed from ptxas's log. Needs triton (and nvcc for CUDA), not a
GPU or a driver. Run with TRITON_INTERPRET unset (the kernels must be decorated for the GPU).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from subspace_ref_triton._common import Launch


@dataclass(frozen=True)
class Resources:
    """One kernel's compiled resources for one architecture, from ``ptxas -v``."""

    kernel: str
    arch: int
    registers: int
    spill_stores: int  # bytes
    spill_loads: int
    stack: int  # bytes of stack frame per thread
    shared: int  # bytes of shared memory per block (Triton: its dynamic allocation; CUDA: static)
    num_warps: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\d+)a?'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str) -> dict[tuple[str, int], tuple[int, int, int, int, int]]:
    """(mangled entry, arch) -> (registers, spill stores, spill loads, stack, static smem)."""
    out: dict[tuple[str, int], tuple[int, int, int, int, int]] = {}
    entry = frame = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry, frame = (m.group(1), int(m.group(2))), (0, 0, 0)
        elif (m := _FRAME.search(line)) and entry:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _USED.search(line)) and entry:
            out[entry] = (int(m.group(1)), frame[1], frame[2], frame[0], int(m.group(2) or 0))
            entry = None
    return out


# ------------------------------------------------------------------------------------- Triton

_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int64": "i64", "int32": "i32", "int8": "i8"}


def triton_ptxas(arch: int) -> str:
    """The ptxas Triton itself runs for sm_<arch> (its bundled one, or TRITON_PTXAS_PATH)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def compile_launch(launch: Launch, arch: int):
    """``triton.compile`` of ``launch`` for sm_<arch>, specialised by Triton's own launch-time
    binder; returns the CompiledKernel (Triton caches it on disk by its specialisation)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.constexprs, **launch.options())
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def launch_resources(launch: Launch, arch: int) -> Resources:
    """Registers, spills and shared memory of ``launch`` compiled for sm_<arch>: the PTX Triton
    generated, through the ptxas and the options Triton's make_cubin uses, with ``-v`` (Triton
    drops that log, and a compile served from its cache runs no ptxas at all)."""
    compiled = compile_launch(launch, arch)
    ptx = compiled.asm["ptx"]
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)
    fmad = [] if compiled.metadata.enable_fp_fusion else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [triton_ptxas(arch), "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2", f"--gpu-name={target}", str(src), "-o", str(Path(tmp) / "k.cubin")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed on {launch.kernel.fn.__name__} for {target}:\n{proc.stderr[-4000:]}")
    (regs, stores, loads, stack, _), = parse_ptxas_log(proc.stdout + proc.stderr).values()
    return Resources(launch.kernel.fn.__name__, arch, regs, stores, loads, stack, int(compiled.metadata.shared), launch.num_warps)


# ------------------------------------------------------------------------------------- CUDA


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for var in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def demangle(names: list[str]) -> list[str]:
    """C++ demangling through c++filt (the template-ids as the Python side spells them, modulo
    spacing), or the mangled names when c++filt is absent."""
    tool = shutil.which("c++filt")
    if tool is None:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return [re.sub(r"^void |\(.*$", "", n) for n in out] if len(out) == len(names) else names


NVCC_FLAGS = ("-std=c++17", "--Werror", "all-warnings", "-Xcompiler", "-Wall,-Werror", "-Xptxas", "-v")


def nvcc_compile(filename: str, archs: tuple[int, ...], workdir: Path, names: list[str] | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """nvcc of one kernel file's instantiation unit (``names``, default every one the Python side
    uses) for ``archs`` with warnings as errors and ptxas's resource log; returns the process and
    the command line."""
    from subspace_ref_cupy import _kernels

    unit = workdir / f"instantiate_{filename}"
    unit.write_text(_kernels.explicit_instantiation_unit(filename, names))
    gencode = [x for a in archs for x in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
    cmd = [nvcc(), *NVCC_FLAGS, *gencode, "--threads", str(len(archs)), "-c", str(unit), "-o", str(workdir / f"{filename}.o")]
    return subprocess.run(cmd, capture_output=True, text=True), cmd


def nvcc_resources(proc: subprocess.CompletedProcess, threads: dict[str, int]) -> list[Resources]:
    """The :class:`Resources` of every entry in an :func:`nvcc_compile` log; ``threads`` maps a
    kernel template's name (``decode_split_partial``...) to its block size."""
    parsed = parse_ptxas_log(proc.stdout + proc.stderr)
    keys = list(parsed)
    names = demangle([k[0] for k in keys])
    out = []
    for (_, arch), name in zip(keys, names):
        regs, stores, loads, stack, smem = parsed[(_, arch)]
        base = re.sub(r"^\w+::|<.*$", "", name)
        out.append(Resources(name, arch, regs, stores, loads, stack, smem, threads.get(base, 128) // 32))
    return out
