"""Rotary position embeddings (RoPE) for the cache: the model's rotation R_t, bases made of whole
frequency planes (spec/rope.md P1, statements R1-R4), and the rotation a pre-RoPE state undoes
and re-applies (spec/rope.md P2-P3).

Nothing here imports torch at import time: :meth:`RopeParams.from_config` imports transformers'
rope initialisers only for non-default rope types, and :func:`rotate` touches torch only when
given a torch tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from subspace_ref import _checks
from subspace_ref.arrays import array_family

#: "half": Llama/GPT-NeoX rotate-half, plane i = dims (i, i + m) of the rotary dims;
#: "interleaved": GPT-J, plane i = dims (2i, 2i + 1).
LAYOUTS = ("half", "interleaved")


def _layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f'layout must be "half" (Llama rotate-half) or "interleaved" (GPT-J), got {layout!r}')
    return layout


@dataclass(frozen=True, eq=False)
class RopeParams:
    """The rotation R_t of spec/rope.md §1: plane i (of ``m = len(inv_freq)``) turns by the angle
    ``t * inv_freq[i]`` at position t, scaled by ``attention_scaling`` (transformers multiplies
    cos and sin by it: R_t = a Q_t with Q_t orthogonal); the ``d - 2m`` dims past the rotary
    dims pass unchanged (partial rotary, GPT-NeoX). ``inv_freq`` is kept as a read-only float64
    copy. Compared by identity (one object per model)."""

    inv_freq: np.ndarray
    layout: str = "half"
    attention_scaling: float = 1.0

    def __post_init__(self):
        f = np.array(_checks.as_array("inv_freq", self.inv_freq), dtype=np.float64)
        if f.ndim != 1 or f.size == 0:
            raise ValueError(f"inv_freq must be a non-empty 1-D array (one frequency per plane), got shape {f.shape}")
        if not np.all(np.isfinite(f)):
            raise ValueError("inv_freq must be finite")
        f.setflags(write=False)
        object.__setattr__(self, "inv_freq", f)
        object.__setattr__(self, "layout", _layout(self.layout))
        a = float(self.attention_scaling)
        if not (math.isfinite(a) and a > 0):
            raise ValueError(f"attention_scaling must be positive and finite, got {self.attention_scaling!r}")
        object.__setattr__(self, "attention_scaling", a)

    @property
    def rotary_dim(self) -> int:
        """2m: the number of dimensions that rotate."""
        return 2 * self.inv_freq.size

    @classmethod
    def from_config(cls, config: Any, layout: str = "half") -> "RopeParams":
        """The RoPE of a transformers config (its text config for multimodal ones): rope_theta,
        partial_rotary_factor and head_dim as transformers' default initialiser reads them; other
        rope types (linear, yarn, llama3, ...) through transformers' own ``ROPE_INIT_FUNCTIONS``
        (imports torch). Dynamic rope types change inv_freq with the sequence length: refused."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        params = getattr(text, "rope_parameters", None) or {}
        legacy = getattr(text, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
        if rope_type == "dynamic" or "dynamic" in str(rope_type):
            raise ValueError(f"rope_type {rope_type!r} changes its frequencies with the sequence length; a state needs fixed R_t")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(text, "rope_theta", None))
            if theta is None:
                raise ValueError(f"{type(config).__name__} has no rope_theta: the model has no rotary embedding")
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            factor = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
            dim = int(head_dim * factor)
            # transformers' _compute_default_rope_parameters, in float64
            inv_freq = 1.0 / (float(theta) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
            return cls(inv_freq, layout, 1.0)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](text)
        return cls(inv_freq.double().cpu().numpy(), layout, float(scaling))

    def planes(self, d: int) -> np.ndarray:
        """:func:`plane_pairs` of head size ``d`` under this RoPE (first m rows rotate)."""
        return plane_pairs(d, self.layout, self.rotary_dim)

    def cos_sin(self, positions: Any) -> tuple[np.ndarray, np.ndarray]:
        """(a cos(t theta_i), a sin(t theta_i)) for positions (n,): two (n, m) float64 arrays."""
        angles = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        return self.attention_scaling * np.cos(angles), self.attention_scaling * np.sin(angles)


def plane_pairs(d: int, layout: str = "half", rotary_dim: int | None = None) -> np.ndarray:
    """(d/2, 2) dimension index pairs, one per plane (spec/rope.md §1). The first ``rotary_dim/2``
    are the rotating planes, in frequency order; the remaining dims (partial rotary) do not
    rotate, and are paired consecutively so that every basis of :func:`plane_basis` is made of
    planes (any pairing of fixed dims commutes with R_t)."""
    d = _checks.positive_int("d", d)
    layout = _layout(layout)
    rot = d if rotary_dim is None else int(rotary_dim)
    if d % 2 or rot % 2 or not 0 < rot <= d:
        raise ValueError(f"planes need an even head size d and an even rotary_dim in (0, d]; got d={d}, rotary_dim={rotary_dim}")
    m = rot // 2
    i = np.arange(m)
    rotating = np.stack([i, i + m], 1) if layout == "half" else np.stack([2 * i, 2 * i + 1], 1)
    rest = np.arange(rot, d).reshape(-1, 2)
    return np.concatenate([rotating, rest]).astype(np.int64)


def rotate(x: Any, positions: Any, rope: RopeParams, *, inverse: bool = False) -> Any:
    """R_t x_t (or R_t^{-1} x_t) for x (..., n, d) and positions (n,): spec/rope.md §1.

    Plane (i, j) with angle t theta_i: (x_i, x_j) -> a (c x_i - s x_j, s x_i + c x_j). The inverse
    is Q_t^T / a: (c x_i + s x_j, -s x_i + c x_j) / a^2 with c, s already holding a. NumPy, CuPy
    or torch arrays (float64 angles cast to x's dtype); returns a new array."""
    family = array_family(x)
    if family == "torch" and x.device.type == "cpu" and not x.requires_grad and str(x.dtype) in ("torch.float32", "torch.float64"):
        import torch

        # the same operations in NumPy on a view of x, bit for bit: cheaper per operation on the
        # one token a decode step's append rotates (docs/benchmarks.md)
        return torch.from_numpy(rotate(x.numpy(), positions, rope, inverse=inverse))
    cos, sin = rope.cos_sin(positions)
    if inverse:
        cos, sin = inverse_angles(cos, sin, rope)
    if family == "torch":
        import torch

        cos = torch.as_tensor(cos, dtype=x.dtype, device=x.device)
        sin = torch.as_tensor(sin, dtype=x.dtype, device=x.device)
    else:
        from subspace_ref.arrays import namespace

        xp = namespace(x)
        cos, sin = xp.asarray(cos, dtype=x.dtype), xp.asarray(sin, dtype=x.dtype)
    return rotate_by(x, cos, sin, rotating_dims(rope, x.shape[-1]))


def inverse_angles(cos: Any, sin: Any, rope: RopeParams) -> tuple[Any, Any]:
    """The angles of R_t^{-1} = Q_t^T / a from those of R_t (both holding a): (cos, -sin) / a^2."""
    return cos / rope.attention_scaling**2, -sin / rope.attention_scaling**2


def rotate_by(x: Any, cos: Any, sin: Any, dims: tuple[slice, slice]) -> Any:
    """:func:`rotate` with the angles given: ``cos``, ``sin`` (n, m) of :meth:`RopeParams.cos_sin`
    (or :func:`inverse_angles`) in x's array type and dtype, e.g. device tensors of positions
    that only the device knows (the graph cache, spec/models.md M11.10), and ``dims`` of
    :func:`rotating_dims` (taken once, outside a traced step). Returns a new array."""
    a, b = dims
    out = x.clone() if array_family(x) == "torch" else x.copy()
    xa, xb = x[..., a], x[..., b]
    out[..., a] = cos * xa - sin * xb
    out[..., b] = sin * xa + cos * xb
    return out


@functools.lru_cache(maxsize=64)
def rotating_dims(rope: RopeParams, d: int) -> tuple[slice, slice]:
    """The first and the second dims of the rotating planes of :func:`plane_pairs` as slices
    (views, not gathers: a decode step rotates one token, where each indexing operation costs
    more than the arithmetic): (i, i + m) for "half", (2i, 2i + 1) for "interleaved"."""
    pairs = rope.planes(d)[: rope.inv_freq.size]  # validates d
    m = len(pairs)
    a, b = (slice(0, m), slice(m, 2 * m)) if rope.layout == "half" else (slice(0, 2 * m, 2), slice(1, 2 * m, 2))
    assert np.array_equal(np.arange(d)[a], pairs[:, 0]) and np.array_equal(np.arange(d)[b], pairs[:, 1])
    return a, b


# ----------------------------------------------------------------------------- plane bases
def plane_energy(keys: Any, layout: str = "half", rotary_dim: int | None = None) -> np.ndarray:
    """Per head and plane, sum_t (k_{t,i}^2 + k_{t,j}^2) of keys (H, N, d): (H, d/2), planes in
    :func:`plane_pairs` order. Invariant under RoPE up to a^2 on the rotating planes (R3)."""
    K = np.asarray(_checks.as_array("keys", keys), dtype=np.float64)
    _checks.shape("keys", K, (None, None, None))
    pairs = plane_pairs(K.shape[2], layout, rotary_dim)
    per_dim = (K * K).sum(axis=1)  # (H, d)
    return per_dim[:, pairs].sum(-1)


def plane_basis(energy: Any, rank: int, layout: str = "half", rotary_dim: int | None = None) -> np.ndarray:
    """Spec/rope.md P1: per head the rank/2 planes of largest ``energy`` (H, d/2) (ties: lower
    plane index first), as rows e_i, e_j: (H, rank, d) float64, planes in decreasing energy."""
    E = np.asarray(energy, dtype=np.float64)
    _checks.shape("energy", E, (None, None))
    d = 2 * E.shape[1]
    pairs = plane_pairs(d, layout, rotary_dim)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank % 2 or not 2 <= rank <= d:
        raise ValueError(f"rank must be an even int in [2, {d}] (whole planes of two dims), got {rank!r}")
    H = E.shape[0]
    B = np.zeros((H, rank, d))
    for h in range(H):
        chosen = np.argsort(-E[h], kind="stable")[: rank // 2]
        rows = pairs[chosen].reshape(-1)  # e_i, e_j of each chosen plane in turn
        B[h, np.arange(rank), rows] = 1.0
    return B


def calibrate_rope_planes(
    keys: Any,
    values: Any,
    *,
    rank_k: int,
    rank_v: int,
    layout: str = "half",
    rotary_dim: int | None = None,
    gamma: Any = "unit",
):
    """A :class:`~subspace_ref.StaticBasis` whose key basis is made of whole RoPE planes (spec
    rope.md P1): per head the rank_k/2 planes of largest key energy; values get their ordinary
    SVD basis (spec A5; values are not rotated). Keys (H, N, d) may be pre- or post-RoPE: plane
    energies agree (R3). The basis commutes with every R_t (R1), so a plain static state over
    post-RoPE keys needs no transport at all. ``gamma`` as in :func:`~subspace_ref.calibrate`
    ("unit", "paper", a number, one per head)."""
    from subspace_ref.calibration import StaticBasis, calibrate, resolve_gamma

    K = np.asarray(_checks.as_array("keys", keys))
    _checks.float_dtype("keys", K)
    _checks.finite("keys", K)
    B = plane_basis(plane_energy(K, layout, rotary_dim), rank_k, layout, rotary_dim).astype(K.dtype)
    # the value side is exactly spec A5's basis: reuse calibrate (its key basis is discarded)
    E = calibrate(K, values, rank_k=1, rank_v=rank_v).E
    ranks = (int(rank_k),) * K.shape[0]
    return StaticBasis(B=B, E=E, gamma=resolve_gamma(gamma, ranks, K.shape[2], K.dtype), rank_k=ranks, rank_v=(int(rank_v),) * K.shape[0])


__all__ = ["LAYOUTS", "RopeParams", "calibrate_rope_planes", "inverse_angles", "plane_basis", "plane_energy", "plane_pairs", "rotate", "rotate_by", "rotating_dims"]
