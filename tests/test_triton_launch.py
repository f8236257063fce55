"""Launch shapes of the Triton kernels: occupancy-sized grids, the graph-capturable decode step
(:class:`subspace_ref_triton.workspace.DecodeWorkspace`) and appends of any length.

The numerics run on Triton's CPU interpreter (as in ``test_triton_kernels.py``); the host side of
the graph-capturable step runs under :func:`no_sync_no_alloc`, a guard that raises on every call
that would synchronise with the device or allocate, with the launches recorded instead of run.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import pytest

from tests.triton_interpreter import _interpreter_environment, load_kernels  # noqa: F401  (an autouse fixture)

torch = pytest.importorskip("torch")
_AVAILABLE, DEVICE, (decode, project, rope_decode, workspace) = load_kernels("decode", "project", "rope_decode", "workspace")

from subspace_ref.layout import PackedLayout  # noqa: E402
from subspace_ref_triton import occupancy  # noqa: E402
from subspace_ref_triton._common import Launch  # noqa: E402

needs_triton = pytest.mark.skipif(not _AVAILABLE, reason=f"triton backend unavailable: {_AVAILABLE.reason}")



# ------------------------------------------------------------------------------ the guard

_SYNCING_TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__")
_ALLOCATORS = ("empty", "zeros", "ones", "full", "tensor", "empty_like", "zeros_like", "ones_like", "full_like", "arange")


class HotPathViolation(AssertionError):
    pass


@contextlib.contextmanager
def no_sync_no_alloc(monkeypatch):
    """Raise on host reads of device values (``.item()``, ``bool(t)``, ``.cpu()``, ...), on
    ``torch.cuda.synchronize`` and on tensor allocation; record kernel launches instead of running
    them. Yields the list of recorded launches."""
    launches: list[Launch] = []

    def refuse(what):
        def raiser(*args, **kwargs):
            raise HotPathViolation(f"{what} on the hot path")
        return raiser

    with monkeypatch.context() as m:
        for name in _SYNCING_TENSOR_METHODS:
            m.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        for name in _ALLOCATORS:
            m.setattr(torch, name, refuse(f"torch.{name}"))
        m.setattr(torch.cuda, "synchronize", refuse("torch.cuda.synchronize"))
        m.setattr(Launch, "run", lambda self: launches.append(self))
        yield launches


def test_the_guard_catches_syncs_and_allocations(monkeypatch):
    x = torch.ones(3)
    for bad in (lambda: x.sum().item(), lambda: bool(x[0] > 0), lambda: torch.empty(2), lambda: x.cpu(), lambda: int(x[0])):
        with no_sync_no_alloc(monkeypatch), pytest.raises(HotPathViolation):
            bad()
    assert x.sum().item() == 3.0  # restored afterwards


# ------------------------------------------------------------------------------ occupancy


def test_resident_blocks_limits():
    # the benchmark's bf16 split kernel on sm_90: 179 registers x 4 warps -> 2 blocks (registers)
    occ = occupancy.resident_blocks(occupancy.H100, 179, 4, 23552)
    assert (occ.blocks_per_sm, occ.limiter) == (2, "registers")
    # 64 registers x 4 warps: 8 by registers, 16 by warps; 30 KB of shared memory allows 7 on sm_90
    occ = occupancy.resident_blocks(occupancy.H100, 64, 4, 30 * 1024)
    assert (occ.blocks_per_sm, occ.limiter) == (7, "shared memory")
    assert occupancy.resident_blocks(occupancy.A100, 64, 4, 30 * 1024).blocks_per_sm == 5
    assert occupancy.resident_blocks(occupancy.H100, 32, 1, 0).limiter == "blocks"
    assert occ.waves(7 * 132, 132) == 1.0


@pytest.mark.parametrize("programs", [1, 8, 64, 300])
def test_full_wave_splits_fill_the_device_once(programs):
    resident, sms = 2, 132
    S = occupancy.full_wave_splits(programs, 1 << 20, resident, sms, 256)
    assert programs * S <= max(resident * sms, programs)  # never a second wave
    assert programs * (S + 1) > resident * sms  # one more split would start one
    assert occupancy.full_wave_splits(programs, 300, resident, sms, 256) <= 2  # no split under 256 tokens


# ------------------------------------------------------------------------------ appends of any length


@needs_triton
def test_append_grid_is_capped_for_two_million_tokens():
    n_new, d, r = 2_000_000, 64, 8
    x = torch.zeros(1, 1, 1, d).expand(1, 2, n_new, d)  # a stride-0 view: no 2M-token allocation
    bases = torch.zeros(1, 2, 1, r, d)
    out = torch.zeros(1, 1, 1, r).expand(1, 2, n_new, r)
    launch, _ = project.project_launch(x, x, bases, bases, torch.zeros(1, 2, dtype=torch.int64), out, out)
    assert launch.grid == (2, project.MAX_GRID_Y)
    assert project.MAX_GRID_Y <= 65535 < -(-n_new // project.BLOCK_N)


@needs_triton
def test_programs_stride_over_tiles_beyond_the_grid_cap(monkeypatch, rng):
    monkeypatch.setattr(project, "MAX_GRID_Y", 2)  # 7 tiles of 16 tokens over 2 programs per head
    N, H, n_new, d, r = 1, 2, 100, 32, 5
    keys = torch.as_tensor(rng.standard_normal((N, H, n_new, d)), dtype=torch.float32, device=DEVICE)
    bases = torch.as_tensor(np.swapaxes(np.linalg.qr(rng.standard_normal((N, H, 1, d, r)))[0], -1, -2).copy(), dtype=torch.float32, device=DEVICE)
    chunk = torch.zeros(N, H, dtype=torch.int64, device=DEVICE)
    got = [torch.full((N, H, n_new, r), float("nan"), device=DEVICE) for _ in range(2)]
    want = [torch.empty_like(g) for g in got]
    launch, _ = project.project_launch(keys, keys, bases, bases, chunk, *got, True)
    assert launch.grid == (N * H, 2)
    rho = project.project_append(keys, keys, bases, bases, chunk, *got, True)
    rho_ref = project.project_append_reference(keys, keys, bases, bases, chunk, *want, True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rho[0], rho_ref[0], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ graph-capturable decode


def chunked_layout(rng, N, H, capacity, d, r, starts):
    """A float32 torch layout with every row of its capacity filled and the given chunk starts."""
    J = len(starts)
    qr = lambda: np.swapaxes(np.linalg.qr(rng.standard_normal((N, H, J, d, r)))[0], -1, -2).copy()  # noqa: E731
    f = lambda x: torch.as_tensor(x, dtype=torch.float32, device=DEVICE)  # noqa: E731
    return PackedLayout(
        f(rng.standard_normal((N, H, capacity, r))), f(rng.standard_normal((N, H, capacity, r))), f(qr()), f(qr()),
        torch.as_tensor(np.broadcast_to(starts, (N, H, J)).copy(), device=DEVICE), torch.full((N, H), J, dtype=torch.int64, device=DEVICE),
        f(rng.uniform(0.5, 1.5, H)), 1,
    )


@needs_triton
def test_workspace_follows_the_device_token_count(rng):
    """One workspace, grid fixed by the capacity, the token count advanced on the device: every
    step equals the plain decode at that T (splits past T are empty and merge as the identity)."""
    N, H, g, d, r, capacity = 1, 2, 3, 32, 6, 700
    lay = chunked_layout(rng, N, H, capacity, d, r, [0, 5, 260, 300])
    ws = workspace.DecodeWorkspace(lay, H * g, torch.float32)
    assert ws.num_splits == 3  # the interpreter's choice: ceil(700 / 256) splits
    q = torch.as_tensor(rng.standard_normal((N, H * g, d)), dtype=torch.float32, device=DEVICE)
    for T in (1, 7, 290, 700):
        ws.num_tokens.fill_(T)
        got = ws.attend(q).clone()
        want = decode.decode_attention_reference(q, replace(lay, num_tokens=T), ws.scale, split_len=64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ws.num_tokens.fill_(290)
    ws.advance(3)
    want = decode.decode_attention_reference(q, replace(lay, num_tokens=293), ws.scale, split_len=64)
    torch.testing.assert_close(ws.attend(q), want, rtol=1e-5, atol=1e-6)


@needs_triton
def test_workspace_step_has_no_sync_and_no_allocation(rng, monkeypatch):
    N, H, g, d, r, capacity = 2, 2, 2, 32, 4, 1000
    lay = chunked_layout(rng, N, H, capacity, d, r, [0, 40])
    ws = workspace.DecodeWorkspace(lay, H * g, torch.float32)
    q = torch.zeros(N, H * g, d, device=DEVICE)
    with no_sync_no_alloc(monkeypatch) as launches:
        out = ws.attend(q)
        ws.advance()
    assert out is ws.out
    split, merge = launches
    assert split.grid == (N * H, ws.num_splits) and merge.grid == (N * H * g, -(-d // decode.MERGE_COLUMNS))
    assert split.constexprs["DEVICE_T"] and split.args[16] is ws.num_tokens
    assert all(a is p for a, p in zip(split.args[13:16], ws.partials)) and merge.args[3] is ws.out


@needs_triton
def test_windowed_workspace_step_has_no_sync_and_no_allocation(rng, monkeypatch):
    """With a windowed layer's exact part (spec/models.md M11.14 step 4) the step is still two
    launches, the second reading the exact arrays, the layer's count and the head rows on the
    device, the split partials and writing the workspace's output."""
    N, H, g, d, r, capacity = 2, 2, 2, 32, 4, 1000
    lay = chunked_layout(rng, N, H, capacity, d, r, [0, 40])
    ws = workspace.DecodeWorkspace(lay, H * g, torch.float32)
    keys, values = torch.zeros(N, 2 * H, 36, d, device=DEVICE), torch.zeros(N, 2 * H, 36, d, device=DEVICE)
    count, heads = torch.zeros((), dtype=torch.int64, device=DEVICE), torch.tensor([3, 0], device=DEVICE)
    q = torch.zeros(N, H * g, d, device=DEVICE)
    with no_sync_no_alloc(monkeypatch) as launches:
        out = ws.attend(q, exact=(keys, values, count, heads))
    assert out is ws.out
    split, merge = launches
    assert split.grid == (N * H, ws.num_splits) and merge.grid == (N * H, g) and merge.kernel.fn.__name__ == "_exact_merge_kernel"
    assert merge.args[1] is keys and merge.args[2] is values and merge.args[3] is heads and merge.args[4] is count
    assert all(a is p for a, p in zip(merge.args[5:8], ws.partials)) and merge.args[8] is ws.out


def static_stream(rng, coefficients, N=2, H=2, d=24, r=5, tokens=48):
    """A static state (float or int8 coefficients) and ``tokens`` keys and values to append."""
    import subspace_ref as sr

    orthonormal = lambda: np.swapaxes(np.linalg.qr(rng.standard_normal((H, d, r)))[0], -1, -2)  # noqa: E731
    state = sr.SubspaceState.static(sr.StaticBasis.from_bases(orthonormal(), orthonormal(), gamma=[0.7, 1.3][:H]), batch=N, coefficients=coefficients)
    return state, rng.standard_normal((N, H, tokens, d)), rng.standard_normal((N, H, tokens, d))


@needs_triton
@pytest.mark.parametrize("coefficients", ["float", "int8"])
def test_workspace_append_then_attend_follows_the_reference(coefficients, rng):
    """DecodeWorkspace.append projects new tokens at the device count and advances it. After
    appends of 1 and 3 tokens: the rows equal project_append_reference's at those rows within
    the bound of two float32 d-term dot products (Higham 3.1: each errs by at most gamma_d
    sum_i |b_i k_i|; int8: codes within one step, scales within that bound / 127 and two
    roundings), the rows past the count are untouched, and attend over the layout as written
    equals the float64 oracle over the same values within the harness's rule
    (tests/differential/tolerance.py)."""
    from tests.differential.tolerance import reference_error, tolerance
    from tests.test_triton_kernels import numpy_state

    from subspace_ref.numpy_backend import attend_reference

    N, H, g, T0 = 2, 2, 2, 37
    state, keys, values = static_stream(rng, coefficients)
    state.append(keys[:, :, :T0], values[:, :, :T0])
    lay = state.to("triton", device=DEVICE, dtype="float32").layout.with_capacity(64, 1)
    ws = workspace.DecodeWorkspace(lay, H * g, torch.float32)
    want = replace(lay, **{name: getattr(lay, name).clone() for name in ("key_coef", "value_coef", "key_scale", "value_scale") if getattr(lay, name) is not None})
    q = torch.as_tensor(rng.standard_normal((N, H * g, keys.shape[3])), dtype=torch.float32, device=DEVICE)
    u, d = 2.0**-24, keys.shape[3]
    gamma_d = d * u / (1 - d * u)
    T = T0
    for n in (1, 3):
        k, v = (torch.as_tensor(x[:, :, T : T + n], dtype=torch.float32, device=DEVICE) for x in (keys, values))
        ws.append(k, v)
        int8 = coefficients == "int8"
        scales = dict(out_key_scale=want.key_scale, out_value_scale=want.value_scale) if int8 else {}
        project.project_append_reference(k, v, want.key_bases, want.value_bases, ws.chunk, want.key_coef, want.value_coef,
                                         out_row=torch.tensor(T, device=DEVICE), **scales)
        assert int(ws.num_tokens) == T + n
        for which, x in (("key", k), ("value", v)):
            bound = 2 * gamma_d * torch.einsum("nhtd,nhrd->nhtr", x.double().abs(), getattr(lay, f"{which}_bases")[:, :, 0].double().abs())
            got, ref = getattr(ws.layout, f"{which}_coef"), getattr(want, f"{which}_coef")
            if int8:  # round(c / s): a code moves by one step at most where c sits within the bound of a half-step
                assert (got[:, :, T : T + n].int() - ref[:, :, T : T + n].int()).abs().max() <= 1
                s_got, s_ref = getattr(ws.layout, f"{which}_scale"), getattr(want, f"{which}_scale")
                s_bound = bound.amax(-1) / 127 + 2 * u * s_ref[:, :, T : T + n].double()
                assert ((s_got[:, :, T : T + n].double() - s_ref[:, :, T : T + n].double()).abs() <= s_bound).all()
                assert torch.equal(s_got[:, :, T + n :], s_ref[:, :, T + n :])
            else:
                assert ((got[:, :, T : T + n].double() - ref[:, :, T : T + n].double()).abs() <= bound).all(), which
            assert torch.equal(got[:, :, T + n :], ref[:, :, T + n :]), which  # nothing written past the count
        T += n
        lay64 = replace(ws.layout, num_tokens=T).map_arrays(lambda _, x: x.cpu().double().numpy() if x.is_floating_point() else x.cpu().numpy())
        q64 = q.double().cpu().numpy()
        out64 = attend_reference(q64, numpy_state(lay64), ws.scale)
        err = np.abs(ws.attend(q).double().cpu().numpy() - out64).max()
        assert err <= tolerance(reference_error(numpy_state(lay64), q64, ws.scale, out64, "float32"), out64, "float32"), err


@needs_triton
def test_workspace_append_has_no_sync_and_no_allocation(rng, monkeypatch):
    """append, then attend: three launches (projection, split, merge) and one add, the projection
    writing at the workspace's device count into the layout's own arrays."""
    state, keys, values = static_stream(rng, "int8")
    state.append(keys[:, :, :10], values[:, :, :10])
    lay = state.to("triton", device=DEVICE, dtype="float32").layout.with_capacity(64, 1)
    ws = workspace.DecodeWorkspace(lay, 4, torch.float32)
    k = torch.as_tensor(keys[:, :, 10:11], dtype=torch.float32, device=DEVICE)
    q = torch.zeros(2, 4, keys.shape[3], device=DEVICE)
    with no_sync_no_alloc(monkeypatch) as launches:
        ws.append(k, k)
        ws.attend(q)
    proj, split, merge = launches
    assert proj.constexprs["DEVICE_ROW"] and proj.args[11] is ws.num_tokens and proj.args[5] is lay.key_coef and proj.args[7] is lay.key_scale
    assert int(ws.num_tokens) == 11


@needs_triton
def test_workspace_append_refusals(rng):
    """append refuses what it does not write: int4/int2 keys (their groups), pre-RoPE keys
    (un-rotated by position first)."""
    import subspace_ref as sr

    H, d, r = 2, 16, 4
    B = np.stack([np.linalg.qr(rng.standard_normal((d, r)))[0].T for _ in range(H)])
    state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, B, [0.7, 1.3]), batch=1, coefficients="int4", group_size=8)
    state.append(rng.standard_normal((1, H, 9, d)), rng.standard_normal((1, H, 9, d)))
    lay = state.to("triton", device=DEVICE, dtype="float32").layout
    ws = workspace.DecodeWorkspace(lay, H, torch.float32, fixed_tail=True)
    k = torch.zeros(1, H, 1, d, device=DEVICE)
    with pytest.raises(ValueError, match="float or int8 coefficients"):
        ws.append(k, k)
    rope_state, rope, pre_keys, pre_values = pre_rope_stream(rng, "float", 4)
    rope_state.append(pre_keys[:, :, :8], pre_values[:, :, :8])
    rope_ws = workspace.DecodeWorkspace(rope_state.to("triton", device=DEVICE, dtype="float32").layout, 4, torch.float32, rope=rope)
    with pytest.raises(ValueError, match="pre-RoPE keys are un-rotated first"):
        rope_ws.append(torch.zeros(2, 2, 1, 32, device=DEVICE), torch.zeros(2, 2, 1, 32, device=DEVICE))
    # int8 on one side without its scales (what append passes a float/int8 layout) is refused by the append kernel's launch
    bases, chunk = torch.zeros(1, H, 1, r, d, device=DEVICE), torch.zeros(1, H, dtype=torch.int64, device=DEVICE)
    codes, floats = torch.zeros(1, H, 1, r, dtype=torch.int8, device=DEVICE), torch.zeros(1, H, 1, r, device=DEVICE)
    with pytest.raises(ValueError, match="int8 outputs need both"):
        project.project_launch(k, k, bases, bases, chunk, floats, codes)


@needs_triton
def test_device_token_count_with_low_bit_coefficients(rng):
    """int4 (spec/quantization.md Q2) with the token count read on the device: the boundary
    between coded key groups and the float tail follows it (T inside a group, at a group's end),
    equal to the host-count launch; the workspace, whose graph would keep a stale key_tail
    address, refuses such layouts."""
    import subspace_ref as sr

    H, d, r, G = 2, 16, 5, 8
    B = np.stack([np.linalg.qr(rng.standard_normal((d, r)))[0].T for _ in range(H)])
    q = torch.as_tensor(rng.standard_normal((1, H * 2, d)), dtype=torch.float32, device=DEVICE)
    for T in (5, 16, 29):
        state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, B, [0.7, 1.3]), batch=1, coefficients="int4", group_size=G)
        state.append(rng.standard_normal((1, H, T, d)), rng.standard_normal((1, H, T, d)))
        lay = state.to("triton", device=DEVICE, dtype="float32").layout
        outputs = decode.split_launch(q, lay, 0.25, 0, 2, num_tokens=torch.full((1,), T, dtype=torch.int64, device=DEVICE))
        outputs[0].run()
        got = decode.merge_partials(*outputs[1], torch.float32)
        torch.testing.assert_close(got, decode.decode_attention(q, lay, 0.25), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="int4/int2"):
        workspace.DecodeWorkspace(lay, H * 2, torch.float32)


@needs_triton
def test_device_token_count_needs_a_fixed_split_count(rng):
    lay = chunked_layout(rng, 1, 1, 10, 16, 2, [0])
    with pytest.raises(ValueError, match="num_splits"):
        decode.split_launch(torch.zeros(1, 1, 16), lay, 1.0, 0, None, num_tokens=torch.ones(1, dtype=torch.int64))


BAD_DEVICE_COUNTS = {  # a count the kernel cannot read through its pointer (a host tensor on a GPU: Triton refuses it at launch)
    "another device": lambda: torch.ones(1, dtype=torch.int64, device="meta"),
    "float": lambda: torch.ones(1),
    "two elements": lambda: torch.ones(2, dtype=torch.int64),
    "bool": lambda: torch.ones(1, dtype=torch.bool),
    "int16": lambda: torch.ones(1, dtype=torch.int16),
    "an int": lambda: 10,
    "a numpy array": lambda: np.ones(1, dtype=np.int64),
}


@needs_triton
@pytest.mark.parametrize("count", BAD_DEVICE_COUNTS.values(), ids=BAD_DEVICE_COUNTS.keys())
def test_device_token_count_must_be_one_integer_on_qs_device(count, rng):
    """Both split kernels' launchers refuse a device count that is not a one-element integer tensor
    on q's device, naming it (ValueError, not a failed or wrong launch)."""
    lay = chunked_layout(rng, 1, 1, 10, 16, 2, [0])
    with pytest.raises(ValueError, match="num_tokens must be a one-element int32 or int64 torch tensor on q's device"):
        decode.split_launch(torch.zeros(1, 1, 16), lay, 1.0, 0, 2, num_tokens=count())
    state, rope, keys, values = pre_rope_stream(rng, "float", 8, 1, 1, 32, tokens=4)
    state.append(keys, values)
    rlay = state.to("triton", device=DEVICE, dtype="float32").layout
    with pytest.raises(ValueError, match="num_tokens must be a one-element int32 or int64 torch tensor on q's device"):
        rope_decode.split_launch(torch.zeros(1, 2, 32, device=DEVICE), rlay, rope, 1.0, 0, num_tokens=count(), num_splits=2)


# ------------------------------------------------------------------------------ graph-capturable pre-RoPE decode


def pre_rope_stream(rng, coefficients, r, N=2, H=2, d=32, rotary=24, tokens=320):
    """A batched pre-RoPE static state (spec/rope.md P2-P3; partial rotary: fixed dims beside the
    planes), empty, its RopeParams and ``tokens`` post-RoPE keys near the basis span and values to
    append, as tests/test_rope_decode.py builds them."""
    import subspace_ref as sr
    from subspace_ref.rope import RopeParams, rotate

    rope = RopeParams(1.0 / 50.0 ** (np.arange(0, rotary, 2) / rotary), "half", 1.0)
    orthonormal = lambda: np.swapaxes(np.linalg.qr(rng.standard_normal((H, d, r)))[0], -1, -2)  # noqa: E731
    basis = sr.StaticBasis.from_bases(orthonormal(), orthonormal(), gamma=1.3)
    state = sr.SubspaceState.static(basis, batch=N, rope=rope, coefficients=coefficients)
    pre = np.einsum("nhtr,hrd->nhtd", rng.standard_normal((N, H, tokens, r)) * 3, basis.B) + 0.05 * rng.standard_normal((N, H, tokens, d))
    return state, rope, rotate(pre, np.arange(tokens), rope), rng.standard_normal((N, H, tokens, d))


def copy_live(dst, src):
    """``src``'s live arrays written into the first rows of ``dst``'s (a layout at a larger capacity):
    what a graph cache's in-place appends leave in the arrays a captured step reads."""
    for name, x in src.live_arrays().items():
        getattr(dst, name)[tuple(slice(0, n) for n in x.shape)].copy_(x)


@needs_triton
@pytest.mark.parametrize("floor", ["min-split", "one-tile"])
@pytest.mark.parametrize("coefficients, dtype, r", [("float", "float32", 8), ("int4", "float32", 8), ("int4", "bfloat16", 16)])
def test_pre_rope_workspace_follows_the_device_token_count(coefficients, dtype, r, floor, rng, monkeypatch):
    """A pre-RoPE workspace (spec/rope.md P3, spec A3.2): grid and angle tables fixed by the capacity,
    the layout's arrays written in place (the int4 key tail too, ``fixed_tail``), the token count set
    on the device: at T inside one tile, across tiles, across the split boundary (256 tokens: the
    device split length's floor) and at the capacity, every step equals the float64 oracle of the
    stored state within the harness's tolerance in that dtype; with the floor lowered to one tile
    (three splits), split lengths of whole tiles above it (splits starting inside the table). int4
    (spec/quantization.md Q2): counts off the key groups (the tail read); bfloat16 int4: code words
    with a row of scales per key group (``GROUP_ROWS``), under the GPU's 16-bit arithmetic
    (tests/triton_numerics.py)."""
    import subspace_ref as sr
    from subspace_ref.arrays import to_numpy
    from tests.differential.tolerance import reference_error, tolerance
    from tests.triton_numerics import gpu_numerics

    N, H, g, d, capacity = 2, 2, 2, 32, 320
    state, rope, keys, values = pre_rope_stream(rng, coefficients, r, N, H, d, tokens=capacity)
    state.append(keys[:, :, :3], values[:, :, :3])
    lay = state.to("triton", device=DEVICE, dtype=dtype).layout.with_capacity(capacity, 1)
    count = torch.full((1,), 3, dtype=torch.int64, device=DEVICE)
    if floor == "one-tile":
        monkeypatch.setattr(rope_decode, "MIN_SPLIT_TOKENS", 1)  # rounded up to the tile
    ws = workspace.DecodeWorkspace(lay, H * g, getattr(torch, dtype), num_tokens=count, fixed_tail=coefficients != "float", rope=rope,
                                   num_splits=3 if floor == "one-tile" else None)
    assert ws.num_splits == (3 if floor == "one-tile" else 2) and ws.tables.split_len is None
    qt = torch.as_tensor(rng.standard_normal((N, H * g, d)) * 2, dtype=getattr(torch, dtype), device=DEVICE)
    q64 = to_numpy(qt.float()).astype(np.float64)
    split = ws.launches(qt)[0]
    assert split.constexprs["DEVICE_T"] and split.constexprs["GROUP_ROWS"] == (dtype == "bfloat16")
    assert split.constexprs["MIN_SPLIT"] == (split.constexprs["BLOCK_T"] if floor == "one-tile" else 256)
    done = 3
    for T in (5, 40, 100, 270, capacity):
        state.append(keys[:, :, done:T], values[:, :, done:T])
        done = T
        stored = state.to("triton", device=DEVICE, dtype=dtype)
        copy_live(lay, stored.layout)
        count.fill_(T)
        with gpu_numerics(monkeypatch) if dtype == "bfloat16" else contextlib.nullcontext():
            got = to_numpy(ws.attend(qt).float()).astype(np.float64)
        state64 = stored.to("numpy", dtype=np.float64)
        want = sr.attend(q64, state64)
        err, tol = np.abs(got - want).max(), tolerance(reference_error(state64, q64, None, want, dtype), want, dtype)
        assert err <= tol, (T, err, tol)


@needs_triton
@pytest.mark.parametrize("coefficients", ["float", "int4"])
def test_pre_rope_workspace_step_has_no_sync_and_no_allocation(coefficients, rng, monkeypatch):
    """The pre-RoPE step (bfloat16: the tensor-core kernel's constexprs; int4 code words) allocates
    nothing and reads nothing on the host, also with the layout's arrays replaced (a compiled
    graph's operator): one split launch with the device count (``DEVICE_T``), the workspace's
    tables and partials, and the merge."""
    N, H, g, d, capacity = 2, 2, 2, 32, 320
    state, rope, keys, values = pre_rope_stream(rng, coefficients, 16, N, H, d, tokens=40)
    state.append(keys, values)
    lay = state.to("triton", device=DEVICE, dtype="bfloat16").layout.with_capacity(capacity, 1)
    count = torch.full((1,), 40, dtype=torch.int64, device=DEVICE)
    ws = workspace.DecodeWorkspace(lay, H * g, torch.bfloat16, num_tokens=count, fixed_tail=True, rope=rope)
    q = torch.zeros(N, H * g, d, dtype=torch.bfloat16, device=DEVICE)
    other = replace(lay, key_coef=lay.key_coef.clone(), value_coef=lay.value_coef.clone())
    other_count = count.clone()
    with no_sync_no_alloc(monkeypatch) as launches:
        out = ws.attend(q)
        ws.advance()
        ws.attend(q, other, other_count)
    assert out is ws.out and len(launches) == 4
    for (split, merge), (kc, n_tok) in zip((launches[:2], launches[2:]), ((lay.key_coef, count), (other.key_coef, other_count))):
        assert split.kernel is rope_decode._rope_mma_kernel and split.grid == (N * H, ws.num_splits) and merge.grid == (N * H * g, -(-d // decode.MERGE_COLUMNS))
        assert split.constexprs["DEVICE_T"] and split.constexprs["MIN_SPLIT"] % split.constexprs["BLOCK_T"] == 0
        assert split.args[1] is kc and split.args[17] is n_tok
        assert all(a is t for a, t in zip(split.args[11:14], (ws.tables.order, ws.tables.offsets, ws.tables.bases)))
        assert all(a is p for a, p in zip(split.args[14:17], ws.partials)) and merge.args[3] is ws.out
    assert bool(split.constexprs["K_WORDS"]) == (coefficients == "int4")


@needs_triton
def test_pre_rope_eager_launches_reuse_their_tables(rng):
    """A host-count launch takes its RoPE tables from rope_decode.cached_rope_tables: the same
    tensors again for the same split (no host array copied per call), others for another split or
    first position, at most TABLES_KEPT per rope; a refused launch leaves them as they were."""
    state, rope, keys, values = pre_rope_stream(rng, "float", 8, 1, 1, 32, tokens=100)
    state.append(keys, values)
    lay = state.to("triton", device=DEVICE, dtype="bfloat16").layout
    q = torch.zeros(1, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    tables = lambda split_len, first=0: rope_decode.split_launch(q, lay, rope, 1.0, split_len, first)[0].args[11:14]  # noqa: E731
    first = tables(64)
    assert all(a is b for a, b in zip(first, tables(64)))
    assert tables(32)[2] is not first[2] and tables(64, first=4)[2] is not first[2]
    for split_len in range(128, 128 + 16 * rope_decode.TABLES_KEPT, 16):  # TABLES_KEPT others after 64
        tables(split_len)
    assert len(rope_decode._TABLES[rope]) == rope_decode.TABLES_KEPT
    assert tables(64)[2] is not first[2]  # dropped as least recent, built again
    kept = list(rope_decode._TABLES[rope].items())
    for bad in (dict(warp_softmax="yes"), dict(block_t=32, num_warps=4, warp_softmax=True), dict(key_parts=3)):  # refused: the cache as it was
        with pytest.raises(ValueError, match="warp_softmax|key_parts"):
            rope_decode.split_launch(q, lay, rope, 1.0, 48, **bad)
        assert list(rope_decode._TABLES[rope].items()) == kept


@needs_triton
def test_cached_rope_tables_are_refused_under_graph_capture(rng, monkeypatch):
    """A launch being captured in a CUDA graph gets no kept tables (one the cache drops later would
    be freed under the graph): a ValueError pointing to tables of its own."""
    rope = pre_rope_stream(rng, "float", 8, 1, 1, 32, tokens=4)[1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="tables of its own"):
        rope_decode.cached_rope_tables(rope, 32, 64, "cuda", capacity=128)
    assert rope not in rope_decode._TABLES


@needs_triton
def test_pre_rope_device_token_count_refusals(rng):
    """A device count needs a fixed split count; the legacy kernel and the one-launch merge are not
    built for it (ValueError, not a wrong launch)."""
    state, rope, keys, values = pre_rope_stream(rng, "float", 8, 1, 1, 32, tokens=4)
    state.append(keys, values)
    lay = state.to("triton", device=DEVICE, dtype="float32").layout
    q, count = torch.zeros(1, 2, 32, device=DEVICE), torch.full((1,), 4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="num_splits"):
        rope_decode.split_launch(q, lay, rope, 1.0, 0, num_tokens=count)
    with pytest.raises(ValueError, match="legacy"):
        rope_decode.split_launch(q, lay, rope, 1.0, 0, num_tokens=count, num_splits=2, legacy=True)
    with pytest.raises(ValueError, match="do not fit"):  # a host launch's per-split tables
        rope_decode.split_launch(q, lay, rope, 1.0, 0, num_tokens=count, num_splits=2, tables=rope_decode.rope_tables(rope, 32, rope_decode.FP32_BLOCK_T, DEVICE, num_splits=2, split_len=64))
    with pytest.raises(ValueError, match="fused_merge"):
        workspace.DecodeWorkspace(lay, 2, torch.float32, num_tokens=count, fused_merge=True, rope=rope)


@needs_triton
def test_resident_programs_reads_the_compiled_kernel(monkeypatch):
    """On a GPU the split count uses the compiled kernel's registers and shared memory: the
    runtime path with a stand-in for Triton's compiled kernel and the device's properties."""
    class Compiled:
        n_regs, metadata = 146, type("Meta", (), {"shared": 13312})

        def _init_handles(self):
            pass

    class Kernel:
        fn = decode._decode_split_kernel.fn

        def warmup(self, *args, grid, num_warps, **constexprs):
            assert grid == (8, 1) and num_warps == 4 and "BLOCK_T" in constexprs
            caps.append(constexprs.get("maxnreg"))
            return Compiled()

    caps = []

    props = type("Props", (), dict(name="H100", major=9, minor=0, multi_processor_count=132, regs_per_multiprocessor=65536,
                                   max_threads_per_multi_processor=2048, shared_memory_per_multiprocessor=228 * 1024))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(decode, "_RESIDENT", {})
    launch = Launch(Kernel(), (8, 1), (), dict(BLOCK_T=32), 4)
    assert decode.resident_programs(launch, "cuda:0") == 3  # 146 registers x 4 warps: 3 per SM
    # a register cap reaches the compile (Triton's maxnreg), cached apart from the uncapped kernel
    assert decode.resident_programs(Launch(Kernel(), (8, 1), (), dict(BLOCK_T=32), 4, 96), "cuda:0") == 3
    assert caps == [None, 96]
    assert decode.default_split_len(32768, 8, "cuda:0", 3) == -(-32768 // (3 * 132 // 8) // 64) * 64
    assert decode.default_split_len(32768, 8, "cuda:0") == -(-32768 // (decode.FALLBACK_RESIDENT * 132 // 8) // 64) * 64


@needs_triton
def test_split_kernel_splits_follow_the_compiled_occupancy(monkeypatch):
    """Without a split length the split kernel's eager call (two launches, or the fused merge) sizes
    its splits for the programs per SM of its own launch as compiled (decode.sized_launch): the first
    call of a configuration builds again when the compiled figure differs from the one assumed,
    later calls build once; the fused merge, other launch keywords and other tiles have figures of
    their own (no rounding to the tile: the split kernel's splits need none); a tensor keyword keeps
    no figure; a given split length is built once as given."""
    from subspace_ref_triton import gpu_report

    lay = gpu_report._layout(torch, 300, 64, 16, torch.float32, "float")
    q = torch.zeros(1, gpu_report.H_KV * 2, 64)
    built, real = [], decode.split_launch
    monkeypatch.setattr(decode, "_RESIDENT_SEEN", {})
    monkeypatch.setattr(decode, "resident_programs", lambda launch, device: 3 if launch.constexprs["BLOCK_T"] == 64 else 5)
    monkeypatch.setattr(decode, "default_split_len", lambda T, programs, device, resident: 64 * resident)
    monkeypatch.setattr(decode, "split_launch", lambda *a, **kw: built.append((a[3], "fused" in kw)) or real(*a, **kw))

    def calls(fused, **kw):
        built.clear()
        if fused:
            decode.decode_attention(q, lay, 0.1, fused_merge=True, **kw)
        else:
            decode.attention_partials(q, lay, 0.1, **kw)
        return [s for s, f in built if f == fused]

    for fused in (False, True):  # the fused launch does not inherit the two-launch figure
        assert calls(fused) == [128, 192] and len(built) == 2
        assert calls(fused) == [192]
        assert calls(fused, block_t=128) == [128, 320]  # another configuration: its own figure, not rounded to 128
        assert calls(fused, split_len=96) == [96]
    seen = dict(decode._RESIDENT_SEEN)
    assert len(seen) == 4
    out = torch.empty(1, q.shape[1], 64)
    for _ in range(2):  # an output tensor: no figure kept (nor the tensor), two builds each call
        assert calls(True, out=out) == [128, 192]
    assert decode._RESIDENT_SEEN == seen


@needs_triton
def test_centred_low_bit_tiles_take_two_key_groups_by_default():
    """int4/int2 in the centred form (docs/gpu.md, "Static budgets, fifth pass"): the default tile
    is two key groups (PAIRS; 8-byte int2 rows as 64-bit loads, WIDE_CODES); an explicit block_t
    keeps its meaning: the key group is one group a tile, twice the group the per-code path."""
    from subspace_ref_triton import gpu_report

    for coef, wide in (("int4", False), ("int2", True)):
        lay = gpu_report._layout(torch, 512, 128, 32, torch.bfloat16, coef)
        q = torch.zeros(1, gpu_report.H_KV * 4, 128, dtype=torch.bfloat16)
        G = int(lay.group)
        default = decode.split_launch(q, lay, 0.1, 256, 2)[0].constexprs
        assert default["CENTRED"] and default["PAIRS"] and default["BLOCK_T"] == 2 * G and default["WIDE_CODES"] == wide
        one = decode.split_launch(q, lay, 0.1, 256, 2, block_t=G)[0].constexprs
        assert one["CENTRED"] and not one["PAIRS"] and one["BLOCK_T"] == G
        per_code = decode.split_launch(q, lay, 0.1, 256, 2, block_t=2 * G)[0].constexprs
        assert not per_code["CENTRED"] and not per_code["PAIRS"]
        heads = decode.split_launch(q, lay, 0.1, 256, 2, tokens_m=False)[0].constexprs
        assert heads["CENTRED"] and not heads["PAIRS"] and heads["BLOCK_T"] == G
