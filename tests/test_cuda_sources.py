"""Offline nvcc compile of every CUDA source of the cupy backend (``backends/subspace_ref_cupy/kernels``).

Each ``.cu`` file is compiled for sm_80 and sm_90 with warnings as errors, through a generated
translation unit that instantiates exactly the template-ids the Python side launches
(:func:`subspace_ref_cupy._kernels.name_expressions`), so a template the runtime would ask NVRTC
for but that does not compile fails here, on machines without a GPU. The nvcc command lines and
times are printed to the terminal (not captured), so the CI log shows that the compile ran.
Skipped, with the reason, only when nvcc is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from subspace_ref_cupy import _kernels

ARCH_FLAGS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
# --Werror all-warnings: nvcc's own and the device front end's warnings; -Xcompiler: the host
# compiler's. --threads 2 compiles the two architectures side by side.
WARNING_FLAGS = ["--Werror", "all-warnings", "-Xcompiler", "-Wall,-Werror"]
NVCC_FLAGS = ["-std=c++17", *WARNING_FLAGS, *ARCH_FLAGS, "--threads", "2"]


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for var in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


NVCC = _nvcc()
CU_FILES = sorted(p.name for p in _kernels.KERNEL_DIR.glob("*.cu"))


def test_every_kernel_file_is_wired_to_python():
    # a .cu file the Python side does not list would never be launched nor compiled below
    assert set(CU_FILES) == set(_kernels.SOURCES)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH, $CUDA_PATH or $CUDA_HOME: CUDA sources not compiled")
@pytest.mark.parametrize("filename", CU_FILES)
def test_cuda_source_compiles(filename, tmp_path, capsys):
    unit = tmp_path / f"instantiate_{filename}"
    unit.write_text(_kernels.explicit_instantiation_unit(filename))
    cmd = [NVCC, *NVCC_FLAGS, "-c", str(unit), "-o", str(tmp_path / f"{filename}.o")]
    count = len(_kernels.name_expressions()[filename])
    with capsys.disabled():
        print(f"\n[nvcc] {filename}: {count} instantiations\n[nvcc] {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    with capsys.disabled():
        print(f"[nvcc] {filename}: exit {proc.returncode} in {elapsed:.1f} s", flush=True)
    assert proc.returncode == 0, f"nvcc failed on {filename}:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / f"{filename}.o").stat().st_size > 0


# ----------------------------------------------------------------------------- NVRTC, as at run time


def _nvrtc():
    """CuPy's NVRTC bindings with the library loaded, or (None, why not). Needs no GPU."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as err:  # ImportError, or the shared library not found
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return None, f"NVRTC not loadable here ({type(err).__name__}: {first})"
    return nvrtc, ""


NVRTC, NVRTC_REASON = _nvrtc()


def _runtime_sample(filename: str) -> list[str]:
    """One instantiation of each kernel template per (dtype, coefficient storage), with run-time
    head sizes: the exact name expressions the backend hands NVRTC, without compiling all of them
    twice (nvcc above compiles all)."""
    names = _kernels.name_expressions()[filename]
    keep = {c.decode_name for c in _kernels.configs() if c.d == _kernels.GENERIC and c.rank_tile == 64}
    keep |= {c.project_name for c in _kernels.configs() if c.d == _kernels.GENERIC and c.rank_tile == 64}
    keep |= {_kernels.merge_name(t) for t in _kernels.CUDA_TYPES}
    return [n for n in names if n in keep]


@pytest.mark.skipif(NVRTC is None, reason=NVRTC_REASON)
@pytest.mark.parametrize("filename", CU_FILES)
def test_nvrtc_compiles_the_runtime_source(filename, capsys):
    """The text ``cupy.RawModule`` receives (headers pasted in) compiles under NVRTC with the
    backend's options, and every name expression resolves to a kernel. NVRTC lacks the C library
    headers nvcc sees, so this catches what the nvcc test cannot (e.g. INFINITY)."""
    from subspace_ref_cupy import _emulation

    names = _runtime_sample(filename)
    include = _emulation.cuda_include_dir()
    options = [*_kernels.NVRTC_OPTIONS, "-arch=sm_90", "--device-as-default-execution-space"]
    options += [f"-I{include}"] if include else []
    with capsys.disabled():
        print(f"\n[nvrtc {NVRTC.getVersion()}] {filename}: {len(names)} name expressions, options {' '.join(options)}", flush=True)
    start = time.perf_counter()
    prog = NVRTC.createProgram(_kernels.source_text(filename), filename, [], [])
    try:
        for n in names:
            NVRTC.addNameExpression(prog, n)
        try:
            NVRTC.compileProgram(prog, options)
        except Exception as err:
            pytest.fail(f"NVRTC failed on {filename}: {err}\n{NVRTC.getProgramLog(prog)}")
        lowered = [NVRTC.getLoweredName(prog, n) for n in names]
    finally:
        NVRTC.destroyProgram(prog)
    with capsys.disabled():
        print(f"[nvrtc] {filename}: compiled in {time.perf_counter() - start:.1f} s", flush=True)
    assert all(lowered)
