"""Offline nvcc compile of every CUDA source of the cupy backend (``backends/subspace_ref_cupy/kernels``).

Each ``.cu`` file is compiled for sm_80 and sm_90 with warnings as errors and ``-Xptxas -v``,
through a generated translation unit that instantiates exactly the template-ids the Python side
launches (:func:`subspace_ref_cupy._kernels.name_expressions`), so a template the runtime would ask
NVRTC for but that does not compile fails here, on machines without a GPU; ptxas's resource log
(``subspace_ref_triton.compile_report``, the same as ``subspace-kv gpu-report``) must show no
spill in the instantiations the benchmark's setting launches. One compile per file per run; the
nvcc command lines and times are printed to the terminal (not captured), so the CI log shows that
the compile ran. Skipped, with the reason, only when nvcc is absent.
"""

from __future__ import annotations

import time

import pytest

from subspace_ref_cupy import _kernels
from subspace_ref_triton import compile_report, gpu_report

NVCC = compile_report.nvcc()
CU_FILES = sorted(p.name for p in _kernels.KERNEL_DIR.glob("*.cu"))
THREADS = {
    "decode_split_partial": _kernels.DECODE_THREADS, "merge_splits": _kernels.MERGE_THREADS, "project_append": _kernels.PROJECT_THREADS,
    "decode_rope_partial": _kernels.DECODE_THREADS, "exact_partial": _kernels.DECODE_THREADS,
}


def test_every_kernel_file_is_wired_to_python():
    # a .cu file the Python side does not list would never be launched nor compiled below
    assert set(CU_FILES) == set(_kernels.SOURCES)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """filename -> (nvcc process, command, resources), compiled once for the module."""
    if NVCC is None:
        pytest.skip("nvcc not found on PATH, $CUDA_PATH or $CUDA_HOME: CUDA sources not compiled")
    out = {}
    for filename in CU_FILES:
        workdir = tmp_path_factory.mktemp(filename.replace(".", "_"))
        start = time.perf_counter()
        proc, cmd = compile_report.nvcc_compile(filename, (80, 90), workdir)
        out[filename] = (proc, cmd, compile_report.nvcc_resources(proc, THREADS) if proc.returncode == 0 else [], time.perf_counter() - start)
    return out


@pytest.mark.parametrize("filename", CU_FILES)
def test_cuda_source_compiles(filename, compiled, capsys):
    proc, cmd, resources, elapsed = compiled[filename]
    count = len(_kernels.name_expressions()[filename])
    with capsys.disabled():
        print(f"\n[nvcc] {filename}: {count} instantiations\n[nvcc] {' '.join(cmd)}\n[nvcc] exit {proc.returncode} in {elapsed:.1f} s", flush=True)
    assert proc.returncode == 0, f"nvcc failed on {filename}:\n{proc.stdout}\n{proc.stderr}"
    assert len(resources) == 2 * count  # every instantiation, for both architectures


def test_default_instantiations_do_not_spill(compiled):
    defaults = gpu_report.cuda_default_names()
    rows = [r for _, _, resources, _ in compiled.values() for r in resources if r.kernel.replace(" ", "") in defaults]
    assert {r.kernel.replace(" ", "") for r in rows} == defaults
    spills = [f"{r.kernel} sm_{r.arch}: {r.spill_stores}/{r.spill_loads} B" for r in rows if r.spills]
    assert not spills, "default CUDA instantiations spill registers:\n" + "\n".join(spills)


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
    """One instantiation of each kernel template per (dtype, coefficient storage: both sides alike,
    or a format per side), with run-time head sizes (and the pre-RoPE template's mixed pairs in float16): the exact name expressions the backend hands NVRTC, without compiling all of them
    twice (nvcc above compiles all)."""
    names = _kernels.name_expressions()[filename]
    keep = {c.decode_name for c in _kernels.configs() if c.d == _kernels.GENERIC and c.rank_tile == 64}
    keep |= {c.project_name for c in _kernels.configs() if c.d == _kernels.GENERIC and c.rank_tile == 64 and c.uniform}
    # a format per side (issue 37): the pre-RoPE template with keys and values in different formats
    keep |= {c.name for c in _kernels.rope_configs() if c.rank_tile == 64 and c.dtype == "float16" and not c.uniform}
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
