"""The packed state layout of spec A9: the arrays every backend reads in place."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from subspace_ref.arrays import grown, to_numpy


def _capacity(needed: int, current: int) -> int:
    # geometric growth: appending T tokens one by one costs O(T) copies in total
    return max(needed, 2 * current, 16)


@dataclass
class PackedLayout:
    """Arrays of one layer for N sequences x H KV heads (spec A9).

    Rows of ``key_coef``/``value_coef`` past ``num_tokens`` and chunks past ``num_chunks`` are
    spare capacity: allocated, never read.
    """

    key_coef: Any  # (N, H, T_cap, r)
    value_coef: Any  # (N, H, T_cap, r_v)
    key_bases: Any  # (N, H, J_cap, r, d)
    value_bases: Any  # (N, H, J_cap, r_v, d_v)
    chunk_starts: Any  # (N, H, J_cap) int64
    num_chunks: Any  # (N, H) int64
    gamma: Any  # (H,)
    num_tokens: int
    key_scale: Any = None  # (N, H, T_cap) float32 when coefficients are int8 (spec A10)
    value_scale: Any = None
    key_basis_scale: Any = None  # (N, H, J_cap, r) float32 when bases are int8 (spec/storage.md S1)
    value_basis_scale: Any = None  # (N, H, J_cap, r_v)
    basis_format: str = "native"  # how key_bases/value_bases are stored (spec/storage.md S1)
    # int4/int2 coefficients (spec/quantization.md Q2): key_coef/value_coef hold packed uint8 codes
    key_group_scale: Any = None  # (N, H, ceil(T_cap / group), r) float16, per channel per token group
    key_group_zero: Any = None
    key_tail: Any = None  # (N, H, group, r) state dtype: the keys of the unfinished trailing group
    value_token_scale: Any = None  # (N, H, T_cap) float16, per token
    value_token_zero: Any = None
    low_bits: int = 0  # 4 or 2 for int4/int2 coefficients, 0 otherwise
    group: int = 0  # tokens per key group of low-bit coefficients

    ARRAYS = (
        "key_coef", "value_coef", "key_bases", "value_bases", "chunk_starts", "num_chunks", "gamma", "key_scale", "value_scale", "key_basis_scale",
        "value_basis_scale", "key_group_scale", "key_group_zero", "key_tail", "value_token_scale", "value_token_zero",
    )

    @property
    def coefficients(self) -> str:
        """How coefficients are stored: "float", "int8" (spec A10), "int4" or "int2" (spec/quantization.md)."""
        return f"int{self.low_bits}" if self.low_bits else ("int8" if self.quantized else "float")

    @property
    def quantized(self) -> bool:
        """True when the coefficients are int8 with per-token scales (spec A10)."""
        return self.key_scale is not None

    def coefficient_rows(self, which: str, n: int, h: int, a: int, b: int, dtype: Any) -> Any:
        """Rows [a, b) of the "key" or "value" coefficients of sequence n, head h, in ``dtype``,
        dequantised when the layout is int8 (spec A10)."""
        if self.low_bits:
            from subspace_ref.quantization import read_low_bit

            return read_low_bit(self, which, a, b, dtype, self.num_tokens, (n, h))
        coef = getattr(self, f"{which}_coef")[n, h, a:b]
        if not self.quantized:
            return coef.astype(dtype)
        from subspace_ref.quantization import dequantize_rows

        return dequantize_rows(coef, getattr(self, f"{which}_scale")[n, h, a:b], dtype)

    @property
    def dtype(self) -> Any:
        """The state's floating dtype (gamma's): that of keys and values appended and of float
        coefficients; the stored bases have it only in the "native" basis format."""
        return self.gamma.dtype

    def basis(self, which: str, index: tuple, dtype: Any) -> Any:
        """The "key" or "value" bases at ``index`` (a tuple over the (N, H, J) axes, optionally
        a row after them), decoded into ``dtype`` (a new array): the one way bases are read
        (spec/storage.md S2)."""
        from subspace_ref.basis_storage import decode

        scale = getattr(self, f"{which}_basis_scale")
        return decode(getattr(self, f"{which}_bases")[index], None if scale is None else scale[index], dtype)

    def store_basis(self, which: str, index: tuple, x: Any) -> Any:
        """Encode bases ``x`` into the "key" or "value" bases at ``index`` IN PLACE (only spare
        chunk slots or private copies may be written) and return them as :meth:`basis` will read
        them, in x's dtype: what an online state projects with (spec/storage.md S3)."""
        from subspace_ref.basis_storage import decode, encode

        stored, scale = encode(x, self.basis_format, self.dtype)
        getattr(self, f"{which}_bases")[index] = stored
        if scale is not None:
            getattr(self, f"{which}_basis_scale")[index] = scale
        return decode(stored, scale, x.dtype)

    def with_private_bases(self) -> "PackedLayout":
        """A layout whose basis (and basis scale) arrays are copies: for rewriting bases that
        are in use (warm-up rows, a rotating refresh) without touching the original."""
        from subspace_ref.arrays import clone

        names = ("key_bases", "value_bases", "key_basis_scale", "value_basis_scale")
        return replace(self, **{name: clone(getattr(self, name)) for name in names if getattr(self, name) is not None})

    TOKEN_AXIS = ("key_coef", "value_coef", "key_scale", "value_scale", "value_token_scale", "value_token_zero")
    GROUP_AXIS = ("key_group_scale", "key_group_zero")
    CHUNK_AXIS = ("key_bases", "value_bases", "chunk_starts", "key_basis_scale", "value_basis_scale")

    def live_arrays(self) -> dict[str, Any]:
        """The arrays in use cut to their live ranges (views): tokens < num_tokens, chunks < the
        largest num_chunks. What a copy, a saved file or a before/after comparison holds."""
        T = self.num_tokens
        J = int(to_numpy(self.num_chunks).max())
        out = {}
        for name, x in self.arrays().items():
            if name in self.TOKEN_AXIS:
                x = x[:, :, :T]
            elif name in self.CHUNK_AXIS:
                x = x[:, :, :J]
            elif name in self.GROUP_AXIS:
                x = x[:, :, : T // self.group]
            out[name] = x
        return out

    def arrays(self) -> dict[str, Any]:
        """The arrays in use (the scales only for quantized layouts)."""
        return {name: getattr(self, name) for name in self.ARRAYS if getattr(self, name) is not None}

    def with_capacity(self, tokens: int, chunks: int) -> "PackedLayout":
        """A layout holding the same data with room for ``tokens`` tokens and ``chunks`` chunks."""
        t_cap = self.key_coef.shape[2]
        j_cap = self.key_bases.shape[2]
        new_t = t_cap if tokens <= t_cap else _capacity(tokens, t_cap)
        new_j = j_cap if chunks <= j_cap else _capacity(chunks, j_cap)
        return replace(
            self,
            key_coef=grown(self.key_coef, 2, new_t),
            value_coef=grown(self.value_coef, 2, new_t),
            key_bases=grown(self.key_bases, 2, new_j),
            value_bases=grown(self.value_bases, 2, new_j),
            chunk_starts=grown(self.chunk_starts, 2, new_j),
            key_scale=None if self.key_scale is None else grown(self.key_scale, 2, new_t),
            value_scale=None if self.value_scale is None else grown(self.value_scale, 2, new_t),
            key_basis_scale=None if self.key_basis_scale is None else grown(self.key_basis_scale, 2, new_j),
            value_basis_scale=None if self.value_basis_scale is None else grown(self.value_basis_scale, 2, new_j),
            **{name: grown(getattr(self, name), 2, new_t) for name in ("value_token_scale", "value_token_zero") if getattr(self, name) is not None},
            **{name: grown(getattr(self, name), 2, -(-new_t // self.group)) for name in self.GROUP_AXIS if getattr(self, name) is not None},
        )

    def map_arrays(self, fn) -> "PackedLayout":
        """A layout with ``fn`` applied to every array in use (conversion between families, devices, dtypes)."""
        return replace(self, **{name: fn(name, x) for name, x in self.arrays().items()})
