"""The roofline cost model (spec R1-R12) against hand-counted cases and its monotonicity and
break-even properties."""

import math

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.roofline import (
    Cost,
    Machine,
    Shape,
    Subspace,
    break_even,
    exact_cost,
    measure_cpu,
    speedup,
    state_cost,
    subspace_cost,
    svd_flops,
)

MEMORY_ONLY = Machine("memory roof only", bandwidth=1e9, flops=math.inf)
COMPUTE_ONLY = Machine("compute roof only", bandwidth=math.inf, flops=1e9)
H100ISH = Machine("h100-like", bandwidth=3.35e12, flops=989e12)


def terms(cost: Cost) -> dict[str, tuple[float, float]]:
    return {t.name: (float(t.flops), float(t.bytes)) for t in cost.terms}


# ----------------------------------------------------------------------------- hand counts
def test_subspace_hand_count_T4_d2_r1_J2():
    # T = 4 tokens, d = d_v = 2, r = r_v = 1, J = 2 chunks, g = 1 query head, e = 4 bytes (fp32).
    # R3.2 query projection: 2 chunks x (1x2 matrix times 2-vector = 2*1*2 = 4 FLOPs) = 8;
    #      R4.2 reads both key bases: 2 x 1 x 2 elements x 4 B = 16 B.
    # R3.3 logits: 4 tokens x (dot of length 1 = 2 FLOPs) = 8; R4.1 reads C: 4 x 1 x 4 B = 16 B.
    # R3.4 softmax: 5 x 4 = 20.
    # R3.5 aggregation w^T D: 4 x 2 = 8; reads D: 16 B.
    # R3.6 reconstruction (w^T D_j) E_j: 2 chunks x (1 x 2 -> 2*1*2 = 4) = 8; reads E_1, E_2: 16 B.
    # R3.7 merge: one chunk after the first: (2 + 3) = 5, plus N/Z: 2 -> 7.
    # R4.4 q in (2 x 4 B) and o out (2 x 4 B): 16 B.
    # R5.2 append: project k, v: 2*(1*2) + 2*(1*2) = 8 FLOPs; read k_t, v_t (16 B), the open
    #      chunk's bases (2 + 2 elements, 16 B), write c_t, d_t (8 B): 40 B.
    cost = subspace_cost(4, Shape(d=2, d_v=2, group=1, elem_bytes=4), Subspace(r=1, r_v=1, chunks=2))
    assert terms(cost) == {
        "query_proj": (8, 16),
        "logits": (8, 16),
        "softmax": (20, 0),
        "aggregate": (8, 16),
        "reconstruct": (8, 16),
        "merge": (7, 0),
        "query_io": (0, 16),
        "append": (8, 40),
    }
    assert cost.phase("attend").flops == 59 and cost.phase("attend").bytes == 80
    assert cost.flops == 67 and cost.bytes == 120


def test_exact_hand_count_T4_d2():
    # R2.1 logits 4 x 2*2 = 16 FLOPs, K read 4 x 2 x 4 B = 32 B; R2.2 softmax 20; R2.3 aggregate
    # 16 FLOPs, V read 32 B; R2.4 N/Z 2; R2.6 q + o 16 B; R5.1 append reads k, v and writes them: 32 B.
    cost = exact_cost(4, Shape(d=2, elem_bytes=4))
    assert terms(cost) == {
        "logits": (16, 32),
        "softmax": (20, 0),
        "aggregate": (16, 32),
        "normalise": (2, 0),
        "query_io": (0, 16),
        "append": (0, 32),
    }


def test_grouped_query_multiplies_flops_not_cache_bytes():
    # g = 3 query heads share one KV head: every FLOP of attend x3, cache reads x1, q/o bytes x3.
    one = subspace_cost(4, Shape(2, 2, 1, 4), Subspace(1, 1, chunks=2))
    three = subspace_cost(4, Shape(2, 2, 3, 4), Subspace(1, 1, chunks=2))
    for name in ("query_proj", "logits", "softmax", "aggregate", "reconstruct", "merge"):
        assert three.term(name).flops == 3 * one.term(name).flops
    for name in ("logits", "aggregate", "query_proj", "reconstruct"):
        assert three.term(name).bytes == one.term(name).bytes
    assert three.term("query_io").bytes == 3 * one.term("query_io").bytes
    ex1, ex3 = exact_cost(4, Shape(2, 2, 1, 4)), exact_cost(4, Shape(2, 2, 3, 4))
    assert ex3.term("logits").flops == 48 and ex3.term("logits").bytes == ex1.term("logits").bytes == 32


def test_int8_hand_count():
    # R4.3: each token stores r int8 + one fp32 scale for keys, r_v + 4 for values.
    # T = 4, r = r_v = 1: C read 4 x (1 + 4) = 20 B, D read 20 B; append writes 1+4+1+4 = 10 B and
    # quantises 2 coefficients at 2 FLOPs each (R5.2).
    cost = subspace_cost(4, Shape(2, 2, 1, 4), Subspace(1, 1, chunks=2, coef="int8"))
    assert cost.term("logits").bytes == 20 and cost.term("aggregate").bytes == 20
    assert cost.term("append").bytes == 16 + 16 + 10
    assert cost.term("append").flops == 8 + 4
    # bases stay in floating point (R4.3)
    assert cost.term("query_proj").bytes == 16 and cost.term("reconstruct").bytes == 16


def test_svd_convention():
    # R8: 6 q p^2 + 20 p^3; the 4 x 2 example of the spec, and symmetry in (m, n).
    assert svd_flops(4, 2) == 6 * 4 * 4 + 20 * 8 == 256
    assert svd_flops(2, 4) == 256
    assert svd_flops(128, 128) == 6 * 128**3 + 20 * 128**3


def test_adaptive_hand_count_T4_d2_r1_ell2_J2():
    # ell_k = ell_v = 2, d = d_v = 2, e = 4, T = 4, J = 2.
    # R6 residual norms: 2 (d + r + d_v + r_v) = 2 (2 + 1 + 2 + 1) = 12 FLOPs.
    # R7.1 rows into the buffers: (2 + 2) x 4 B = 16 B.
    # R7.2 one compaction of a 4 x 2 buffer: SVD 256 + shrink 3 p (p = 2) = 6 + rebuild p d = 4
    #      -> 266 FLOPs; buffer read + written: 2 x (4 x 2) x 4 B = 64 B. R7.3: per token / (ell + 1)
    #      = / 3, for both sketches: 532/3 FLOPs, 128/3 B.
    # R9.1 a snapshot: two 4 x 2 SVDs = 512 FLOPs; reads both buffers (8 + 8 elements) and writes
    #      the bases (2 + 2): 20 x 4 = 80 B. R9.2: (J - 1)/T = 1/4 -> 128 FLOPs, 20 B.
    sub = Subspace(1, 1, chunks=2, ell_k=2, ell_v=2)
    cost = subspace_cost(4, Shape(2, 2, 1, 4), sub)
    t = terms(cost)
    assert t["residual"] == (12, 0)
    assert t["fd_row"] == (0, 16)
    assert t["fd_compact"] == pytest.approx((532 / 3, 128 / 3))
    assert t["snapshot"] == (128, 20)
    assert cost.phase("fd").flops == pytest.approx(532 / 3 + 128)
    assert cost.phase("append").flops == 8 + 12
    # a static state has none of these terms (R9.2)
    assert not {"residual", "fd_row", "fd_compact", "snapshot"} & set(subspace_cost(4, Shape(2, 2, 1, 4), Subspace(1, 1, chunks=2)).names())


def test_rotating_terms():
    # R9.3, m = 2: rotation of T = 4 rows by 1x1 changes of basis: (2*4*(1 + 1) + 2*(1*2 + 1*2)) / 2
    # = (16 + 8)/2 = 12 FLOPs; coefficients read + written: 2 x 4 x (4 + 4) / 2 = 32 B.
    sub = Subspace(1, 1, chunks=1, ell_k=2, ell_v=2, refresh_every=2)
    cost = subspace_cost(4, Shape(2, 2, 1, 4), sub)
    assert terms(cost)["rotate"] == (12, 32)
    assert terms(cost)["snapshot"] == (512 / 2, 80 / 2)
    assert "residual" not in cost.names()


def test_chunks_from_max_chunk():
    sub = Subspace.adaptive(4, max_chunk=256)
    assert sub.num_chunks(1) == 1 and sub.num_chunks(256) == 1 and sub.num_chunks(257) == 2
    assert list(sub.num_chunks(np.array([1, 512, 513]))) == [1, 2, 3]
    assert Subspace.static(4).num_chunks(10**6) == 1


# ----------------------------------------------------------------------------- roofline time
def test_time_is_max_of_the_two_roofs():
    cost = subspace_cost(4, Shape(2, 2, 1, 4), Subspace(1, 1, chunks=2))  # 67 FLOPs, 120 B
    m = Machine("m", bandwidth=120.0, flops=67.0 / 2)  # 1 s of bytes, 2 s of FLOPs
    assert cost.time(m) == pytest.approx(2.0) and cost.bound(m) == "compute"
    m = Machine("m", bandwidth=120.0 / 3, flops=67.0)
    assert cost.time(m) == pytest.approx(3.0) and cost.bound(m) == "memory"
    assert cost.time(MEMORY_ONLY) == pytest.approx(120e-9)
    assert cost.time(COMPUTE_ONLY) == pytest.approx(67e-9)


def test_vectorised_matches_scalar():
    shape, sub = Shape(128, elem_bytes=2), Subspace.adaptive(16, max_chunk=64)
    Ts = np.array([1, 63, 64, 65, 1000, 4096])
    vec = subspace_cost(Ts, shape, sub)
    for i, T in enumerate(Ts):
        one = subspace_cost(int(T), shape, sub)
        assert vec.flops[i] == pytest.approx(one.flops) and vec.bytes[i] == pytest.approx(one.bytes)
    assert np.allclose(exact_cost(Ts, shape).bytes, [exact_cost(int(T), shape).bytes for T in Ts])


# ----------------------------------------------------------------------------- properties
@pytest.mark.parametrize("sub", [Subspace.static(16), Subspace.static(16, coef="int8"), Subspace.adaptive(16, max_chunk=128),
                                 Subspace(16, 8, chunks=5, ell_k=32, ell_v=16)])
def test_attend_cost_monotone_in_context(sub):
    shape = Shape(128, 64, group=2, elem_bytes=2)
    T = np.arange(1, 5000)
    for cost in (subspace_cost(T, shape, sub).phase("attend", "append"), exact_cost(T, shape)):
        assert np.all(np.diff(cost.flops) >= 0) and np.all(np.diff(cost.bytes) >= 0)
        assert np.all(np.diff(cost.time(H100ISH)) >= 0)


def test_cost_monotone_in_rank_and_chunks():
    shape = Shape(128, elem_bytes=2)
    costs = [subspace_cost(4096, shape, Subspace(r, r, chunks=4, ell_k=2 * r, ell_v=2 * r)).phase("attend", "append")
             for r in (4, 8, 16, 32, 64)]
    assert all(a.flops < b.flops and a.bytes < b.bytes for a, b in zip(costs, costs[1:]))
    # FD upkeep grows with ell while 2 ell <= d (R7.3: ~24 d ell per token) ...
    fd = [subspace_cost(4096, shape, Subspace(r, r, chunks=4, ell_k=2 * r, ell_v=2 * r)).phase("fd").flops for r in (4, 8, 16, 32)]
    assert all(a < b for a, b in zip(fd, fd[1:]))
    # ... but not beyond: with 2 ell > d the SVD is capped at d columns and amortised over ell + 1 rows
    assert subspace_cost(4096, shape, Subspace(64, 64, chunks=4, ell_k=128, ell_v=128)).phase("fd").flops < fd[-1]
    by_j = [subspace_cost(4096, shape, Subspace(16, 16, chunks=j)) for j in (1, 2, 8, 64)]
    assert all(a.flops < b.flops and a.bytes < b.bytes for a, b in zip(by_j, by_j[1:]))


def test_asymptotic_byte_ratio():
    # T -> infinity, static, float: bytes ratio -> (d + d_v) / (r + r_v)  (seed 001 §4)
    shape = Shape(128, elem_bytes=2)
    T = 10**9
    ratio = exact_cost(T, shape).phase("attend").bytes / subspace_cost(T, shape, Subspace.static(16)).phase("attend").bytes
    assert ratio == pytest.approx(256 / 32, rel=1e-5)
    assert speedup(T, shape, Subspace.static(16), MEMORY_ONLY, phases=("attend",)) == pytest.approx(8, rel=1e-5)


@pytest.mark.parametrize("d,r,g", [(128, 32, 1), (128, 16, 4), (64, 8, 1), (96, 40, 2)])
def test_break_even_memory_roof_closed_form(d, r, g):
    # R11.2: static, attend only, memory roof: wins iff T > (r d + r_v d_v) / (d + d_v - r - r_v).
    shape, sub = Shape(d, group=g, elem_bytes=2), Subspace.static(r)
    threshold = (2 * r * d) / (2 * d - 2 * r)
    expected = math.floor(threshold) + 1
    assert break_even(shape, sub, MEMORY_ONLY, phases=("attend",), t_max=1 << 14) == expected
    if (d, r) == (128, 32):
        assert expected == 43  # the worked case of R11.2


def test_break_even_is_a_crossing():
    shape, sub = Shape(128, elem_bytes=2), Subspace.adaptive(32, max_chunk=256)
    T_star = break_even(shape, sub, H100ISH, t_max=1 << 16)
    assert T_star is not None and T_star > 1
    T = np.arange(1, 1 << 16)
    ex = exact_cost(T, shape).time(H100ISH)
    su = subspace_cost(T, shape, sub).time(H100ISH)
    assert not su[T_star - 2] < ex[T_star - 2]  # loses (or ties) just before
    assert np.all(su[T_star - 1 :] < ex[T_star - 1 :])  # wins from T* on


def test_break_even_none_when_ranks_too_large():
    shape = Shape(64, elem_bytes=2)
    assert break_even(shape, Subspace.static(64), MEMORY_ONLY, t_max=4096) is None
    assert break_even(shape, Subspace.static(64), H100ISH, t_max=4096) is None


def test_break_even_order():
    # more rank, or more chunks, never breaks even earlier; int8 coefficients never later
    shape = Shape(128, elem_bytes=2)
    be = lambda sub: break_even(shape, sub, H100ISH, t_max=1 << 15)  # noqa: E731
    assert be(Subspace.static(8)) <= be(Subspace.static(16)) <= be(Subspace.static(32))
    assert be(Subspace.static(16, coef="int8")) <= be(Subspace.static(16))
    assert be(Subspace.adaptive(16, max_chunk=512)) <= be(Subspace.adaptive(16, max_chunk=128))


# ----------------------------------------------------------------------------- states
def _orthonormal(rng, H, r, d):
    return np.stack([np.linalg.qr(rng.standard_normal((d, r)))[0].T for _ in range(H)])


def test_state_cost_matches_model():
    rng = np.random.default_rng(0)
    H, d, r, T = 3, 8, 2, 20
    basis = sr.StaticBasis.from_bases(_orthonormal(rng, H, r, d), _orthonormal(rng, H, r, d))
    state = sr.SubspaceState.static(basis, dtype=np.float32)
    state.append(rng.standard_normal((H, T, d)).astype(np.float32), rng.standard_normal((H, T, d)).astype(np.float32))
    got = state_cost(state, group=2)
    want = subspace_cost(T, Shape(d, d, 2, 4.0), Subspace.static(r)).scaled(H)
    assert got.flops == pytest.approx(want.flops) and got.bytes == pytest.approx(want.bytes)


def test_state_cost_adaptive_uses_each_heads_chunks():
    rng = np.random.default_rng(1)
    H, d = 2, 6
    state = sr.SubspaceState.adaptive(H, d, rank_k=2, rank_v=2, max_chunk=4, dtype=np.float64)
    state.append(rng.standard_normal((H, 13, d)), rng.standard_normal((H, 13, d)))
    J = state.num_chunks
    got = state_cost(state)
    want = sum((subspace_cost(13, Shape(d, d, 1, 8.0), Subspace(2, 2, chunks=int(j), ell_k=4, ell_v=4)) for j in J[1:]),
               subspace_cost(13, Shape(d, d, 1, 8.0), Subspace(2, 2, chunks=int(J[0]), ell_k=4, ell_v=4)))
    assert got.flops == pytest.approx(want.flops) and got.bytes == pytest.approx(want.bytes)


def test_state_cost_int8_state():
    rng = np.random.default_rng(2)
    H, d, r = 2, 8, 2
    basis = sr.StaticBasis.from_bases(_orthonormal(rng, H, r, d), _orthonormal(rng, H, r, d))
    try:
        state = sr.SubspaceState.static(basis, dtype=np.float32, coefficients="int8")
    except TypeError:
        pytest.skip("this SubspaceState has no int8 coefficients")
    state.append(rng.standard_normal((H, 5, d)).astype(np.float32), rng.standard_normal((H, 5, d)).astype(np.float32))
    assert state_cost(state).term("logits").bytes == H * 5 * (r + 4)


# ----------------------------------------------------------------------------- machine
def test_measure_cpu_small():
    m = measure_cpu(copy_bytes=1 << 20, matmul_n=64, repeats=3)
    assert 0 < m.bandwidth < math.inf and 0 < m.flops < math.inf
    assert m.ridge == pytest.approx(m.flops / m.bandwidth)
    assert "GB/s" in str(m)


def test_validation():
    with pytest.raises(ValueError):
        Shape(0)
    with pytest.raises(ValueError):
        Subspace(4, 4, coef="int4")
    with pytest.raises(ValueError):
        Subspace(4, 4, ell_k=8)
    with pytest.raises(ValueError):
        Subspace(4, 4, chunks=2, max_chunk=8)
    with pytest.raises(ValueError):
        exact_cost(0, Shape(4))
    with pytest.raises(ValueError):
        exact_cost(4, Shape(4)).phase("decode")
    with pytest.raises(KeyError):
        exact_cost(4, Shape(4)).term("nope")


# ----------------------------------------------------------------------------- the CLI report
def test_roofline_report_smoke(tmp_path, capsys):
    from subspace_ref.cli import main

    rc = main(["roofline", "--out", str(tmp_path), "--contexts", "32", "64", "--ranks", "4", "--heads", "2", "--d", "16",
               "--targets", "numpy", "exact-numpy", "--adaptive-max-tokens", "64", "--min-time", "0", "--threads", "0"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "ratio" in out and "numpy" in out and "exact-numpy" in out
    rows = (tmp_path / "roofline.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 + 2  # header; static and adaptive at 2 lengths; exact at 2 lengths
    assert (tmp_path / "roofline.png").stat().st_size > 0
    assert "bandwidth_Bps" in (tmp_path / "machine.json").read_text()


def test_R13_pre_rope_counts_by_hand():
    """Spec R13 worked by hand at d = d_v = 4, r = r_v = 2, g = 2, T = 10, e = 4."""
    from subspace_ref.roofline import Shape, Subspace, subspace_cost

    c = subspace_cost(10, Shape(4, 4, 2, 4.0), Subspace.static(2, rope=True))
    assert c.term("rebuild").flops == 2 * 10 * 2 * 4 and c.term("rebuild").bytes == 2 * 4 * 4
    assert c.term("rope").flops == 6 * 10 * 4 and c.term("rope").bytes == 0
    assert c.term("logits").flops == 2 * 2 * 10 * 4 and c.term("logits").bytes == 10 * 2 * 4
    assert "query_proj" not in c.names()
    plain = subspace_cost(10, Shape(4, 4, 2, 4.0), Subspace.static(2))
    assert c.term("append").flops == plain.term("append").flops + 6 * 4
    assert c.phase("attend").bytes == plain.phase("attend").bytes  # same bytes, more FLOPs


def test_R13_binding_roofs_cpu_compute_h100_tensor_memory():
    from subspace_ref.roofline import Machine, Shape, Subspace, binding_roofs, h100

    cpu = Machine("cpu", 10e9, 50e9)
    rows = binding_roofs(16384, Shape(128, 128, 1, 4.0), {"pre": Subspace.static(32, rope=True), "plain": Subspace.static(32)},
                         (cpu, h100(), h100(tensor_cores=True)))
    bound = {(r["config"], r["machine"]): r["bound"] for r in rows}
    assert bound[("pre", "cpu")] == "compute" and bound[("plain", "cpu")] == "memory"
    assert bound[("pre", h100(tensor_cores=True).name)] == "memory" and bound[("pre", h100().name)] == "compute"
    with pytest.raises(ValueError, match="static"):
        Subspace.adaptive(8, max_chunk=4).__class__(8, 8, max_chunk=4, rope=True)
