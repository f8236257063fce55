"""The byte-budget allocator (subspace_ref/allocation.py): hull greedy against brute force,
bytes as budget.py counts them, serialisation, and a run on the shipped model's calibration data."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from subspace_ref.allocation import Allocation, Candidate, HeadAllocation, allocate, greedy, lower_hull, side_losses, side_parts
from subspace_ref.baselines.budget import Geometry
from subspace_ref.baselines.combined import Subspace


def test_lower_hull_drops_dominated_and_concave_points():
    c = [Candidate(0, 10, "a"), Candidate(1, 4, "b"), Candidate(2, 3.9, "c"), Candidate(3, 1, "d"), Candidate(4, 2, "e")]
    assert [x.config for x in lower_hull(c)] == ["a", "b", "d"]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("unit_cost", [True, False])
def test_greedy_matches_brute_force_on_convex_tables(seed, unit_cost):
    """Convex decreasing loss curves (known optimum): with equal step costs the greedy hull walk
    equals exhaustive search at every budget; with unequal costs it is never worse than the
    optimum of the budget less one step (its prefix before a skipped step is a Lagrangian optimum)."""
    rng = np.random.default_rng(seed)
    tables, costs = {}, []
    for key in range(3):
        decay = rng.uniform(0.2, 0.9)
        cost = 1 if unit_cost else int(rng.integers(1, 4))
        costs.append(cost)
        tables[key] = [Candidate(float(cost * r), float(10 * decay**r), r) for r in range(6)]

    def best(budget):
        return min(sum(tables[k][r].loss for k, r in enumerate(rs)) for rs in itertools.product(range(6), repeat=3)
                   if sum(tables[k][r].bytes for k, r in enumerate(rs)) <= budget)

    for budget in range(0, 20):
        _, spent, loss = greedy(tables, budget)
        assert spent <= budget + 1e-9 and loss >= best(budget) - 1e-12
        if unit_cost:
            assert loss == pytest.approx(best(budget))
        else:
            assert loss <= best(max(0, budget - max(costs) + 1)) + 1e-12


def test_two_heads_known_optimum():
    """Head 0's loss falls 10x faster per byte than head 1's: every byte goes to head 0 first."""
    geom = Geometry(1, 2, 8, 8, 64)
    losses = [[{("key", "post_rope"): {(r, 16): 100.0 * 0.1**r for r in range(9)}, ("value", None): {(r, 16): 1.0 * 0.5**r for r in range(9)}},
               {("key", "post_rope"): {(r, 16): 1.0 * 0.5**r for r in range(9)}, ("value", None): {(r, 16): 1.0 * 0.5**r for r in range(9)}}]]
    a = allocate(losses, geom, bytes_per_token=a_bytes(geom, [(3, 0), (1, 0)]))
    assert [(h.rank_k, h.rank_v) for h in a.heads[0]] == [(3, 0), (1, 0)]


def a_bytes(geom, ranks):
    h = [HeadAllocation(rk, rv) for rk, rv in ranks]
    return Allocation((tuple(h),), 32).bytes(geom).per_token


def test_bytes_are_budget_py_bytes():
    """fp16 and int8 coefficients at uniform ranks cost what budget.py's Subspace rows cost."""
    geom = Geometry(4, 2, 64, 64, 1024)
    for coefficients, bits in (("fp16", 16), ("int8", 8)):
        a = Allocation(tuple(tuple(HeadAllocation(20, 12, bits, bits) for _ in range(2)) for _ in range(4)), 32)
        assert a.bytes(geom).per_token == pytest.approx(Subspace(20, 12, coefficients).bytes(geom).per_token)
    # int4 keys: codes of complete groups, fp16 scale + zero per group and channel, the tail in fp16
    geom = Geometry(1, 1, 64, 64, 100)
    parts = side_parts(geom, "key", 10, 4, 32)
    assert parts["key_codes"] == pytest.approx(5 * 96 / 100) and parts["key_scales"] == pytest.approx(4 * 10 * 3 / 100)
    assert parts["key_tail"] == pytest.approx(10 * 2 * 4 / 100)


def test_round_trip_and_bad_values():
    a = Allocation(((HeadAllocation(3, 2, 4, 2, "pre_rope"), HeadAllocation(1, 0)),), 16, 123.0, 8, 4, 0.5)
    assert Allocation.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    with pytest.raises(ValueError, match="bits_k"):
        HeadAllocation(1, 1, bits_k=3)
    with pytest.raises(ValueError, match="key_basis"):
        HeadAllocation(1, 1, key_basis="plane")
    with pytest.raises(ValueError, match="exactly one"):
        allocate([], Geometry(1, 1, 8, 8, 8))


def test_measured_losses_fall_with_rank_and_bits():
    """side_losses on synthetic low-rank data: the loss falls with rank and bits, and reaches 0
    at full rank in fp16 (the reconstruction is exact)."""
    rng = np.random.default_rng(0)
    N, d = 256, 8
    K = rng.standard_normal((N, 3)) @ rng.standard_normal((3, d)) + 0.01 * rng.standard_normal((N, d))
    V = rng.standard_normal((N, d))
    layer = dict(keys=K, values=V, keys_pre=None, positions=np.arange(N),
                 Wk=np.linalg.svd(K, full_matrices=False)[2], Wv=np.linalg.svd(V, full_matrices=False)[2])
    out = side_losses(layer, 0, rng.standard_normal((64, d)), range(d + 1), group=32)
    key = out[("key", "post_rope")]
    assert key[(d, 16)] == pytest.approx(0, abs=1e-20) and key[(3, 16)] < 0.01 * key[(2, 16)]
    assert key[(3, 2)] > key[(3, 4)] > key[(3, 8)] > key[(3, 16)]


@pytest.mark.slow
def test_allocation_on_the_shipped_model():
    """The allocator on the shipped model's calibration data: the allocation fits its budget and
    beats the uniform configuration at the same bytes on the measured calibration loss."""
    from subspace_ref.experiments.baselines import calibration_losses, frontier_allocations
    from subspace_ref.experiments import _common as C

    model = C.load_model("stdlib_llama")
    ids = C.windows("train", 2, 256, 1)
    data = calibration_losses(model, ids, ranks=range(0, 65, 8))
    geom = Geometry.of_model(model, 256)
    a = allocate(data["losses"], geom, compression_ratio=0.25)
    assert a.bytes(geom).fraction <= 0.25 + 1e-9
    assert frontier_allocations  # the experiment uses the same function
