"""Kernel launches: decode attention (spec A3, A3.2) and projection (spec A6, A7 steps 1-2).

Planning (grid, splits, shared memory) and the argument tuples are plain Python over array
shapes, shared by the CuPy launches here and by the host emulation in :mod:`._emulation` that
checks the kernels' logic on machines without a GPU. Every scalar in an argument tuple is typed
(np.int32 / np.float32 / np.uint64 for a null pointer): a RawKernel copies arguments into the
parameter buffer by their Python type, and a mistyped scalar is read as garbage, not rejected.
CuPy is imported inside the launching functions only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from subspace_ref_cupy import _kernels as K

NULL = np.uint64(0)
# Below this many tokens per split the per-split fixed costs (q~_j, the partial's d_v floats and
# its merge) outweigh the parallelism gained.
MIN_SPLIT_TOKENS = 4 * K.TOKEN_TILE
MAX_SPLITS = 256
SMEM_DEFAULT = 48 * 1024


@dataclass
class CoefArrays:
    """The arrays of one layer as the kernels read them (spec A9), C-contiguous, on one device
    (CuPy), or on the host for the emulation (NumPy). ``gamma`` is float32.
    ``key_scale``/``value_scale`` (N, H, T_cap) float32 are present only for INT8 coefficients."""

    key_coef: Any
    value_coef: Any
    key_bases: Any
    value_bases: Any
    chunk_starts: Any
    num_chunks: Any
    gamma: Any
    num_tokens: int
    key_scale: Any = None
    value_scale: Any = None
    # int4/int2 (spec/quantization.md Q2): packed uint8 codes in key_coef/value_coef, float16
    # scales and zero points, the unfinished key group in the bases' dtype. ``low_bits``: both
    # sides' code width (a uniform layout); ``key_low_bits``/``value_low_bits``: one side's, for a
    # layout with a format per side (spec/quantization.md Q0; None: ``low_bits``)
    low_bits: int = 0
    key_low_bits: int | None = None
    value_low_bits: int | None = None
    key_group: int = 0
    key_group_scale: Any = None
    key_group_zero: Any = None
    key_tail: Any = None
    value_token_scale: Any = None
    value_token_zero: Any = None
    # pre-RoPE static state (spec/rope.md P3): the m frequencies (float64), the dims in the order
    # the kernel reads planes (int32: first dims, second dims, fixed dims), the position of
    # compressed token 0 (spec/window.md W10) and the attention scaling a
    rope_inv_freq: Any = None
    rope_order: Any = None
    rope_first_position: int = 0
    rope_scale: float = 1.0
    # exact segments (spec/window.md W3, W8), sinks first: ((keys (N, H, n, d), values (N, H, n, d_v)), ...),
    # each with n >= 1 tokens, in the bases' dtype
    exact: tuple = ()

    def side_bits(self, side: str) -> int:
        """The int4/int2 code width of the "key" or "value" side, 0 when it is float or int8."""
        bits = getattr(self, f"{side}_low_bits")
        return self.low_bits if bits is None else bits

    def side_coef(self, side: str) -> str:
        """The KernelConfig coefficient kind of the "key" or "value" side."""
        bits = self.side_bits(side)
        if bits:
            return f"int{bits}"
        return "int8" if getattr(self, f"{side}_scale") is not None else "same"

    @property
    def coef(self) -> str:
        """The KernelConfig coefficient kind of the keys (KernelConfig.coef)."""
        return self.side_coef("key")

    @property
    def value_kind(self) -> str:
        """The KernelConfig coefficient kind of the values (KernelConfig.value_coef)."""
        return self.side_coef("value")


@dataclass(frozen=True)
class DecodePlan:
    cfg: Any  # K.KernelConfig, or K.RopeConfig for a pre-RoPE state
    N: int
    H: int
    Hq: int
    group: int
    d_v: int
    num_splits: int
    split_len: int
    shared_bytes: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.num_splits, self.H, self.N)

    @property
    def kernel(self) -> str:
        return self.cfg.name if isinstance(self.cfg, K.RopeConfig) else self.cfg.decode_name


@dataclass(frozen=True)
class AttendPlan:
    """Every launch of one attention call: the compressed part's split kernel (None when it holds
    no token), one exact_partial per exact segment, and the merge over all their partials."""

    decode: DecodePlan | None
    dtype: str
    N: int
    H: int
    Hq: int
    d: int
    d_v: int
    exact_shared_bytes: int
    num_exact: int

    @property
    def group(self) -> int:
        return self.Hq // self.H

    @property
    def merge_name(self) -> str:
        return K.merge_name(self.dtype)

    @property
    def exact_name(self) -> str:
        return K.exact_name(self.dtype)

    @property
    def columns(self) -> int:
        return (self.decode.num_splits if self.decode else 0) + self.num_exact

    def kernel_names(self) -> list[str]:
        names = [self.merge_name]
        if self.decode is not None:
            names.append(self.decode.kernel)
        if self.num_exact:
            names.append(self.exact_name)
        return names


def rope_fields(rope: Any, d: int, first_position: int) -> dict:
    """The CoefArrays fields of a pre-RoPE state (spec/rope.md P3) as host arrays: ``rope`` a
    :class:`subspace_ref.rope.RopeParams`; ``first_position`` = S, the sinks (spec/window.md W10)."""
    m = rope.inv_freq.size
    pairs = rope.planes(d)
    order = np.concatenate([pairs[:m, 0], pairs[:m, 1], pairs[m:].reshape(-1)]).astype(np.int32)
    return dict(
        rope_inv_freq=np.ascontiguousarray(rope.inv_freq, dtype=np.float64), rope_order=order,
        rope_first_position=int(first_position), rope_scale=float(rope.attention_scaling),
    )


def exact_segments(state) -> list[tuple[Any, Any]]:
    """The exact (keys, values) segments attention reads, sinks first (spec/window.md W8), each
    holding at least one token; as the state holds them."""
    win = state.window
    if win is None:
        return []
    segments = [(win.sink_keys, win.sink_values), (win.keys, win.values)]
    return [(k, v) for k, v in segments if k is not None and k.shape[2] > 0]


def i32(x: int) -> np.int32:
    if not -(2**31) <= x < 2**31:
        raise OverflowError(f"{x} does not fit the kernels' int32 parameters")
    return np.int32(x)


def _ptr(x: Any):
    return NULL if x is None else x


def choose_splits(blocks_per_split: int, num_tokens: int, sm_count: int) -> tuple[int, int]:
    """(S, tokens per split): as many blocks as the SMs hold at once (DECODE_MIN_BLOCKS per SM,
    what the kernel's registers are bounded for; shared memory allows it at the benchmark's
    shape, ``subspace-kv gpu-report``), rounded down so that no second, partly empty wave runs;
    no split shorter than MIN_SPLIT_TOKENS, split length a multiple of the token tile; every split
    non-empty."""
    want = max(1, K.DECODE_MIN_BLOCKS * sm_count // max(blocks_per_split, 1))
    useful = math.ceil(num_tokens / MIN_SPLIT_TOKENS)
    splits = max(1, min(want, useful, MAX_SPLITS))
    split_len = math.ceil(math.ceil(num_tokens / splits) / K.TOKEN_TILE) * K.TOKEN_TILE
    return math.ceil(num_tokens / split_len), split_len


def plan_decode(dtype: str, q_shape: tuple, arrays: CoefArrays, sm_count: int, splits: tuple[int, int] | None) -> DecodePlan:
    """Grid, splits and shared memory of one attention call. ``splits`` = (S, tokens per split)
    overrides the automatic choice; S may exceed what the tokens need (the extra splits are empty
    and merge as the identity, spec A3.2)."""
    N, Hq, d = q_shape
    H = arrays.key_coef.shape[1]
    # ranks from the bases: a low-bit coefficient row is packed bytes
    r, r_v = arrays.key_bases.shape[3], arrays.value_bases.shape[3]
    d_v = arrays.value_bases.shape[4]
    coef, value_coef = arrays.coef, arrays.value_kind
    rope = arrays.rope_inv_freq is not None
    cfg = K.find_rope_config(dtype, coef, r, r_v, value_coef) if rope else K.find_config(dtype, coef, d, d_v, r, r_v, value_coef)
    if cfg is None:  # not_supported_reasons refuses these first; this is the backstop
        raise ValueError(f"no compiled kernel for dtype={dtype}, coef={coef}/{value_coef}, d={d}, d_v={d_v}, r={r}, r_v={r_v}, rope={rope}")
    T = arrays.num_tokens
    num_splits, split_len = splits if splits is not None else choose_splits(N * H, T, sm_count)
    if num_splits < 1 or split_len < 1 or num_splits * split_len < T:
        raise ValueError(f"{num_splits} splits of {split_len} tokens do not cover {T} tokens")
    group = Hq // H
    if rope:
        shared = K.rope_shared_bytes(group, d, cfg.rank_tile, cfg.coef_type, cfg.value_coef_type)
    else:
        shared = K.decode_shared_bytes(group, d, d_v, cfg.rank_tile, cfg.coef_type, cfg.value_coef_type)
    return DecodePlan(cfg, N, H, Hq, group, d_v, num_splits, split_len, shared)


def plan_attend(dtype: str, q_shape: tuple, arrays: CoefArrays, sm_count: int, splits: tuple[int, int] | None) -> AttendPlan:
    """:func:`plan_decode` for the compressed part (when it holds tokens) and the exact segments."""
    N, Hq, d = q_shape
    H = arrays.key_coef.shape[1]
    d_v = arrays.value_bases.shape[4]
    if arrays.num_tokens == 0 and not arrays.exact:
        raise ValueError("no tokens were attended to; the softmax of an empty set is undefined")
    decode = plan_decode(dtype, q_shape, arrays, sm_count, splits) if arrays.num_tokens > 0 else None
    return AttendPlan(decode, dtype, N, H, Hq, d, d_v, K.exact_shared_bytes(Hq // H, d, d_v), len(arrays.exact))


def _coef_side_args(a: CoefArrays) -> tuple:
    """The arrays both decode kernels take after key_coef and value_coef (HeadCoefs there): int8
    scales, then the int4/int2 key group scales and zero points, key tail and value scales and
    zero points; null pointers where the storage has none."""
    return (
        _ptr(a.key_scale), _ptr(a.value_scale),
        _ptr(a.key_group_scale), _ptr(a.key_group_zero), _ptr(a.key_tail), _ptr(a.value_token_scale), _ptr(a.value_token_zero),
    )


def _key_group_arg(a: CoefArrays) -> np.int32:
    """The key group size G of int4/int2 keys (spec/quantization.md Q2); 1 for other key storage."""
    return i32(a.key_group if a.side_bits("key") else 1)


def _key_groups_arg(a: CoefArrays) -> np.int32:
    """Rows per head of the int4/int2 key group scales and zero points (key_group_scale.shape[2]):
    ceil(T_cap / G) as a layout allocates them, or fewer in a copy cut to its live groups
    (``state.to``); 1 for other key storage."""
    return i32(a.key_group_scale.shape[2] if a.side_bits("key") else 1)


def decode_args(plan: DecodePlan, q: Any, arrays: CoefArrays, part_m: Any, part_z: Any, part_o: Any, scale: float) -> tuple:
    """Arguments of ``decode_split_partial``, in the kernel's parameter order."""
    a = arrays
    return (
        q, a.key_coef, a.value_coef, *_coef_side_args(a),
        a.key_bases, a.value_bases, a.chunk_starts, a.num_chunks, a.gamma,
        part_m, part_z, part_o,
        i32(plan.H), i32(plan.group), i32(a.key_coef.shape[2]), i32(a.key_bases.shape[2]),
        i32(a.key_bases.shape[3]), i32(a.value_bases.shape[3]),
        i32(a.key_bases.shape[4]), i32(a.value_bases.shape[4]),
        i32(a.num_tokens), i32(plan.split_len), _key_group_arg(a), _key_groups_arg(a), np.float32(scale),
    )


def rope_args(plan: DecodePlan, q: Any, arrays: CoefArrays, part_m: Any, part_z: Any, part_o: Any, scale: float) -> tuple:
    """Arguments of ``decode_rope_partial``, in the kernel's parameter order."""
    a = arrays
    return (
        q, a.key_coef, a.value_coef, *_coef_side_args(a), a.key_bases, a.value_bases, a.gamma,
        a.rope_inv_freq, a.rope_order, part_m, part_z, part_o,
        i32(plan.H), i32(plan.group), i32(a.key_coef.shape[2]), i32(a.key_bases.shape[2]),
        i32(a.key_bases.shape[3]), i32(a.value_bases.shape[3]), i32(a.key_bases.shape[4]), i32(a.value_bases.shape[4]),
        i32(a.num_tokens), i32(plan.split_len), _key_group_arg(a), _key_groups_arg(a), i32(a.rope_inv_freq.shape[0]), i32(a.rope_first_position),
        np.float32(a.rope_scale), np.float32(scale),
    )


def exact_args(plan: AttendPlan, q: Any, keys: Any, values: Any, part_m: Any, part_z: Any, part_o: Any, col: int, scale: float) -> tuple:
    """Arguments of ``exact_partial`` for one exact segment written to column ``col``."""
    return (
        q, keys, values, part_m, part_z, part_o,
        i32(plan.H), i32(plan.group), i32(keys.shape[2]), i32(plan.d), i32(plan.d_v), i32(col), i32(part_m.shape[2]), np.float32(scale),
    )


def run_attention(plan: AttendPlan, q: Any, arrays: CoefArrays, scale: float, xp: Any, launch) -> Any:
    """The launches of one attention call, in order, through ``launch(name, grid, threads,
    shared_bytes, args)`` (a CuPy launch, or the host emulation's), with ``xp`` (cupy or numpy)
    allocating: the compressed part's split partials, one partial per exact segment, then the
    merge of all of them (spec A3.2; exact tokens are one more chunk, spec/window.md W3, W8)."""
    f32 = dict(dtype=xp.float32)
    parts = []
    dec = plan.decode
    if dec is not None:
        pm = xp.empty((plan.N, plan.Hq, dec.num_splits), **f32)
        pz = xp.empty_like(pm)
        po = xp.empty((plan.N, plan.Hq, dec.num_splits, plan.d_v), **f32)
        make = rope_args if isinstance(dec.cfg, K.RopeConfig) else decode_args
        launch(dec.kernel, dec.grid, K.DECODE_THREADS, dec.shared_bytes, make(dec, q, arrays, pm, pz, po, scale))
        parts.append((pm, pz, po))
    if plan.num_exact:
        em = xp.empty((plan.N, plan.Hq, plan.num_exact), **f32)
        ez = xp.empty_like(em)
        eo = xp.empty((plan.N, plan.Hq, plan.num_exact, plan.d_v), **f32)
        for col, (keys, values) in enumerate(arrays.exact):
            args = exact_args(plan, q, keys, values, em, ez, eo, col, scale)
            launch(plan.exact_name, (1, plan.H, plan.N), K.DECODE_THREADS, plan.exact_shared_bytes, args)
        parts.append((em, ez, eo))
    pm, pz, po = (xp.ascontiguousarray(xp.concatenate([p[i] for p in parts], axis=2)) if len(parts) > 1 else parts[0][i] for i in range(3))
    out = xp.empty((plan.N, plan.Hq, plan.d_v), dtype=q.dtype)
    launch(plan.merge_name, (plan.N * plan.Hq, 1, 1), K.MERGE_THREADS, 0, (pm, pz, po, out, i32(plan.columns), i32(plan.d_v)))
    return out


def merge_args(plan: DecodePlan, part_m: Any, part_z: Any, part_o: Any, out: Any) -> tuple:
    """Arguments of ``merge_splits``, in the kernel's parameter order."""
    return (part_m, part_z, part_o, out, i32(plan.num_splits), i32(plan.d_v))


def project_config(dtype: str, keys_shape: tuple, values_shape: tuple, key_coef_shape: tuple, value_coef_shape: tuple, int8: bool) -> K.KernelConfig:
    d, d_v = keys_shape[3], values_shape[3]
    r, r_v = key_coef_shape[3], value_coef_shape[3]
    coef = "int8" if int8 else "same"
    cfg = K.find_config(dtype, coef, d, d_v, r, r_v)
    if cfg is None:
        raise ValueError(f"no compiled kernel for dtype={dtype}, coef={coef}, d={d}, d_v={d_v}, r={r}, r_v={r_v}")
    return cfg


def project_grid(keys_shape: tuple) -> tuple[int, int, int]:
    N, H, n_new, _ = keys_shape
    return (min(math.ceil(n_new / K.PROJECT_WARPS), 65535), 2 * H, N)


def project_args(keys, values, key_bases, value_bases, num_chunks, key_coef, value_coef, key_scale, value_scale, rho_k, rho_v, offset: int) -> tuple:
    """Arguments of ``project_append``, in the kernel's parameter order."""
    H, n_new = keys.shape[1], keys.shape[2]
    t_cap = key_coef.shape[2]
    if offset + n_new > t_cap or value_coef.shape[2] != t_cap:
        raise ValueError(f"coefficient buffers of {t_cap} rows cannot take rows {offset}..{offset + n_new - 1}")
    return (
        keys, values, key_bases, value_bases, num_chunks, key_coef, value_coef,
        _ptr(key_scale), _ptr(value_scale), rho_k, rho_v,
        i32(H), i32(n_new), i32(t_cap), i32(key_bases.shape[2]),
        i32(key_coef.shape[3]), i32(value_coef.shape[3]),
        i32(keys.shape[3]), i32(values.shape[3]), i32(offset),
    )


# ------------------------------------------------------------------------------ CuPy launches


def max_shared_bytes(device) -> int:
    """The most dynamic shared memory one block may opt in to on a ``cupy.cuda.Device``."""
    attrs = device.attributes
    return int(attrs.get("MaxSharedMemoryPerBlockOptin", attrs.get("MaxSharedMemoryPerBlock", SMEM_DEFAULT)))


def attend(q, dtype: str, arrays: CoefArrays, scale: float, splits: tuple[int, int] | None = None):
    """Coefficient-space attention (spec A3) of q (N, H_q, d) over ``arrays`` on the current
    device and stream: (N, H_q, d_v) in q's storage dtype, accumulated in float32."""
    import cupy

    device = cupy.cuda.Device()
    plan = plan_attend(dtype, q.shape, arrays, int(device.attributes["MultiProcessorCount"]), splits)
    names = plan.kernel_names()

    def launch(name, grid, threads, shared_bytes, args):
        fn = K.function(K.DECODE_SOURCE, name, *names)
        if shared_bytes > SMEM_DEFAULT and fn.max_dynamic_shared_size_bytes < shared_bytes:
            fn.max_dynamic_shared_size_bytes = shared_bytes
        fn(grid, (threads,), args, shared_mem=shared_bytes)

    return run_attention(plan, q, arrays, scale, cupy, launch)


def project(dtype: str, keys, values, key_bases, value_bases, num_chunks, key_coef, value_coef, offset: int, key_scale=None, value_scale=None):
    """Spec A6 step 1 / A7 steps 1-2 for every head in one launch: writes B_j k and E_j v of the
    n new tokens (keys (N, H, n, d), values (N, H, n, d_v)) into rows offset..offset+n-1 of the
    coefficient buffers, with j the open chunk num_chunks - 1; returns the relative residuals
    (rho_k, rho_v), each (N, H, n) float32. INT8 storage when the scale buffers are given."""
    import cupy

    N, H, n_new, _ = keys.shape
    cfg = project_config(dtype, keys.shape, values.shape, key_coef.shape, value_coef.shape, key_scale is not None)
    rho_k = cupy.empty((N, H, n_new), dtype=cupy.float32)
    rho_v = cupy.empty((N, H, n_new), dtype=cupy.float32)
    args = project_args(keys, values, key_bases, value_bases, num_chunks, key_coef, value_coef, key_scale, value_scale, rho_k, rho_v, offset)
    if n_new:
        K.function(K.PROJECT_SOURCE, cfg.project_name)(project_grid(keys.shape), (K.PROJECT_THREADS,), args)
    return rho_k, rho_v


def project_tokens(dtype: str, keys, values, B, E):
    """Coefficients and residuals of new tokens against explicit bases B (N, H, r, d),
    E (N, H, r_v, d_v): returns (c (N, H, n, r), d (N, H, n, r_v), rho_k, rho_v).

    The shape of the projection step inside the online policies' token loop (spec A7 steps 1-2,
    A8 step 2), where the open bases live outside the packed layout."""
    import cupy

    N, H, n_new, _ = keys.shape
    c = cupy.empty((N, H, n_new, B.shape[2]), dtype=keys.dtype)
    dv = cupy.empty((N, H, n_new, E.shape[2]), dtype=keys.dtype)
    ones = cupy.ones((N, H), dtype=cupy.int64)
    rho_k, rho_v = project(
        dtype, cupy.ascontiguousarray(keys), cupy.ascontiguousarray(values),
        cupy.ascontiguousarray(B)[:, :, None], cupy.ascontiguousarray(E)[:, :, None], ones, c, dv, 0,
    )
    return c, dv, rho_k, rho_v
