"""The merge launch's shapes (spec A3.2; issue 38, the merge at N = 1): ``decode.merge_launch``'s
``columns`` spreads a row's d_v columns over programs and ``block_s`` sets the splits per step of
each program's loop. Every shape merges the same partials by the same formula; only the order of
the float32 sums over splits may change, so each agrees with the default launch within the
rounding bound of those sums (``_merge_bound``), and with the float64 merge."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.test_triton_fused_merge import _merge_bound  # noqa: E402
from tests.test_triton_kernels import (  # noqa: E402
    DEVICE,
    _interpreter_environment,  # noqa: F401 - the autouse fixture, for this module's tests too
    pytestmark,  # noqa: F401 - skipped where the Triton backend is unavailable
)

from subspace_ref_triton import decode  # noqa: E402
from subspace_ref_triton._common import pow2_at_least  # noqa: E402


def _partials(gen, N, Hq, S, d_v):
    """Random partials (m, Z, N) with empty ones (-inf, 0, 0): a row's first splits, and one row
    empty but for its last split."""
    m = torch.randn(N, Hq, S, generator=gen) * 4
    z = torch.rand(N, Hq, S, generator=gen) * 20 + 1
    o = torch.randn(N, Hq, S, d_v, generator=gen) * z[..., None]
    m[0, 0, : S // 3], z[0, 0, : S // 3], o[0, 0, : S // 3] = float("-inf"), 0.0, 0.0
    m[-1, -1, :-1], z[-1, -1, :-1], o[-1, -1, :-1] = float("-inf"), 0.0, 0.0
    return m.to(DEVICE), z.to(DEVICE), o.to(DEVICE)


# (S, d_v): one split; splits within one tile of 128; more than one; a d_v that is no power of two
SHAPES = [(1, 32), (19, 40), (128, 128), (300, 64)]
LAUNCHES = [(32, None), (16, 128), (0, 128), (64, 4), (8, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("S,d_v", SHAPES, ids=[f"S{s}-dv{d}" for s, d in SHAPES])
@pytest.mark.parametrize("columns,block_s", LAUNCHES, ids=[f"cols{c}-s{b}" for c, b in LAUNCHES])
def test_merge_shapes_agree_with_the_default_launch(columns, block_s, S, d_v, dtype):
    gen = torch.Generator().manual_seed(S * 1000 + d_v)
    partials = _partials(gen, 2, 3, S, d_v)
    default, want = decode.merge_launch(*partials, dtype)
    default.run()
    launch, got = decode.merge_launch(*partials, dtype, columns=columns, block_s=block_s)
    DV = pow2_at_least(d_v) if columns == 0 else min(columns, pow2_at_least(d_v))
    assert launch.constexprs["DV"] == DV and launch.grid == (6, -(-d_v // DV))
    assert launch.constexprs["BLOCK_S"] == min(block_s or max(1, decode.MERGE_TILE // DV), pow2_at_least(S, 1))
    launch.run()
    assert got.dtype == dtype and got.shape == want.shape and torch.isfinite(got).all()
    # n of _merge_bound from the splits a step of both merges compared
    bound = _merge_bound(partials, dtype, tiles=(default.constexprs["BLOCK_S"], launch.constexprs["BLOCK_S"]))
    diff = (got.double() - want.double()).abs().cpu().numpy()
    assert (diff <= bound).all(), (diff.max(), (diff / np.maximum(bound, 1e-300)).max())
    exact = decode.merge_partials_reference(*(x.double() for x in partials), torch.float64).cpu().numpy()
    assert (np.abs(got.double().cpu().numpy() - exact) <= bound).all()


def test_the_default_launch_is_the_timed_shape():
    """merge_launch's defaults are the shape timed fastest at N = 1 (docs/gpu.md, "The merge at
    N = 1"): at d_v = 128 four programs of 32 columns a row, all of 99 splits in one step of 128."""
    m = torch.zeros(1, 32, 99, device=DEVICE)
    launch, _ = decode.merge_launch(m, m, torch.zeros(1, 32, 99, 128, device=DEVICE), torch.bfloat16)
    assert (decode.MERGE_COLUMNS, decode.MERGE_TILE) == (32, 4096)
    assert launch.grid == (32, 4) and launch.constexprs["DV"] == 32 and launch.constexprs["BLOCK_S"] == 128


def test_columns_cover_every_column_once():
    """Column blocks that do not divide d_v (72 = 4 x 16 + 8) write every column once: an output
    poisoned with NaN is filled in full, within the bound of the float64 merge."""
    gen = torch.Generator().manual_seed(1)
    partials = _partials(gen, 1, 2, 40, 72)
    out = torch.full((1, 2, 72), float("nan"), device=DEVICE)
    launch, got = decode.merge_launch(*partials, torch.float32, out=out, columns=16)
    assert got is out and launch.grid == (2, 5)
    launch.run()
    exact = decode.merge_partials_reference(*(x.double() for x in partials), torch.float64).cpu().numpy()
    assert (np.abs(out.double().cpu().numpy() - exact) <= _merge_bound(partials, torch.float32, tiles=(launch.constexprs["BLOCK_S"],))).all()


@pytest.mark.parametrize("name,value", [("columns", 3), ("columns", -16), ("columns", True), ("columns", 16.0),
                                        ("block_s", 0), ("block_s", 24), ("block_s", False), ("block_s", "16")])
def test_merge_launch_names_a_bad_shape(name, value):
    m = torch.zeros(1, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match=f"merge_launch: {name}"):
        decode.merge_launch(m, m, torch.zeros(1, 2, 4, 8, device=DEVICE), torch.float32, **{name: value})


def test_merge_launch_takes_integer_types():
    """numpy integers are integers (operator.index), as torch's own arguments take them."""
    m = torch.zeros(1, 2, 4, device=DEVICE)
    launch, _ = decode.merge_launch(m, m, torch.zeros(1, 2, 4, 64, device=DEVICE), torch.float32, columns=np.int64(16), block_s=np.int32(2))
    assert launch.constexprs["DV"] == 16 and launch.constexprs["BLOCK_S"] == 2
