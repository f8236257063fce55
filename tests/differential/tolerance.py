"""The ONE tolerance rule of the differential harness.

For a case and a dtype, the reference error is the float64 oracle's distance to the oracle run
*in that dtype*:

* inputs (q, coefficients, bases, gamma; int8 coefficients and their float32 scales, int4/int2
  codes and their float16 scales and zero points stay as they are, as ``state.to`` keeps them) rounded to the dtype (float16 and bfloat16 through
  float32, as torch converts float64 to them), then the oracle run in float32 for the half types
  and in the dtype itself otherwise, and its output rounded to the dtype;
* for float64 the rounded oracle *is* the float64 oracle, so its own error is measured against
  the same oracle run in extended precision (``np.longdouble``, 64-bit mantissa on x86-64
  Linux; where longdouble is no wider than float64 this sample is 0);
* that one run is one sample of an error whose size fluctuates: with large logits the output
  error is dominated by the rounding of the few logits near the maximum, and two equally
  accurate implementations differ by 2-3x from one draw to the next. So the reference error is
  the largest of 1 + SAMPLES runs: the plain rounding above and SAMPLES runs whose inputs are
  moved by 0 or +-1 ulp of the dtype at random (other, equally valid roundings of the same
  float64 inputs; computed in the dtype as above, against the float64 oracle).

A backend passes when

    max |backend - oracle64|  <=  FACTOR * reference error
                                  + FLOOR_ULPS * eps(dtype) * max |oracle64|.

FACTOR = 2 (flash-attention's rule): a backend is allowed twice the error that the reference
algorithm itself makes in the backend's precision. A backend as accurate as the oracle lands at
a ratio near 1 of the reference error; a factor of 2 leaves room for a different summation
order without letting through a real error (a wrong chunk, a wrong head, a missing rescale),
which shows up as O(1) relative error. The floor covers cases where the reference error is ~0
(T = 1, one dominant token): a few units in the last place of the largest output, the rounding
of the output itself.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from subspace_ref.layout import BY_NAME, held_arrays
from subspace_ref.numpy_backend import attend_reference

FACTOR = 2.0
FLOOR_ULPS = 4.0
SAMPLES = 6

EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (round to nearest even), returned as float64."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x.copy()
    x32 = x.astype(np.float32)
    if dtype == "float32":
        return x32.astype(np.float64)
    if dtype == "float16":
        return x32.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        bits = x32.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    raise ValueError(f"unknown dtype {dtype!r}")


# float32 by spec A10, float16 by spec/quantization.md Q2 (int4/int2 scales and zero points), in
# every state whatever its dtype (state.to keeps them): never rounded or moved
SCALES = ("key_scale", "value_scale", "key_group_scale", "key_group_zero", "value_token_scale", "value_token_zero")


def _cast_state(state, fn):
    """A copy of a NumPy state with ``fn`` applied to its floating layout and exact-token arrays (the int8
    coefficients and their float32 scales of spec A10 are kept as they are, as ``state.to``
    keeps them)."""
    out = state.copy()
    out.layout = out.layout.map_arrays(lambda name, x: fn(x) if x.dtype.kind == "f" and name not in SCALES else x)
    if out.window is not None:  # the exact tokens (spec/window.md), which state.to casts too
        exact = {BY_NAME[name].attr: fn(x) for name, x in held_arrays(out).items() if BY_NAME[name].part == "window"}
        out.window = replace(out.window, **exact)
    return out


def ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype`` at each (dtype-representable) entry of ``x``, as float64."""
    if dtype == "float64":
        return np.abs(np.spacing(x))
    if dtype in ("float32", "bfloat16"):
        spacing = np.abs(np.spacing(x.astype(np.float32))).astype(np.float64)
        return spacing * (2.0**16 if dtype == "bfloat16" else 1.0)  # bfloat16: 7 fraction bits, not 23
    return np.abs(np.spacing(x.astype(np.float16))).astype(np.float64)


def perturbed(x: np.ndarray, dtype: str, rng) -> np.ndarray:
    """``x`` rounded to ``dtype``, then each entry moved by 0 or +-1 ulp at random."""
    x = round_to(x, dtype)
    return round_to(x + rng.integers(-1, 2, size=x.shape) * ulp(x, dtype), dtype)


def oracle_in_dtype(state64, q64: np.ndarray, scale, dtype: str, rng=None) -> np.ndarray:
    """The oracle run in ``dtype`` (module docstring), as float64 values. With ``rng``, on inputs
    perturbed by one ulp at random; without, for float64, in extended precision."""
    if rng is not None:
        move = lambda x: perturbed(x, dtype, rng)  # noqa: E731
    else:
        move = lambda x: round_to(x, dtype)  # noqa: E731
    if dtype == "float64":
        work = np.float64 if rng is not None else np.longdouble
        out = attend_reference(move(q64).astype(work), _cast_state(state64, lambda x: move(x).astype(work)), scale)
        return out.astype(np.float64)
    work = np.float32
    state = _cast_state(state64, lambda x: move(x).astype(work))
    out = attend_reference(move(q64).astype(work), state, scale)
    return round_to(out, dtype)


def reference_error(state64, q64, scale, out64: np.ndarray, dtype: str, seed: int = 0) -> float:
    """The largest of 1 + SAMPLES errors |oracle_in_dtype - oracle64| (module docstring)."""
    rng = np.random.default_rng(seed)
    errors = [np.abs(oracle_in_dtype(state64, q64, scale, dtype) - out64).max()]
    errors += [np.abs(oracle_in_dtype(state64, q64, scale, dtype, rng) - out64).max() for _ in range(SAMPLES)]
    return float(max(errors))


def tolerance(ref_error: float, out64: np.ndarray, dtype: str) -> float:
    """FACTOR * reference error + FLOOR_ULPS ulps of the largest output."""
    return FACTOR * ref_error + FLOOR_ULPS * EPS[dtype] * float(np.abs(out64).max())
