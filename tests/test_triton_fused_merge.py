"""One launch for split + merge (issue 38 item 5; spec A3.2): ``decode.decode_attention(...,
fused_merge=True)``, ``decode.fused_launch`` and ``DecodeWorkspace(..., fused_merge=True)``.

Each split program writes its partial (m, Z, N), counts it on a per-(sequence, KV head) counter,
and the one that writes the last merges every partial of its rows by the merge kernel's
arithmetic (``decode._merge_row``, shared by both) over whole rows in steps of MERGE_BLOCK_S
splits, then resets its counter to 0. Under the interpreter the fused output is therefore the merge
launch's over whole rows in those steps (``merge_launch(columns=0, block_s=MERGE_BLOCK_S)``) bit
for bit. On a GPU the two merges sum the same float32 terms in orders of their own (the reductions
over a step of splits follow each kernel's layout, set by its warps: 4 in the merge kernel, the
split kernel's in the fused one), so there they agree within the rounding bound of those sums
(:func:`_merge_bound`); the default merge launch (32 columns, 128 splits a step) agrees within the
bound of both steps everywhere; and a fused launch repeated equals the first bit for bit. The counters are zero after every call
and reused by the next. The compile test builds the fused kernel for sm_90 and sm_80 as it
launches (``compile_report``) and measures its main loop (``sass``).

The fused path is not the default: timed slower than the two launches under a CUDA graph, faster
eager (docs/gpu.md); its memory ordering (the release/acquire
count and the L2 reads of the partials) is only exercised on a GPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

# the kernels decorated with TRITON_INTERPRET set where there is no GPU (test_triton_kernels sets it while it imports)
from tests.test_triton_kernels import (  # noqa: E402
    DEVICE,
    LOW_BIT_CASES,
    _coded_state,
    _interpreter_environment,  # noqa: F401 - the autouse fixture, for this module's tests too
    _t,
    chunked,
    pytestmark,  # noqa: F401 - skipped where the Triton backend is unavailable
    poison_low_bit,
    random_layout,
)

from subspace_ref_triton import decode, workspace  # noqa: E402
from subspace_ref_triton._common import cdiv, pow2_at_least  # noqa: E402
from tests.differential.tolerance import EPS  # noqa: E402

# (name, N, H, g, T, d, r, r_v, starts per (n, h), split_len, num_splits): one split; a partial last
# split; empty splits past T; more splits than one merge tile (decode.MERGE_BLOCK_S)
FLOAT_CASES = [
    ("one-split", 2, 2, 4, 70, 64, 5, 7, [[0]] * 4, 128, None),
    ("partial-last", 2, 1, 3, 150, 64, 6, 4, [chunked(150, 40, 100), [0]], 64, None),
    ("empty-splits", 1, 2, 2, 100, 64, 5, 5, [chunked(100, 3), chunked(100, 70)], 40, 5),
    ("two-merge-tiles", 2, 1, 4, 150, 32, 4, 4, [[0], chunked(150, 77)], 8, None),
]
FLOAT_IDS = [c[0] for c in FLOAT_CASES]


def _merge_bound(partials, dtype, tiles=(decode.MERGE_BLOCK_S,)) -> np.ndarray:
    """How far apart two merges of the same partials (m, Z, N) (spec A3.2) by ``decode._merge_state``
    may land when they sum in different orders (module docstring), per output element, in float64:
    each term of Z = sum z_s a_s and N = sum N_s a_s (a_s = e^(m_s - max m)) takes at most n =
    BLOCK_S - 1 additions in its merge tile, its product (an FMA or not) and a rescale and an addition
    per later tile, so each merge is within gamma_n = n u / (1 - n u) (u = 2^-24) of the exact sums
    relative to sum |terms|; the two then differ by at most 2 gamma_n (sum |N_s| a_s / Z + |N / Z|),
    plus the division's 2 ulps in each, plus one ulp of the output dtype where it is not float32
    (two float32 values on either side of a rounding boundary). ``tiles``: the splits per merge step
    of the merges compared (``merge_launch``'s ``block_s``); n is the larger of theirs."""
    m, z, o = (x.detach().to("cpu", torch.float64).numpy() for x in partials)
    S = m.shape[-1]
    top = m.max(-1, keepdims=True)
    a = np.exp(m - np.where(np.isneginf(top), 0.0, top))  # empty partials: e^-inf = 0
    Z = (z * a).sum(-1)[..., None]
    magnitude = (np.abs(o) * a[..., None]).sum(-2) / Z
    out = np.abs((o * a[..., None]).sum(-2)) / Z
    n = max(tile + 2 * (cdiv(S, tile) - 1) for tile in (min(t, pow2_at_least(S, 1)) for t in tiles))
    u = 2.0**-24
    gamma = n * u / (1 - n * u)
    cast = 0.0 if dtype == torch.float32 else EPS[str(dtype).removeprefix("torch.")]
    return 2 * gamma / (1 - 2 * gamma) * (magnitude + out) + 8 * u * out + cast * out


def _same_merge(got, partials):
    """``got``, a fused merge of ``partials``, against the merge launch over whole rows in steps of
    MERGE_BLOCK_S splits (the fused merge's own arithmetic): bit for bit under the interpreter,
    within :func:`_merge_bound` on a GPU; and against the default merge launch (its own step of
    splits) within the bound of the two steps everywhere."""
    rows_launch, rows = decode.merge_launch(*partials, got.dtype, columns=0, block_s=decode.MERGE_BLOCK_S)
    rows_launch.run()
    default_launch, default = decode.merge_launch(*partials, got.dtype)
    default_launch.run()
    assert got.shape == rows.shape
    if DEVICE == "cpu":
        assert torch.equal(got, rows), (got - rows).abs().max()
    for want, tiles in ((rows, (decode.MERGE_BLOCK_S,)), (default, (decode.MERGE_BLOCK_S, default_launch.constexprs["BLOCK_S"]))):
        diff = (got.double() - want.double()).abs().cpu().numpy()
        bound = _merge_bound(partials, want.dtype, tiles)
        assert (diff <= bound).all(), (diff.max(), bound[diff > bound].min(), (diff / np.maximum(bound, 1e-300)).max())


def _check(q, lay, split_len, num_splits):
    """The fused output equals the two-launch one (:func:`_same_merge`), leaves the counters at
    zero, and a second call on the same counters gives the same output bit for bit."""
    scale = 1.0 / math.sqrt(q.shape[-1])  # decode_attention's default
    want = decode.decode_attention(q, lay, scale, split_len, num_splits)
    counters = decode.new_counters(q, lay)
    got = decode.decode_attention(q, lay, scale, split_len, num_splits, fused_merge=True, counters=counters)
    assert torch.isfinite(want).all() and got.dtype == want.dtype
    _same_merge(got, decode.attention_partials(q, lay, scale, split_len, num_splits))
    assert counters.shape == (q.shape[0] * lay.key_coef.shape[1],) and (counters == 0).all(), counters
    # again on the same counters, into partials and an output poisoned with NaN: all written afresh
    launch, (again, _, _) = decode.fused_launch(q, lay, scale, split_len, num_splits, counters=counters,
                                                out=torch.full_like(want, float("nan")), outputs=_poisoned(q, lay, split_len, num_splits))
    launch.run()
    assert torch.equal(again, got) and (counters == 0).all(), counters


def _merge_in_order(partials, order):
    """Spec A3.2's merge in float32 as the merge kernels tile it (the model :func:`_merge_bound`
    counts): the splits of ``order`` in tiles of decode's merge tile, each tile summed one by one in
    that order, the tiles' sums added in turn."""
    m, z, o = (x.numpy() for x in partials)
    top = m.max(-1, keepdims=True)
    a = np.exp(m - top).astype(np.float32)
    Z, N = np.zeros(m.shape[:-1], np.float32), np.zeros(o.shape[:2] + o.shape[3:], np.float32)
    order = list(order)
    tile = min(decode.MERGE_BLOCK_S, pow2_at_least(len(order), 1))
    for start in range(0, len(order), tile):
        Zt, Nt = np.zeros_like(Z), np.zeros_like(N)
        for s in order[start:start + tile]:
            Zt, Nt = Zt + z[..., s] * a[..., s], Nt + o[..., s, :] * a[..., s, None]
        Z, N = Z + Zt, N + Nt
    return torch.from_numpy(N / Z[..., None])


def test_merge_bound_holds_reordered_sums_and_not_a_lost_split():
    """:func:`_merge_bound` (the GPU's criterion) on the CPU: float32 merges of the same partials
    summed in two orders stay within it, and one that drops a split (a lost partial) does not."""
    gen = torch.Generator().manual_seed(0)
    for S in (3, 16, 19, 40):
        m = torch.randn(2, 4, S, generator=gen) * 3
        m[..., -1] = m.max()  # the split dropped below weighs as much as any
        z = torch.rand(2, 4, S, generator=gen) * 20 + 1
        o = torch.randn(2, 4, S, 64, generator=gen) * z[..., None]
        partials = (m, z, o)
        forward, backward = _merge_in_order(partials, range(S)), _merge_in_order(partials, reversed(range(S)))
        bound = _merge_bound(partials, torch.float32)
        assert not torch.equal(forward, backward) and ((forward - backward).double().abs().numpy() <= bound).all(), S
        lost = _merge_in_order(partials, range(S - 1))
        assert ((lost - forward).double().abs().numpy() > bound).mean() > 0.9, S


def _poisoned(q, lay, split_len, num_splits):
    """(m, Z, N) partials of the launch filled with NaN."""
    S = -(-int(lay.num_tokens) // split_len) if num_splits is None else num_splits
    N, Hq, d_v = q.shape[0], q.shape[1], lay.value_bases.shape[-1]
    return tuple(torch.full(shape, float("nan"), device=q.device) for shape in ((N, Hq, S), (N, Hq, S), (N, Hq, S, d_v)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", FLOAT_CASES, ids=FLOAT_IDS)
def test_float_and_int8_equal_the_two_launches(rng, case, dtype):
    name, N, H, g, T, d, r, r_v, starts, split_len, num_splits = case
    for int8 in (False, True):
        lay, _ = random_layout(rng, N, H, T, d, d, r, r_v, starts, dtype, int8=int8)
        q = _t(rng.standard_normal((N, H * g, d)), torch.float32 if dtype == "float32" else torch.bfloat16)
        _check(q, lay, split_len, num_splits)


# the non-centred reader (float32 bases, odd ranks) and the centred form (16-bit bases, power-of-two ranks)
LOW_BIT = [(LOW_BIT_CASES[0], "float32", 16, None), (LOW_BIT_CASES[0], "float32", 64, None),
           (LOW_BIT_CASES[4], "bfloat16", 48, None), (LOW_BIT_CASES[4], "float16", 200, None), (LOW_BIT_CASES[4], "bfloat16", 32, 7)]


@pytest.mark.parametrize("case,dtype,split_len,num_splits", LOW_BIT, ids=[f"{c[0]}-{dt}-{s}-{n}" for c, dt, s, n in LOW_BIT])
def test_int4_equals_the_two_launches(rng, case, dtype, split_len, num_splits):
    name, kind, N, H, g, d, d_v, r, r_v, T, G, _ = case
    lay = poison_low_bit(_coded_state(rng, case, "int4").to("triton", device=DEVICE, dtype=dtype).layout)
    assert lay.low_bits == 4 and decode.centred_int4(lay, decode._PARTS[lay.key_bases.dtype]) == (dtype != "float32")
    q = _t(rng.standard_normal((N, H * g, d)), torch.float32)
    _check(q, lay, split_len, num_splits)


@pytest.mark.parametrize("case", FLOAT_CASES[1:], ids=FLOAT_IDS[1:])
def test_only_the_last_arrival_merges(rng, case):
    """The interpreter runs programs one after another, so a merge by every program would still
    end with the right output: here the grid stops one split short (the count never reaches
    S - 1), and nothing may be merged; with one arrival counted beforehand, the last program of
    the short grid merges, the missing split's partial set to the identity (-inf, 0, 0)."""
    name, N, H, g, T, d, r, r_v, starts, split_len, num_splits = case
    lay, _ = random_layout(rng, N, H, T, d, d, r, r_v, starts, "float32")
    q = _t(rng.standard_normal((N, H * g, d)), torch.float32)
    for arrived in (0, 1):
        counters = decode.new_counters(q, lay) + arrived
        out = torch.full((N, H * g, d), float("nan"), device=q.device)
        launch, (_, _, partials) = decode.fused_launch(q, lay, 0.2, split_len, num_splits, counters=counters, out=out,
                                                       outputs=_poisoned(q, lay, split_len, num_splits))
        S = launch.grid[1]
        assert S > 1
        if arrived:
            for x, empty in zip(partials, (float("-inf"), 0.0, 0.0)):
                x[:, :, S - 1] = empty
        replace(launch, grid=(launch.grid[0], S - 1)).run()
        assert torch.isfinite(partials[1]).all() if arrived else torch.isnan(partials[1][:, :, S - 1]).all()
        if arrived:
            assert (counters == 0).all()
            _same_merge(out, partials)
        else:
            assert (counters == S - 1).all() and torch.isnan(out).all()  # not merged


def test_counters_are_checked(rng):
    lay, _ = random_layout(rng, 1, 2, 20, 32, 32, 3, 3, [[0]] * 2, "float32")
    q = _t(rng.standard_normal((1, 4, 32)), torch.float32)
    for bad in (torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int32, device=DEVICE)):
        with pytest.raises(ValueError, match="counters"):
            decode.decode_attention(q, lay, None, 16, fused_merge=True, counters=bad)
    with pytest.raises(ValueError, match="fused_merge"):
        decode.decode_attention(q, lay, None, 16, counters=decode.new_counters(q, lay))


def test_workspace_fused_merge_is_one_launch_and_reusable(rng):
    """The graph-capturable step with ``fused_merge``: one launch, equal to the two-launch
    workspace at every token count (splits past T empty), its counters zero after each step."""
    N, H, g, d, r, capacity = 2, 2, 3, 32, 4, 600
    lay, _ = random_layout(rng, N, H, capacity, d, d, r, r, [chunked(capacity, 5, 260)] * (N * H), "float32")
    two = workspace.DecodeWorkspace(lay, H * g, torch.float32)
    one = workspace.DecodeWorkspace(lay, H * g, torch.float32, fused_merge=True)
    assert two.counters is None and len(two.launches(torch.zeros(N, H * g, d, device=DEVICE))) == 2
    assert one.num_splits == two.num_splits > 1 and one.counters.dtype == torch.int32 and one.counters.shape == (N * H,)
    q = _t(rng.standard_normal((N, H * g, d)), torch.float32)
    (split,) = one.launches(q)
    assert split.constexprs["FUSED"] and split.constexprs["DEVICE_T"]
    for T in (1, 290, 600, 290):
        for ws in (one, two):
            ws.num_tokens.fill_(T)
        two.attend(q)
        assert one.out.dtype == two.out.dtype
        _same_merge(one.attend(q), two.partials)
        assert (one.counters == 0).all(), (T, one.counters)
    want = decode.decode_attention_reference(q, replace(lay, num_tokens=290), one.scale, split_len=64)
    torch.testing.assert_close(one.out, want, rtol=1e-5, atol=1e-6)  # test_triton_launch's tolerance for this step


# ------------------------------------------------------------------------------------- compiled

SCRIPT = r"""
import json
import torch
from subspace_ref_triton import decode, gpu_report, sass
from subspace_ref_triton.compile_report import compile_launch, launch_resources
rows = []
for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    for coef in ("float", "int8", "int4"):
        lay = gpu_report._layout(torch, 8192, gpu_report.D, gpu_report.RANK, dt, coef)
        q = torch.zeros(1, gpu_report.H_KV * gpu_report.GROUP, gpu_report.D, dtype=dt)
        for graph in ((False, True) if (name, coef) == ("bf16", "float") else (False,)):
            kw = dict(num_tokens=torch.zeros(1, dtype=torch.int64)) if graph else {}
            plain, _ = decode.split_launch(q, lay, 0.1, 0 if graph else 1024, 8, **kw)
            fused, _ = decode.fused_launch(q, lay, 0.1, 0 if graph else 1024, 8, **kw)
            assert fused.constexprs["FUSED"] and "FUSED" not in plain.constexprs
            for arch in (90, 80):
                res = {k: launch_resources(x, arch) for k, x in (("plain", plain), ("fused", fused))}
                loop = {k: sass.launch_stats(x, arch).as_dict() for k, x in (("plain", plain), ("fused", fused))}
                ptx = compile_launch(fused, arch).asm["ptx"]
                rows.append(dict(config=f"{name} {coef}{' graph' if graph else ''}", arch=arch,
                                 res={k: [r.registers, r.spill_stores, r.spill_loads] for k, r in res.items()}, loop=loop,
                                 acq_rel="atom.global.gpu.acq_rel.add" in ptx, cg_loads="ld.global.cg" in ptx,
                                 plain_atomics="atom." in compile_launch(plain, arch).asm["ptx"]))
print("RESULTS " + json.dumps(rows))
"""


def test_fused_kernel_compiles_without_local_memory_in_its_main_loop():
    """The fused split kernel at the benchmark's shape (bf16: float, int8, int4 eager and float
    graph-capturable; fp32 bases) compiled for sm_90 and sm_80 as it launches: no local loads or
    stores in its main loop beyond the two-launch split kernel's (none on sm_90, and none where it has none: the
    register cap of the centred int4 launch, chosen by GPU timing, leaves the two-launch loop one on
    sm_80 under Triton 3.9, none under the GPU image's 3.6), and no spill where the two-launch split
    kernel has none; the count is a GPU-scope acquire-release atomic and the partials are read past
    L1 (``ld.global.cg``), the two-launch kernel has no atomic."""
    try:
        from subspace_ref_triton.compile_report import triton_ptxas
        from subspace_ref_triton.sass import nvdisasm

        missing = not (os.path.exists(triton_ptxas(90)) and os.path.exists(triton_ptxas(80)) and os.path.exists(nvdisasm()))
    except Exception as err:  # noqa: BLE001 - a Triton without the NVIDIA backend
        pytest.skip(f"Triton's NVIDIA backend is not usable here ({type(err).__name__}: {err})")
    if missing:
        pytest.skip("Triton's bundled ptxas/nvdisasm is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=1800, env=env)
    assert out.returncode == 0, out.stderr[-6000:]
    rows = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULTS ")).removeprefix("RESULTS "))
    assert len(rows) == 2 * 7
    print()
    for r in rows:
        fused, plain = r["loop"]["fused"], r["loop"]["plain"]
        print(f"  {r['config']} sm_{r['arch']}: registers/spill stores/loads {r['res']['plain']} -> {r['res']['fused']}, "
              f"main loop {plain['instructions']} -> {fused['instructions']} instructions, local {fused['local']}")
        assert fused["instructions"] > 0 and fused["local"] <= plain["local"] and (fused["local"] == 0 or r["arch"] == 80), r
        assert r["acq_rel"] and r["cg_loads"] and not r["plain_atomics"], r
        if not any(r["res"]["plain"][1:]):
            assert not any(r["res"]["fused"][1:]), r
