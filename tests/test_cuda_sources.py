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


# The mixed key/value instances (KeyT != ValT) the default run compiles: every pair in bfloat16 at
# the default rank tile. All 288 (every dtype and rank tile) take nvcc ~6 more minutes on a
# 2-core machine, so the whole list compiles under `-m slow` (test_every_instantiation_compiles).
def _is_mixed(name: str) -> bool:
    """A decode instance whose key and value coefficient types differ (<T, KeyT, ValT, ...>)."""
    kernel, args = _kernels.split_name_expression(name)
    return kernel in ("decode_split_partial", "decode_rope_partial") and args[1] != args[2]


def _default_selection(filename: str) -> list[str]:
    def kept(name: str) -> bool:
        _, args = _kernels.split_name_expression(name)
        return args[0] == _kernels.CUDA_TYPES["bfloat16"] and args[-1] == "32"

    return [n for n in _kernels.name_expressions()[filename] if not _is_mixed(n) or kept(n)]


def _compile(tmp_path_factory, select) -> dict:
    if NVCC is None:
        pytest.skip("nvcc not found on PATH, $CUDA_PATH or $CUDA_HOME: CUDA sources not compiled")
    out = {}
    for filename in CU_FILES:
        workdir = tmp_path_factory.mktemp(filename.replace(".", "_"))
        names = select(filename)
        start = time.perf_counter()
        proc, cmd = compile_report.nvcc_compile(filename, (80, 90), workdir, names)
        out[filename] = (proc, cmd, compile_report.nvcc_resources(proc, THREADS) if proc.returncode == 0 else [], time.perf_counter() - start, names)
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """filename -> (nvcc process, command, resources, seconds, names), compiled once for the module."""
    return _compile(tmp_path_factory, _default_selection)


def _check_compiled(filename, entry, capsys):
    proc, cmd, resources, elapsed, names = entry
    with capsys.disabled():
        print(f"\n[nvcc] {filename}: {len(names)} instantiations\n[nvcc] {' '.join(cmd)}\n[nvcc] exit {proc.returncode} in {elapsed:.1f} s", flush=True)
    assert proc.returncode == 0, f"nvcc failed on {filename}:\n{proc.stdout}\n{proc.stderr}"
    assert len(resources) == 2 * len(names)  # every instantiation, for both architectures


@pytest.mark.parametrize("filename", CU_FILES)
def test_cuda_source_compiles(filename, compiled, capsys):
    _check_compiled(filename, compiled[filename], capsys)
    if filename == _kernels.DECODE_SOURCE:  # every mixed pair, plain and pre-RoPE
        assert sum(map(_is_mixed, compiled[filename][4])) == 2 * len(_kernels.MIXED_PAIRS)


@pytest.mark.slow
def test_every_instantiation_compiles(tmp_path_factory, capsys):
    """Every template-id the Python side may ask NVRTC for, the mixed ones in every dtype and rank tile."""
    full = _compile(tmp_path_factory, lambda filename: _kernels.name_expressions()[filename])
    for filename in CU_FILES:
        _check_compiled(filename, full[filename], capsys)
        proc, cmd, resources, elapsed, names = full[filename]
        assert not [r for r in resources if r.spills], f"{filename}: spills in {[r.kernel for r in resources if r.spills][:4]}"


def test_default_instantiations_do_not_spill(compiled):
    defaults = gpu_report.cuda_default_names()
    rows = [r for _, _, resources, _, _ in compiled.values() for r in resources if r.kernel.replace(" ", "") in defaults]
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
