"""KV-cache baselines (subspace_ref.lab.baselines): byte accounting by hand, eviction sets, H2O
selection, quantisation error, decode equivalence, full budget = stock; and the command's quick run."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

from subspace_ref.lab.baselines import (  # noqa: E402
    H2O,
    QuantizedKV,
    SlidingWindow,
    StreamingLLM,
    Subspace,
    SubspaceWindow,
    applied,
    fake_quant,
    methods_at,
    quantize_keys,
    token_logprobs,
    window_keep,
)
from subspace_ref.lab.baselines.h2o import H2ORuntime  # noqa: E402
from subspace_ref.byte_convention import Geometry, capacity_for, full_bytes  # noqa: E402

GEOM = Geometry(layers=1, kv_heads=1, head_dim=64, value_dim=64, context=1024)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    from subspace_ref.lab.experiments._common import tiny_random_llama

    model, _ = tiny_random_llama()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 40), generator=g)
    return model, ids


# ----------------------------------------------------------------------------- byte accounting
def test_full_cache_bytes():
    assert full_bytes(GEOM).per_token == 64 * 2 * 2  # K and V, 64 fp16 each
    g = Geometry(4, 2, 64, 64, 1024)
    assert full_bytes(g).per_token == 4 * 2 * 256 == 2048


def test_quantized_bytes_by_hand():
    # 8-bit, d = 64, keys: per-channel fp16 scale + zero over a group of 64 tokens; values: per token
    b = QuantizedKV(bits=8, group=64).bytes(GEOM)
    keys = 64 * 1 + (64 * 2 * 2) / 64  # codes + (64 scales + 64 zeros) x 2 bytes shared by 64 tokens = 68
    values = 64 * 1 + 2 * 2  # codes + one scale + one zero = 68
    assert b.per_token == pytest.approx(keys + values) == pytest.approx(136)
    assert b.fraction == pytest.approx(136 / 256)
    # 4-bit, group 128: keys 32 + 256/128 = 34, values 32 + 4 = 36
    assert QuantizedKV(bits=4, group=128).bytes(GEOM).per_token == pytest.approx(70)
    # unfinished group: context 100, group 64: 36 residual fp16 keys
    g = Geometry(1, 1, 64, 64, 100)
    b = QuantizedKV(bits=8, group=64).bytes(g)
    total = 64 * 64 + 256 * 1 + 36 * 64 * 2 + 100 * 68  # codes of 64 keys, one group's scales, 36 fp16 keys, values
    assert b.per_token * 100 == pytest.approx(total)


def test_eviction_bytes_by_hand():
    assert SlidingWindow(window=256).bytes(GEOM).per_token == pytest.approx(256 * 256 / 1024)
    assert StreamingLLM(sinks=4, window=252).bytes(GEOM).per_token == pytest.approx(256 * 256 / 1024)
    # H2O: 256 kept tokens x (256 bytes of K/V + 4-byte score + 2-byte position) / 1024
    assert H2O(heavy=128, recent=128).bytes(GEOM).per_token == pytest.approx(256 * 262 / 1024)
    assert capacity_for(GEOM, 0.25) == 256
    assert capacity_for(GEOM, 0.25, 6) == int(256 * 256 / 262)


def test_subspace_bytes_by_hand():
    # fp16 coefficients r + r_v = 32 -> 64 bytes; bases (16 + 16) x 64 x 2 bytes + 4 (gamma) over 1024 tokens
    b = Subspace(rank_k=16, rank_v=16).bytes(GEOM)
    assert b.per_token == pytest.approx(64 + (32 * 64 * 2 + 4) / 1024)
    # int8: 32 bytes + 2 float32 scales + bases
    b = Subspace(rank_k=16, rank_v=16, coefficients="int8").bytes(GEOM)
    assert b.per_token == pytest.approx(32 + 8 + (32 * 64 * 2 + 4) / 1024)
    # + window of 512: half the coefficients, all the bases
    b = SubspaceWindow(rank_k=16, rank_v=16, window=512).bytes(GEOM)
    assert b.per_token == pytest.approx(32 + (32 * 64 * 2 + 4) / 1024)


def test_methods_at_budget_fit():
    g = Geometry(4, 2, 64, 64, 1024)
    for f in (0.5, 0.25, 0.125):
        for m in methods_at(g, f):
            frac = m.bytes(g).fraction
            if isinstance(m, QuantizedKV):  # fixed bit widths: scales put it a little above
                assert f < frac < 1.3 * f
            else:
                assert 0.9 * f <= frac <= f + 1e-12, (m, frac)


# ----------------------------------------------------------------------------- eviction sets
def test_window_and_sink_positions():
    keep = window_keep(n=10, T=10, window=3)
    for p in range(10):
        assert keep[p].nonzero().ravel().tolist() == [t for t in range(p + 1) if t > p - 3]
    keep = window_keep(n=10, T=10, window=3, sinks=2)
    assert keep[9].nonzero().ravel().tolist() == [0, 1, 7, 8, 9]
    assert keep[3].nonzero().ravel().tolist() == [0, 1, 2, 3]
    # decode step (one query at position 9 of 10 tokens) = the last row
    assert torch.equal(window_keep(1, 10, 3, 2)[0], keep[9])


def test_h2o_keeps_heavy_hitters_and_recent_window():
    """Synthetic stream: H2O's kept set equals a plain-Python re-implementation's at every step,
    and it is the top accumulated-score tokens plus the recent window."""
    gen = torch.Generator().manual_seed(3)
    B, Hq, H, T, d = 1, 2, 1, 24, 8
    q = torch.randn(B, Hq, T, d, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, T, d, generator=gen, dtype=torch.float64) * 2
    v = torch.randn(B, H, T, d, generator=gen, dtype=torch.float64)
    heavy, recent = 3, 2
    rt = H2ORuntime(heavy, recent)
    rt.record = True
    rt.attend(q, k, v, d**-0.5)
    kept, score = [], {}
    for p in range(T):
        kept.append(p)
        score[p] = 0.0
        if len(kept) > heavy + recent:
            cands = [t for t in kept if t <= p - recent]
            victim = min(cands, key=lambda t: (score[t], t))
            kept.remove(victim)
            # the evicted token had the smallest accumulated attention of the older kept tokens
            assert all(score[t] >= score[victim] for t in kept if t <= p - recent)
        assert rt.history[p][0, 0].nonzero().ravel().tolist() == sorted(kept)
        logits = np.array([(q[0, :, p] @ k[0, 0, t]).numpy() for t in sorted(kept)]).T * d**-0.5  # (Hq, kept)
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        for j, t in enumerate(sorted(kept)):
            score[t] += probs[:, j].sum()
        assert all(t in kept for t in range(max(0, p - recent + 1), p + 1))  # the recent window is always kept
        assert len(kept) == min(p + 1, heavy + recent)


def test_h2o_keeps_a_heavy_hitter_that_the_window_drops():
    """Token 5's key is aligned with every query: it collects most attention, so H2O (2 heavy + 2
    recent) keeps it to the end (with token 0, which early queries attended fully) while a
    4-token window drops both."""
    T, d = 30, 4
    gen = torch.Generator().manual_seed(0)
    q = torch.zeros(1, 1, T, d, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.randn(1, 1, T, d, generator=gen, dtype=torch.float64) * 0.1
    k[0, 0, 5, 0] = 10.0
    v = torch.randn(1, 1, T, d, generator=gen, dtype=torch.float64)
    rt = H2ORuntime(2, 2)
    rt.record = True
    rt.attend(q, k, v, 1.0)
    for p in range(7, T):  # once token 5 has left the recent window
        assert rt.history[p][0, 0].nonzero().ravel().tolist() == [0, 5, p - 1, p]
    assert not bool(window_keep(1, T, 4)[0, 5])


# ----------------------------------------------------------------------------- quantisation
def test_int8_round_trip_within_half_a_step():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, 64, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 5, 64, dtype=torch.float64)
    for dim in (2, 3):  # per channel over tokens (keys), per token over channels (values)
        y = fake_quant(x, 8, dim)
        step = (x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / 255
        assert bool(((y - x).abs() <= step / 2 + 1e-12).all())
    y = quantize_keys(x, 8, group=16)
    for a in range(0, 64, 16):
        blk = x[:, :, a : a + 16]
        step = (blk.amax(2, keepdim=True) - blk.amin(2, keepdim=True)) / 255
        assert bool(((y[:, :, a : a + 16] - blk).abs() <= step / 2 + 1e-12).all())


# ----------------------------------------------------------------------------- on a model
def test_full_budget_reproduces_stock(tiny):
    model, ids = tiny
    T = ids.shape[1]
    stock = token_logprobs(model, ids)
    for m in (SlidingWindow(window=T), StreamingLLM(sinks=4, window=T - 4), H2O(heavy=T // 2, recent=T - T // 2)):
        assert torch.allclose(token_logprobs(model, ids, m), stock, atol=1e-5), m
    # 16-bit quantisation with one-token groups is near-exact
    assert torch.allclose(token_logprobs(model, ids, QuantizedKV(bits=16, group=1)), stock, atol=1e-3)


def test_teacher_forced_equals_decoding(tiny):
    model, ids = tiny
    for m in (H2O(heavy=5, recent=4), StreamingLLM(sinks=2, window=6), QuantizedKV(bits=4, group=8)):
        tf = token_logprobs(model, ids, m)
        dec = token_logprobs(model, ids, m, block_size=1)
        blk = token_logprobs(model, ids, m, block_size=7)
        assert torch.allclose(tf, dec, atol=1e-5), m
        assert torch.allclose(tf, blk, atol=1e-5), m
    assert not torch.allclose(token_logprobs(model, ids, H2O(heavy=5, recent=4)), token_logprobs(model, ids), atol=1e-3)


def test_attention_restored(tiny):
    model, ids = tiny
    before = model.config._attn_implementation
    with applied(model, SlidingWindow(window=4)):
        pass
    assert model.config._attn_implementation == before


def test_command_quick(tmp_path):
    from subspace_ref.lab.experiments import baselines

    p = argparse.ArgumentParser()
    baselines.add_arguments(p)
    args = p.parse_args(["--quick", "--model", "tiny-random", "--out", str(tmp_path / "out"), "--docs", str(tmp_path / "docs"), "--no-progress"])
    assert baselines.run(args) == 0
    rec = json.loads((tmp_path / "out" / "baselines.json").read_text())
    assert {r["family"] for r in rec["rows"]} >= {
        "stock",
        "quantized KV",
        "sliding window",
        "StreamingLLM",
        "H2O",
        "subspace",
        "subspace INT8",
        "subspace + window",
    }
    assert "subspace (issue 16)" in {r["family"] for r in rec["rows"]} and "Scope and limits" in (tmp_path / "docs" / "baselines.md").read_text()
    assert all(c["max_abs_token_nll_diff"] < 1e-3 for c in rec["full_budget_checks"])
    assert (tmp_path / "out" / "baselines.csv").exists()
    page = (tmp_path / "docs" / "baselines.md").read_text()
    assert "Verdict" in page and (tmp_path / "docs" / "figures" / "baselines_pareto.png").exists()


@pytest.mark.parametrize("window, sinks", [(0, 0), (5, 0), (5, 3)])
def test_frontier_runtime_is_the_state(window, sinks):
    """lab/baselines/frontier.py's batched evaluation equals SubspaceState (numpy oracle) with int4
    coefficients, pre-RoPE key bases, an exact window and sinks, at every query position: the
    one-state rows of docs/baselines.md decode as they are evaluated."""
    torch = pytest.importorskip("torch")
    from subspace_ref import StaticBasis, SubspaceState, attend
    from subspace_ref.allocation import Allocation, HeadAllocation
    from subspace_ref.lab.baselines.frontier import Frontier
    from subspace_ref.rope import RopeParams, rotate

    rng = np.random.default_rng(0)
    H, d, T, G, r, rv = 2, 16, 40, 8, 5, 6
    rope = RopeParams(1.0 / 100.0 ** (np.arange(0, d, 2) / d))
    Wk = np.linalg.qr(rng.standard_normal((H, d, d)))[0].transpose(0, 2, 1)
    Wv = np.linalg.qr(rng.standard_normal((H, d, d)))[0].transpose(0, 2, 1)
    alloc = Allocation(((HeadAllocation(r, rv, 4, 4, "pre_rope"),) * H,), G, window=window, sinks=sinks)
    runtime = Frontier(alloc, "t").with_bases([{"Wv": Wv}], [{"Wk": Wk}], rope).runtime(0)  # keys: pre-RoPE bases only
    k_pre = rng.standard_normal((H, T, r)) @ Wk[:, :r] * 3 + 0.1 * rng.standard_normal((H, T, d))
    k = rotate(k_pre, np.arange(T), rope)
    v = rng.standard_normal((H, T, d))
    q = rng.standard_normal((2 * H, T, d))  # two query heads per KV head
    s = 1 / np.sqrt(d)
    got = runtime.attend(*(torch.from_numpy(x[None]).float() for x in (q, k, v)), s)[0].double().numpy()
    basis = StaticBasis.from_bases(Wk[:, :r], Wv[:, :rv])
    state = SubspaceState.static(basis, coefficients="int4", group_size=G, rope=rope, window=window, sinks=sinks)
    for p in range(T):
        state.append(k[:, p], v[:, p])
        want = attend(q[:, p], state)
        np.testing.assert_allclose(got[:, p], want, rtol=2e-4, atol=2e-5, err_msg=f"position {p}")


# ----------------------------------------------------------------------------- simulation vs cache
@pytest.fixture(scope="module")
def tiny64():
    """The tiny Llama in float64 (states float64, bases stored natively) and its allocator inputs."""
    torch.set_num_threads(1)
    from subspace_ref.lab.experiments._common import tiny_random_llama
    from subspace_ref.hf.calibration_losses import calibration_losses

    model, _ = tiny_random_llama()
    model = model.double()
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 256, (2, 64), generator=g).numpy()
    ids = torch.randint(0, 256, (2, 64), generator=g)
    cal = calibration_losses(model, calib, ranks=range(0, 17, 4), group=8)
    return model, ids, cal


def _rows(model, cal):
    """One allocation of each kind docs/baselines.md decodes through allocated_states."""
    from subspace_ref.allocation import Allocation
    from subspace_ref.allocation import HeadAllocation as HA
    from subspace_ref.lab.experiments.baselines import uniform

    geom = cal.geometry(model)
    mixed = Allocation(  # every basis kind and format, int4 keys beside int2 / float / int8 values
        ((HA(6, 5, 4, 2, "pre_rope"), HA(16, 16, 4, 8, "identity", "identity")),
         (HA(8, 7, 16, 4, "plane"), HA(5, 16, 2, 16, "post_rope", "identity"))),
        8, window=6, sinks=3,
    )
    return {
        "pre-RoPE uniform int4": uniform(geom, 0.25, 4, "pre_rope", 8),
        "pre-RoPE uniform int2 + sinks + window": uniform(geom, 0.5, 2, "pre_rope", 8, window=8, sinks=2),
        "allocator + sinks + window": cal.allocate(model, compression_ratio=0.25, window=8, sinks=2),
        "mixed kinds": mixed,
    }


def test_simulation_agrees_with_the_cache(tiny64):
    """docs/baselines.md decodes its allocation rows through SubspaceCache (allocated_states,
    teacher-forced); lab/baselines/frontier.py simulates them as exact attention over the state's
    reconstruction, from bases built independently (frontier_bases). In float64 the two compute
    the same numbers in another summation order: each per-token NLL passes through L layers of
    sums of at most d + T + hidden terms, so rounding moves it by at most about
    L (d + T + hidden) eps |NLL|; one quantisation code read differently, a key group read
    before it is complete or a wrong basis moves it by many orders more (the two prefill bugs this
    test found moved it by 1.8e-4 and 1.2e-9)."""
    from subspace_ref.lab.baselines.frontier import Frontier
    from subspace_ref.lab.experiments.baselines import frontier_bases
    from subspace_ref.hf import allocated_states, teacher_forced

    model, ids, cal = tiny64
    c = model.config
    stock = teacher_forced(model, ids).token_logprobs
    for name, alloc in _rows(model, cal).items():
        assert alloc is not None, name
        with torch.no_grad():
            sim = token_logprobs(model, ids, Frontier(alloc, name).with_bases(*frontier_bases(alloc, cal))).numpy()
        cache = teacher_forced(model, ids, allocated_states(cal.bases(alloc), alloc, rope=cal.rope)).token_logprobs
        tol = c.num_hidden_layers * (c.head_dim + ids.shape[1] + c.hidden_size) * np.finfo(np.float64).eps * np.abs(cache).max()
        assert np.abs(sim - cache).max() <= tol, (name, np.abs(sim - cache).max(), tol)
        assert np.abs(cache - stock).max() > 1e3 * tol, name  # the row compresses: agreement is not both being exact


def test_window_mask_through_the_cache_agrees_with_projection(tiny64):
    """The subspace + window row: SubspaceCache (static states) under a window mask equals exact
    attention over the projected keys and values under the same mask (spec A2). The projection's
    simulation (lab/baselines/combined.py) holds its d x d projectors in float32, so the bound of the
    test above has float32's eps: each projected entry moves by at most d eps32 relative."""
    from subspace_ref.lab.experiments.baselines import bases_for, windowed_logprobs
    from subspace_ref.hf import static_states

    model, ids, cal = tiny64
    c = model.config
    m = SubspaceWindow(rank_k=5, rank_v=5, window=16)
    bases = bases_for(cal.svd, m.rank_k, m.rank_v)
    with torch.no_grad():
        sim = token_logprobs(model, ids, m.with_bases(bases)).numpy()
    cache = windowed_logprobs(model, ids, static_states(bases), m.window)
    tol = c.num_hidden_layers * c.head_dim * np.finfo(np.float32).eps * np.abs(cache).max()
    assert np.abs(sim - cache).max() <= tol
    full = windowed_logprobs(model, ids, static_states(bases), ids.shape[1])
    assert np.abs(full - cache).max() > 1e3 * tol  # the window drops tokens: agreement is not the mask doing nothing
