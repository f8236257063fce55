"""The CUDA sources in ``kernels/``, the template instantiations the backend uses, and their
lazily compiled ``cupy.RawModule`` s.

Importing this module touches neither CuPy nor CUDA: CuPy is imported by :func:`module` only,
on the first launch. The list of instantiations here is the one place that says which templates
the Python side uses; ``tests/test_cuda_sources.py`` compiles exactly this list with nvcc, and
``tests/test_cupy_backend.py`` checks it against the templates declared in the ``.cu`` files.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
DECODE_SOURCE = "decode_attention.cu"
PROJECT_SOURCE = "project_append.cu"
SOURCES = (DECODE_SOURCE, PROJECT_SOURCE)
NAMESPACE = "subspace"

# dtype name (as str(array.dtype) spells it) -> CUDA storage type.
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
INT8_TYPE = "signed char"
# Formats with a projection kernel (appends) and a decode kernel.
COEF_KINDS = ("same", "int8")
# int4/int2 (spec/quantization.md Q2): decode only; the backend refuses appends to them.
LOW_BIT_TYPES = {"int4": f"{NAMESPACE}::Int4Codes", "int2": f"{NAMESPACE}::Int2Codes"}
LOW_BIT_KINDS = tuple(LOW_BIT_TYPES)
DECODE_COEF_KINDS = COEF_KINDS + LOW_BIT_KINDS
# A layout with a format per side (spec/quantization.md Q0, "int4/int8"): the decode templates take
# the key and the value coefficient types apart (KeyT, ValT), so every (key, value) pair of
# different kinds has its own instantiations, one launch as for a uniform layout. Decode only: the
# projection kernel writes float or int8 to both sides, and appends to such layouts run the oracle's
# token loop (or are refused for int4/int2 sides, as for uniform ones).
MIXED_PAIRS = tuple((k, v) for k in DECODE_COEF_KINDS for v in DECODE_COEF_KINDS if k != v)
# The kind of each coefficient format name (subspace_ref.formats): "float" is stored in the bases' dtype.
FORMAT_KINDS = {"float": "same", "int8": "int8", "int4": "int4", "int2": "int2"}
# Head sizes (d, d_v) with their own instantiations (64: GPT-2, Pythia, TinyLlama; 128:
# Llama-style 7B). Every other size runs the instantiation with d and d_v given at run time
# (GENERIC): the per-token loops depend on the rank tile only, so it costs little.
HEAD_SIZES = (64, 128)
GENERIC = 0
# Upper bounds on the ranks r, r_v; the smallest one holding max(r, r_v) is used. 32 has its own
# instantiations (issue 21): padded to 64, a rank-32 state (the usual r = d/4 at d = 128) did
# twice the per-token work and shared-memory traffic; it costs a quarter more nvcc time.
RANK_TILES = (32, 64, 128, 256)

# Must match the constants in the .cu files (kDecodeThreads, kDecodeMinBlocks, kTokenTile,
# kTokenTileSmall, kStageBudgetBytes, kRowPadBytes, kMergeThreads, kProjectThreads);
# test_cupy_backend checks that they do.
DECODE_THREADS = 128
DECODE_MIN_BLOCKS = 4  # blocks per SM the decode kernel's registers are bounded for (kDecodeMinBlocks)
TOKEN_TILE = 64  # kTokenTile: tokens per tile when two stages of them fit STAGE_BUDGET_BYTES
TOKEN_TILE_SMALL = 32  # kTokenTileSmall: otherwise
STAGE_BUDGET_BYTES = 24 * 1024  # kStageBudgetBytes: shared memory of the coefficient tiles
ROW_PAD_BYTES = 16  # kRowPadBytes
ROPE_TOKEN_TILE = 32  # kRopeTokens
ROPE_SUB = 8  # kRopeSub: tokens per rebuild item
EXACT_TOKEN_TILE = 32  # kExactTokens
MERGE_THREADS = 128
PROJECT_THREADS = 128
PROJECT_WARPS = PROJECT_THREADS // 32


def coef_cuda_type(dtype: str, coef: str) -> str:
    """The CUDA coefficient type (the templates' CoefT) of a coefficient kind stored beside ``dtype`` bases."""
    if coef in LOW_BIT_TYPES:
        return LOW_BIT_TYPES[coef]
    return INT8_TYPE if coef == "int8" else CUDA_TYPES[dtype]


class _SideKinds:
    """What a template instantiation derives from its ``dtype``, key ``coef`` and ``value_coef``
    (None: the keys', a uniform layout), shared by :class:`KernelConfig` and :class:`RopeConfig`."""

    def __post_init__(self):
        if self.value_coef is None:
            object.__setattr__(self, "value_coef", self.coef)

    @property
    def uniform(self) -> bool:
        return self.coef == self.value_coef

    @property
    def coef_type(self) -> str:
        """The key coefficients' CUDA type (KeyT; CoefT of the projection)."""
        return coef_cuda_type(self.dtype, self.coef)

    @property
    def value_coef_type(self) -> str:
        """The value coefficients' CUDA type (ValT)."""
        return coef_cuda_type(self.dtype, self.value_coef)


@dataclass(frozen=True)
class KernelConfig(_SideKinds):
    """One instantiation of the decode and projection templates (the merge depends on dtype only).

    ``coef`` is the key coefficients' kind and ``value_coef`` the values' (None: the same as the
    keys', a uniform layout); the projection template exists for uniform "same" and "int8" only."""

    dtype: str  # "float32", "float16" or "bfloat16": q, bases, new tokens, output
    coef: str  # "same" (coefficients stored in dtype), "int8" (with float32 scales), "int4" or "int2"
    d: int  # GENERIC (0): any head size, passed at run time
    d_v: int
    rank_tile: int
    value_coef: str | None = None

    @property
    def cuda_type(self) -> str:
        return CUDA_TYPES[self.dtype]

    @property
    def decode_name(self) -> str:
        return f"{NAMESPACE}::decode_split_partial<{self.cuda_type}, {self.coef_type}, {self.value_coef_type}, {self.d}, {self.d_v}, {self.rank_tile}>"

    @property
    def project_name(self) -> str:
        if not self.uniform:
            raise ValueError(f"no projection kernel for a format per side ({self.coef}/{self.value_coef})")
        return f"{NAMESPACE}::project_append<{self.cuda_type}, {self.coef_type}, {self.d}, {self.d_v}, {self.rank_tile}>"

    @property
    def merge_name(self) -> str:
        return merge_name(self.dtype)


def merge_name(dtype: str) -> str:
    return f"{NAMESPACE}::merge_splits<{CUDA_TYPES[dtype]}>"


def configs() -> list[KernelConfig]:
    """Every instantiation the backend may launch: fixed head sizes with the rank tiles up to d
    (r <= d), and run-time head sizes (d = d_v = GENERIC in the template) with every rank tile;
    for each (key, value) pair of different kinds (MIXED_PAIRS), the run-time head sizes with
    every rank tile (the per-token work depends on the rank tile only, so a fixed head size
    gains little, and each would add 12 instantiations per dtype and shape to compile)."""
    shapes = [(d, d, rt) for d in HEAD_SIZES for rt in RANK_TILES if rt <= d]
    shapes += [(GENERIC, GENERIC, rt) for rt in RANK_TILES]
    out = [KernelConfig(dtype, coef, d, d_v, rt) for dtype in CUDA_TYPES for coef in DECODE_COEF_KINDS for d, d_v, rt in shapes]
    out += [KernelConfig(dtype, k, GENERIC, GENERIC, rt, v) for dtype in CUDA_TYPES for k, v in MIXED_PAIRS for rt in RANK_TILES]
    return out


@dataclass(frozen=True)
class RopeConfig(_SideKinds):
    """One instantiation of ``decode_rope_partial`` (spec/rope.md P3): head sizes are run-time
    arguments, since the per-token work (the O(r d) rebuild) loops over d at run time anyway.
    ``coef``/``value_coef`` as KernelConfig's (keys, values; None: the keys')."""

    dtype: str
    coef: str  # "same", "int8", "int4" or "int2", as KernelConfig's
    rank_tile: int
    value_coef: str | None = None

    @property
    def name(self) -> str:
        return f"{NAMESPACE}::decode_rope_partial<{CUDA_TYPES[self.dtype]}, {self.coef_type}, {self.value_coef_type}, {self.rank_tile}>"


def rope_configs() -> list[RopeConfig]:
    """Every pre-RoPE decode instantiation: every coefficient storage the plain decode reads
    (float, int8, int4, int2) for both sides and every (key, value) pair of different kinds,
    every rank tile."""
    pairs = [(c, c) for c in DECODE_COEF_KINDS] + list(MIXED_PAIRS)
    return [RopeConfig(dtype, k, rt, v) for dtype in CUDA_TYPES for k, v in pairs for rt in RANK_TILES]


def find_rope_config(dtype: str, coef: str, rank: int, rank_v: int, value_coef: str | None = None) -> RopeConfig | None:
    rt = rank_tile(rank, rank_v)
    value_coef = coef if value_coef is None else value_coef
    if rt is None or dtype not in CUDA_TYPES or coef not in DECODE_COEF_KINDS or value_coef not in DECODE_COEF_KINDS:
        return None
    return RopeConfig(dtype, coef, rt, value_coef)


def exact_name(dtype: str) -> str:
    """``exact_partial``: the A3.2 partial of exact tokens (spec/window.md W3, W8)."""
    return f"{NAMESPACE}::exact_partial<{CUDA_TYPES[dtype]}>"


def name_expressions() -> dict[str, list[str]]:
    """Source file -> the template-ids instantiated from it, in a fixed order."""
    cfgs = configs()
    return {
        DECODE_SOURCE: [c.decode_name for c in cfgs] + [merge_name(t) for t in CUDA_TYPES]
        + [c.name for c in rope_configs()] + [exact_name(t) for t in CUDA_TYPES],
        PROJECT_SOURCE: [c.project_name for c in cfgs if c.uniform and c.coef in COEF_KINDS],
    }


def rank_tile(rank: int, rank_v: int) -> int | None:
    """The smallest compiled rank tile holding both ranks, or None."""
    need = max(rank, rank_v)
    return next((rt for rt in RANK_TILES if rt >= need), None)


def find_config(dtype: str, coef: str, d: int, d_v: int, rank: int, rank_v: int, value_coef: str | None = None) -> KernelConfig | None:
    """The instantiation for these shapes: the fixed head size's if compiled, else the run-time
    one. ``coef`` the key coefficients' kind, ``value_coef`` the values' (None: the keys')."""
    rt = rank_tile(rank, rank_v)
    value_coef = coef if value_coef is None else value_coef
    if rt is None or dtype not in CUDA_TYPES or coef not in DECODE_COEF_KINDS or value_coef not in DECODE_COEF_KINDS:
        return None
    for cfg in (KernelConfig(dtype, coef, d, d_v, rt, value_coef), KernelConfig(dtype, coef, GENERIC, GENERIC, rt, value_coef)):
        if cfg in _config_set():
            return cfg
    return None


_CONFIGS: frozenset[KernelConfig] | None = None


def _config_set() -> frozenset[KernelConfig]:
    global _CONFIGS
    if _CONFIGS is None:
        _CONFIGS = frozenset(configs())
    return _CONFIGS


COEF_BITS = {"float": 32, "__half": 16, "__nv_bfloat16": 16, INT8_TYPE: 8, LOW_BIT_TYPES["int4"]: 4, LOW_BIT_TYPES["int2"]: 2}


def _stages(tokens: int, row_bytes: int) -> int:
    """TileGeometry<RT, KeyT, ValT, TT>::kStages: two if two stages of key and value tiles fit
    STAGE_BUDGET_BYTES, else one (``row_bytes``: a key row plus a value row)."""
    return 2 if 2 * tokens * row_bytes <= STAGE_BUDGET_BYTES else 1


def _row_bytes(rt: int, bits: int) -> int:
    return rt * bits // 8 + ROW_PAD_BYTES


def decode_tiles(rt: int, bits: int, value_bits: int | None = None) -> tuple[int, int]:
    """(tokens per tile, stages) of ``decode_split_partial`` for rank tile ``rt`` and ``bits`` per
    stored key coefficient, ``value_bits`` per value coefficient (None: ``bits``; DecodeTiles<RT,
    KeyT, ValT> there): two stages of 64-token tiles if their key and value tiles fit
    STAGE_BUDGET_BYTES, else two of 32, else one of 32."""
    row = _row_bytes(rt, bits) + _row_bytes(rt, bits if value_bits is None else value_bits)
    tt = TOKEN_TILE if _stages(TOKEN_TILE, row) == 2 else TOKEN_TILE_SMALL
    return tt, _stages(tt, row)


def rope_tiles(rt: int, bits: int, value_bits: int | None = None) -> tuple[int, int]:
    """(tokens per tile, stages) of ``decode_rope_partial`` (RopeTiles<RT, KeyT, ValT> there):
    32-token tiles, two stages when their key and value tiles fit STAGE_BUDGET_BYTES."""
    row = _row_bytes(rt, bits) + _row_bytes(rt, bits if value_bits is None else value_bits)
    return ROPE_TOKEN_TILE, _stages(ROPE_TOKEN_TILE, row)


def _tile_bytes(tt: int, stages: int, rt: int, coef_type: str, value_coef_type: str | None = None) -> int:
    """TileGeometry<RT, KeyT, ValT, TT>::kBytes: the key and value tiles of every stage and the
    per-token numbers beside them, each side's own (int8 key scales; low-bit value zero points;
    int8 or low-bit value scales; low-bit key groups and the dequantised key tile)."""
    value_coef_type = coef_type if value_coef_type is None else value_coef_type
    low = set(LOW_BIT_TYPES.values())
    key_low, value_low = coef_type in low, value_coef_type in low
    per_stage = (coef_type == INT8_TYPE) + value_low + (value_coef_type == INT8_TYPE or value_low)  # scale slots
    extra = stages * tt * per_stage
    if key_low:
        extra += stages * tt + tt * (rt + 1)  # key group per token; dequantised key tile
    tiles = stages * tt * (_row_bytes(rt, COEF_BITS[coef_type]) + _row_bytes(rt, COEF_BITS[value_coef_type]))
    return tiles + 4 * extra


def decode_shared_bytes(group: int, d: int, d_v: int, rt: int, coef_type: str, value_coef_type: str | None = None) -> int:
    """Dynamic shared memory of ``decode_split_partial`` (the carve-up at the top of the kernel);
    ``coef_type``/``value_coef_type`` are the CUDA key/value coefficient types of the
    instantiation (KeyT, ValT; None: the keys')."""
    value_coef_type = coef_type if value_coef_type is None else value_coef_type
    tt, stages = decode_tiles(rt, COEF_BITS[coef_type], COEF_BITS[value_coef_type])
    return _tile_bytes(tt, stages, rt, coef_type, value_coef_type) + 4 * group * (d + 2 * rt + tt + d_v + 4)


def rope_shared_bytes(group: int, d: int, rt: int, coef_type: str, value_coef_type: str | None = None) -> int:
    """Dynamic shared memory of ``decode_rope_partial`` (the carve-up at the top of the kernel)."""
    value_coef_type = coef_type if value_coef_type is None else value_coef_type
    tt, stages = rope_tiles(rt, COEF_BITS[coef_type], COEF_BITS[value_coef_type])
    return _tile_bytes(tt, stages, rt, coef_type, value_coef_type) + 4 * (tt * (d + 1) + 2 * ROPE_SUB * (d // 2) + group * (d + tt + rt + 3))


def exact_shared_bytes(group: int, d: int, d_v: int) -> int:
    """Dynamic shared memory of ``exact_partial``."""
    tt = EXACT_TOKEN_TILE
    return 4 * (group * (d + tt + d_v + 3) + tt * (d + 1) + tt * d_v)


# ------------------------------------------------------------------------------ sources

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def source_text(filename: str, seen: set[str] | None = None) -> str:
    """The kernel file with its local ``#include "..."`` headers pasted in (each once; pass one
    ``seen`` set to several calls to paste a header once across several files).

    CuPy's on-disk kernel cache is keyed by the source string, not by the headers it includes;
    pasting them in makes an edit to a header recompile instead of loading a stale binary.
    """
    seen = set() if seen is None else seen

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (KERNEL_DIR / name).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(filename)


_TEMPLATE = re.compile(
    r"template\s*<(?P<params>[^>]*)>\s*__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(?P<name>\w+)\s*\(",
    re.S,
)


def declared_templates(filename: str) -> dict[str, int]:
    """Kernel templates declared in a source file: name -> number of template parameters."""
    text = (KERNEL_DIR / filename).read_text()
    return {m.group("name"): len(m.group("params").split(",")) for m in _TEMPLATE.finditer(text)}


def split_name_expression(expr: str) -> tuple[str, list[str]]:
    """``ns::name<a, b>`` -> ("name", ["a", "b"])."""
    m = re.fullmatch(rf"{NAMESPACE}::(\w+)<(.*)>", expr)
    if m is None:
        raise ValueError(f"not a name expression of namespace {NAMESPACE}: {expr!r}")
    return m.group(1), [a.strip() for a in m.group(2).split(",")]


def explicit_instantiation_unit(filename: str, names: list[str] | None = None) -> str:
    """A translation unit that includes ``filename`` and instantiates ``names`` (default: every
    template-id the Python side uses from it), for an offline nvcc compile. Taking each kernel's
    address forces its device code to be generated without restating its parameter list."""
    names = name_expressions()[filename] if names is None else names
    lines = [f'#include "{KERNEL_DIR / filename}"', "", "extern void* const subspace_instances[];"]
    lines.append("void* const subspace_instances[] = {")
    lines += [f"    reinterpret_cast<void*>(&{n})," for n in names]
    lines.append("};")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ modules

_modules: dict[tuple[str, tuple[str, ...]], object] = {}
_lock = threading.Lock()
NVRTC_OPTIONS = ("-std=c++17",)


def module(filename: str, names: tuple[str, ...]):
    """The compiled ``cupy.RawModule`` of ``filename`` holding ``names`` (compiled on first use,
    then cached here and on disk by CuPy). Only the instantiations one call needs are compiled, so
    the first launch costs seconds, not the whole list."""
    key = (filename, names)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            import cupy

            mod = cupy.RawModule(code=source_text(filename), options=NVRTC_OPTIONS, name_expressions=list(names))
            _modules[key] = mod
    return mod


_functions: dict[tuple[str, tuple[str, ...], str], object] = {}


def function(filename: str, name: str, *others: str):
    """The ``cupy.RawKernel`` ``name`` from a module compiled with ``name`` and ``others``.

    Cached, so that attributes set on it (the dynamic shared memory opt-in) persist."""
    names = tuple(sorted({name, *others}))
    key = (filename, names, name)
    kernel = _functions.get(key)
    if kernel is None:
        kernel = _functions.setdefault(key, module(filename, names).get_function(name))
    return kernel
