"""The packed state layout of spec A9: the arrays every backend reads in place, and the one
enumeration of every array a state holds (:data:`STATE_ARRAYS`).

Copies, conversions, byte counts and saved files iterate :data:`STATE_ARRAYS`, so they cannot
disagree about which arrays exist. Adding an array to a state is one line there (plus the field
on the object holding it): name, part, attribute, axis kind, dtype rule and byte-count rule.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from subspace_ref.arrays import array_family, clone, grown, itemsize, numel, to_numpy
from subspace_ref.basis_storage import NATIVE, decode, encode, is_native
from subspace_ref.formats import FLOAT, FORMATS, CoefficientFormat, pair_name
from subspace_ref.quantization import dequantize_rows, read_low_bit

#: Axis kinds of axis 2 (after N, H): TOKEN rows past ``layout.num_tokens`` and CHUNK rows past
#: the largest ``num_chunks`` are spare capacity; FIXED arrays are live whole.
TOKEN, CHUNK, FIXED = "token", "chunk", "fixed"
#: GROUP rows are key groups of ``layout.group`` tokens (int4/int2 coefficients, spec/quantization.md
#: Q2): rows past num_tokens // group are spare capacity (or an unfinished group, held in key_tail).
GROUP = "group"
#: Dtype rules on conversion (``state.to(dtype=...)``): "state" arrays take the new floating
#: dtype; "coefficients" arrays unless coefficients are stored as integers (spec A10); "bases"
#: arrays unless bases are stored in a format of their own (spec/storage.md S1); "own" never.
DTYPE_RULES = ("state", "coefficients", "bases", "own")
#: Byte-count rules of ``state.nbytes``: "always", "never" (bookkeeping the paper does not
#: count), "adaptive" (chunk offsets: only a state whose chunks start anywhere pays for them).
COUNT_RULES = ("always", "never", "adaptive")


@dataclass(frozen=True)
class StateArray:
    """One array a state may hold: ``name`` is unique and is its tensor name in a saved file;
    it is attribute ``attr`` of the state's ``part`` ("layout", "sketches" or "window"), absent
    when that part or the attribute is None."""

    name: str
    part: str
    attr: str
    axis: str
    dtype: str
    counted: str = "always"


#: Every array of a state, in saved-file and checksum order (spec/persistence.md §3). Add new
#: arrays here; the order of existing ones is part of the file format.
STATE_ARRAYS = (
    StateArray("key_coef", "layout", "key_coef", TOKEN, "coefficients"),  # (N, H, T_cap, r)
    StateArray("value_coef", "layout", "value_coef", TOKEN, "coefficients"),  # (N, H, T_cap, r_v)
    StateArray("key_bases", "layout", "key_bases", CHUNK, "bases"),  # (N, H, J_cap, r, d)
    StateArray("value_bases", "layout", "value_bases", CHUNK, "bases"),  # (N, H, J_cap, r_v, d_v)
    StateArray("chunk_starts", "layout", "chunk_starts", CHUNK, "own", "adaptive"),  # (N, H, J_cap) int64
    StateArray("num_chunks", "layout", "num_chunks", FIXED, "own", "never"),  # (N, H) int64
    StateArray("gamma", "layout", "gamma", FIXED, "state"),  # (H,)
    StateArray("key_scale", "layout", "key_scale", TOKEN, "own"),  # (N, H, T_cap) float32, int8 coefficients (A10)
    StateArray("value_scale", "layout", "value_scale", TOKEN, "own"),
    StateArray("sketch_keys", "sketches", "keys", FIXED, "state"),  # (N, H, 2 ell_k, d) (A4)
    StateArray("sketch_values", "sketches", "values", FIXED, "state"),  # (N, H, 2 ell_v, d_v)
    StateArray("key_basis_scale", "layout", "key_basis_scale", CHUNK, "own"),  # (N, H, J_cap, r) float32, int8 bases (S1)
    StateArray("value_basis_scale", "layout", "value_basis_scale", CHUNK, "own"),
    StateArray("window_keys", "window", "keys", FIXED, "state"),  # (N, H, e, d) exact tokens (spec/window.md W1)
    StateArray("window_values", "window", "values", FIXED, "state"),  # (N, H, e, d_v)
    StateArray("ring_keys", "sketches", "ring_keys", FIXED, "state"),  # (N, H, W, d) (spec/sketch_variants.md S1)
    StateArray("ring_values", "sketches", "ring_values", FIXED, "state"),
    # int4/int2 coefficients (spec/quantization.md Q2): key_coef/value_coef then hold packed uint8 codes
    StateArray("key_group_scale", "layout", "key_group_scale", GROUP, "own"),  # (N, H, ceil(T_cap / G), r) float16
    StateArray("key_group_zero", "layout", "key_group_zero", GROUP, "own"),
    StateArray("key_tail", "layout", "key_tail", FIXED, "state"),  # (N, H, G, r): the unfinished key group, in float
    StateArray("value_token_scale", "layout", "value_token_scale", TOKEN, "own"),  # (N, H, T_cap) float16
    StateArray("value_token_zero", "layout", "value_token_zero", TOKEN, "own"),
    StateArray("sink_keys", "window", "sink_keys", FIXED, "state"),  # (N, H, s, d) attention sinks (spec/window.md W7)
    StateArray("sink_values", "window", "sink_values", FIXED, "state"),  # (N, H, s, d_v)
)
BY_NAME = {a.name: a for a in STATE_ARRAYS}
#: Per side, every layout array some coefficient format adds (spec/quantization.md Q0).
_SIDE_ARRAYS = {side: tuple(dict.fromkeys(name for f in FORMATS.values() for name in f.arrays(side))) for side in ("key", "value")}


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
    basis_format: str = NATIVE  # how key_bases/value_bases are stored (spec/storage.md S1)
    # int4/int2 coefficients (spec/quantization.md Q2): key_coef/value_coef hold packed uint8 codes
    key_group_scale: Any = None  # (N, H, ceil(T_cap / group), r) float16, per channel per token group
    key_group_zero: Any = None
    key_tail: Any = None  # (N, H, group, r) state dtype: the keys of the unfinished trailing group
    value_token_scale: Any = None  # (N, H, T_cap) float16, per token
    value_token_zero: Any = None
    # the formats.FORMATS name of each side's coefficients (spec/quantization.md Q0); the arrays
    # above that a side's format adds are present, the others None
    key_format: str = FLOAT
    value_format: str = FLOAT
    group: int = 0  # tokens per key group of low-bit key coefficients
    # arrays derived from torch arrays (decoded bases, scaled query maps): see derived. An init
    # field, so dataclasses.replace hands it on: an append's new layout keeps what is still valid
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    ARRAYS = tuple(a.attr for a in STATE_ARRAYS if a.part == "layout")

    def __post_init__(self):
        # the formats' arrays are there and no others (spec/quantization.md Q0): a layout built by
        # hand with int8 scales but no key_format="int8" would otherwise read its codes as floats
        for which in ("key", "value"):
            fmt = FORMATS.get(getattr(self, f"{which}_format"))
            if fmt is None:
                raise ValueError(f"{which}_format must be one of {', '.join(map(repr, FORMATS))}, got {getattr(self, f'{which}_format')!r}")
            for name in _SIDE_ARRAYS[which]:
                if (getattr(self, name) is not None) != (name in fmt.arrays(which)):
                    raise ValueError(f"{name} is {'missing' if name in fmt.arrays(which) else 'given'} for {which}_format={fmt.name!r}")

    def side_format(self, which: str) -> CoefficientFormat:
        """The record of the "key" or "value" coefficients' format (spec/quantization.md Q0)."""
        return FORMATS[self.key_format if which == "key" else self.value_format]

    def side_arrays(self, which: str) -> tuple[str, ...]:
        """Names of the arrays holding the "key" or "value" coefficients: ``{which}_coef`` and what its format adds."""
        return (f"{which}_coef",) + self.side_format(which).arrays(which)

    @property
    def coefficients(self) -> str:
        """How coefficients are stored: "float", "int8" (spec A10), "int4" or "int2"
        (spec/quantization.md Q1-Q2) for both sides, or "key/value" (e.g. "int4/int8") when the
        sides differ (:func:`~subspace_ref.formats.pair_name`)."""
        return pair_name(FORMATS[self.key_format], FORMATS[self.value_format])

    @property
    def uniform(self) -> bool:
        """Whether both sides store their coefficients in one format."""
        return self.key_format == self.value_format

    @property
    def quantized(self) -> bool:
        """True when both sides' coefficients are int8 with per-token scales (spec A10)."""
        return self.uniform and FORMATS[self.key_format].per_token_scale

    @property
    def low_bits(self) -> int:
        """4 or 2 when both sides store int4 / int2 codes (spec/quantization.md Q2), else 0: the
        uniform formats the kernels read. Per-side readers use :meth:`side_format`."""
        return FORMATS[self.key_format].low_bits if self.uniform else 0

    def coefficient_rows(self, which: str, n: int, h: int, a: int, b: int, dtype: Any) -> Any:
        """Rows [a, b) of the "key" or "value" coefficients of sequence n, head h, in ``dtype``,
        dequantised when the side is int8 (spec A10) or int4/int2 (spec/quantization.md Q2)."""
        fmt = self.side_format(which)
        if fmt.low_bits:
            return read_low_bit(self, which, a, b, dtype, self.num_tokens, (n, h))
        coef = getattr(self, f"{which}_coef")[n, h, a:b]
        if not fmt.per_token_scale:
            return coef.astype(dtype)
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
        scale = getattr(self, f"{which}_basis_scale")
        return decode(getattr(self, f"{which}_bases")[index], None if scale is None else scale[index], dtype)

    def decoded_bases(self, which: str, dtype: Any) -> Any:
        """All the "key" or "value" bases (every chunk slot) decoded into ``dtype``, READ-ONLY:
        what attention reads. Native bases already in ``dtype`` are returned as they are; torch
        bases in another format or dtype are decoded once and cached until the stored bases or
        their scales change (another array, or an in-place write: torch's version counter).
        Other families decode on each call (their arrays have no version counter)."""
        stored = getattr(self, f"{which}_bases")
        scale = getattr(self, f"{which}_basis_scale")
        if scale is None and stored.dtype == dtype:
            return stored
        if array_family(stored) != "torch":
            return decode(stored, scale, dtype)
        return self.derived((which, dtype), (stored, scale), lambda: decode(stored, scale, dtype))

    def __deepcopy__(self, memo: dict) -> "PackedLayout":
        # derived values are caches keyed by the ids of the arrays they came from, which a copy's
        # arrays do not share: it starts without them (some, kernel addresses, cannot be copied)
        copied = {f.name: copy.deepcopy(getattr(self, f.name), memo) for f in fields(self) if f.name != "_derived"}
        return replace(self, _derived={}, **copied)

    def derived(self, key: Any, sources: tuple, build, writes: bool = True, views: tuple = ()) -> Any:
        """``build()``, computed once per ``key`` and reused while every torch tensor in
        ``sources`` (None entries allowed) is the same object and, when ``writes`` (a value
        derived from the data), has the same version counter (torch bumps it on every in-place
        write; views of the sources pass ``writes=False``), and every array in ``views`` (what
        the value points into, whose data it does not hold: the coefficient arrays a kernel
        call reads) is the same object: what attention reads on every call, kept across appends
        that leave its sources alone."""
        stamp = tuple([(id(x), x._version) for x in sources if x is not None]) if writes else tuple(map(id, sources))
        if views:
            stamp += tuple(map(id, views))
        hit = self._derived.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[2]
        out = build()
        self._derived[key] = (stamp, (sources, views), out)  # the arrays are held so that their ids stay theirs
        return out

    def store_basis(self, which: str, index: tuple, x: Any) -> Any:
        """Encode bases ``x`` into the "key" or "value" bases at ``index`` IN PLACE (only spare
        chunk slots or private copies may be written) and return them as :meth:`basis` will read
        them, in x's dtype: what an online state projects with (spec/storage.md S3)."""
        stored, scale = encode(x, self.basis_format, self.dtype)
        getattr(self, f"{which}_bases")[index] = stored
        if scale is not None:
            getattr(self, f"{which}_basis_scale")[index] = scale
        return decode(stored, scale, x.dtype)

    def with_private_bases(self) -> "PackedLayout":
        """A layout whose basis (and basis scale) arrays are copies: for rewriting bases that
        are in use (warm-up rows, a rotating refresh) without touching the original."""
        names = ("key_bases", "value_bases", "key_basis_scale", "value_basis_scale")
        return replace(self, _derived={}, **{name: clone(getattr(self, name)) for name in names if getattr(self, name) is not None})

    def live_arrays(self) -> dict[str, Any]:
        """The arrays in use cut to their live ranges (views): tokens < num_tokens, chunks < the
        largest num_chunks. What a copy, a saved file or a before/after comparison holds."""
        return {name: self.live(BY_NAME[name].axis, x) for name, x in self.arrays().items()}

    def live(self, axis: str, x: Any) -> Any:
        """``x``, an array of axis kind ``axis``, cut to its live range (a view)."""
        if axis == TOKEN:
            return x[:, :, : self.num_tokens]
        if axis == CHUNK:
            return x[:, :, : int(to_numpy(self.num_chunks).max())]
        if axis == GROUP:
            return x[:, :, : self.num_tokens // self.group]
        return x

    def converts(self, rule: str, name: str = "") -> bool:
        """Whether array ``name`` of dtype rule ``rule`` (:data:`DTYPE_RULES`) takes a new dtype on
        conversion: "coefficients" arrays ("key_coef", "value_coef") when their side is float."""
        if rule == "coefficients":
            return self.side_format(name.split("_")[0]).name == FLOAT
        if rule == "bases":
            return is_native(self.basis_format)
        return rule == "state"

    def arrays(self) -> dict[str, Any]:
        """The arrays in use (the scales only for quantized layouts)."""
        return {name: getattr(self, name) for name in self.ARRAYS if getattr(self, name) is not None}

    def with_capacity(self, tokens: int, chunks: int) -> "PackedLayout":
        """A layout holding the same data with room for ``tokens`` tokens and ``chunks`` chunks."""
        t_cap = self.key_coef.shape[2]
        j_cap = self.key_bases.shape[2]
        if tokens <= t_cap and chunks <= j_cap:  # a decode step's append, nearly always
            return replace(self)
        new_t = t_cap if tokens <= t_cap else _capacity(tokens, t_cap)
        new_j = j_cap if chunks <= j_cap else _capacity(chunks, j_cap)
        size = {TOKEN: new_t, CHUNK: new_j, GROUP: -(-new_t // self.group) if self.group else 0}
        return replace(self, **{name: grown(x, 2, size[BY_NAME[name].axis]) for name, x in self.arrays().items() if BY_NAME[name].axis in size})

    def map_arrays(self, fn) -> "PackedLayout":
        """A layout with ``fn`` applied to every array in use (conversion between families, devices, dtypes)."""
        return replace(self, _derived={}, **{name: fn(name, x) for name, x in self.arrays().items()})


@dataclass
class SketchBuffers:
    """FD buffers (spec A4) of every head: keys (N, H, 2 ell_k, d), values (N, H, 2 ell_v, d_v).

    All heads see the same number of rows, so one fill count serves them all.
    """

    keys: Any
    values: Any
    filled_k: int
    filled_v: int
    rows_seen: int
    # spec/sketch_variants.md: ring buffers (N, H, W, d) / (N, H, W, d_v) of the last W sketch
    # rows when ring_warm_start = W > 0 (S1), and two diagnostic counters (S2.3): rows each
    # head's key sketch received, and SVDs run (compactions and snapshots, summed over sequences,
    # heads, keys and values). The counters are not saved.
    ring_keys: Any = None
    ring_values: Any = None
    rows_inserted: int = 0
    svds: int = 0
    # spec A7.4.1: (token, head) pairs an adaptive state stored with a residual above tau (saved)
    tokens_over_tau: int = 0


# ----------------------------------------------------------------- a state's arrays, enumerated
PARTS = ("layout", "sketches", "window")


def held_arrays(state, among: tuple = STATE_ARRAYS) -> dict[str, Any]:
    """Every array ``state`` holds (whole, spare capacity included), by :data:`STATE_ARRAYS` name;
    only those of ``among`` when given."""
    out = {}
    for a in among:
        part = getattr(state, a.part)
        x = None if part is None else getattr(part, a.attr)
        if x is not None:
            out[a.name] = x
    return out


#: The arrays of :data:`STATE_ARRAYS` whose shape does not grow with tokens or chunks.
FIXED_ARRAYS = tuple(a for a in STATE_ARRAYS if a.axis == FIXED)


def live_arrays(state) -> dict[str, Any]:
    """Every array ``state`` holds cut to its live range (views): what a copy or a file keeps."""
    return {name: state.layout.live(BY_NAME[name].axis, x) for name, x in held_arrays(state).items()}


def mapped_parts(state, fn) -> dict[str, Any]:
    """The state's parts ("layout", "sketches", "window") with every array x replaced by
    ``fn(StateArray, x)``; parts that are None stay None. Scalars (counts, fills) are kept."""
    new: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
    for name, x in held_arrays(state).items():
        a = BY_NAME[name]
        new[a.part][a.attr] = fn(a, x)
    fresh = {"layout": {"_derived": {}}}  # arrays derived from the old ones are not the new ones
    return {part: None if getattr(state, part) is None else replace(getattr(state, part), **new[part], **fresh.get(part, {})) for part in PARTS}


def counted_nbytes(state, names=None) -> int:
    """Bytes of the live part of every array ``nbytes`` counts (:attr:`StateArray.counted`),
    restricted to ``names`` when given. A CHUNK array counts num_chunks[n, h] chunks of each
    (sequence, head), a TOKEN array num_tokens rows, a FIXED array all of it."""
    lay = state.layout
    chunks = None
    total = 0
    for name, x in held_arrays(state).items():
        a = BY_NAME[name]
        if (names is not None and name not in names) or a.counted == "never" or (a.counted == "adaptive" and state.kind != "adaptive"):
            continue
        if a.axis == FIXED:
            total += numel(x) * itemsize(x)
            continue
        rows = x.shape[2]
        per_row = numel(x) // (x.shape[0] * x.shape[1] * rows) * itemsize(x) if rows else 0
        if a.axis == TOKEN:
            total += x.shape[0] * x.shape[1] * lay.num_tokens * per_row
        elif a.axis == GROUP:
            total += x.shape[0] * x.shape[1] * (lay.num_tokens // lay.group) * per_row
        else:
            chunks = int(to_numpy(lay.num_chunks).sum()) if chunks is None else chunks
            total += chunks * per_row
    return total


def growth_rates(state) -> tuple[int, float]:
    """(bytes one more chunk adds, bytes one more token adds) to :func:`counted_nbytes` for one
    (sequence, head), by the same rules: CHUNK arrays per chunk, TOKEN arrays per token, GROUP
    arrays per token amortised over the group. The FIXED arrays (sketches, gamma, windows) do not
    grow. What the byte ceiling of spec A7.3 charges a chunk and a token."""
    per_chunk, per_token = 0, 0.0
    for name, x in held_arrays(state).items():
        a = BY_NAME[name]
        if a.axis == FIXED or a.counted == "never" or (a.counted == "adaptive" and state.kind != "adaptive"):
            continue
        per_row = math.prod(x.shape[3:]) * itemsize(x)  # (N, H, rows, ...): one row's bytes, even at capacity 0
        if a.axis == CHUNK:
            per_chunk += per_row
        elif a.axis == TOKEN:
            per_token += per_row
        else:
            per_token += per_row / state.layout.group
    return per_chunk, per_token


def allocated_nbytes(state) -> int:
    """Bytes of every array ``state`` holds, spare capacity included."""
    return sum(numel(x) * itemsize(x) for x in held_arrays(state).values())
