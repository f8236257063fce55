"""The harness fails a backend with a known bug (mutants of the torch backend): a check that it
checks. Each mutant is registered for the duration of one test only."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import subspace_ref.registry as registry  # noqa: E402
from subspace_ref_torch import TorchBackend  # noqa: E402
from subspace_ref_torch import attend as A  # noqa: E402

from .cases import CASES  # noqa: E402
from .harness import Target  # noqa: E402
from .test_attend import _check  # noqa: E402


def _pipeline(q, state, scale, bug=None):
    """The torch backend's attend, with one bug switched on."""
    N, Hq, d = q.shape
    H = state.heads
    lay = state.layout
    dtype = A.work_dtype(q, state)
    J = A.used_chunks(state)
    if bug == "gqa_interleaved":  # query head h_q read as KV head h_q % H instead of h_q // g
        q = q.reshape(N, Hq // H, H, d).transpose(1, 2).reshape(N, Hq, d)
    qp = A.project_queries(q, state, scale, J, dtype)
    if bug == "no_gamma":
        qp = qp / lay.gamma.to(dtype)[None, :, None, None, None]
    if bug == "half_precision_projection":
        qp = qp.to(torch.float16).to(dtype)
    index = A.token_chunk_index(state, J) if J > 1 else None
    if bug == "chunk_off_by_one":
        index = (index + 1).clamp(0, J - 1)
    if bug == "reads_capacity":  # uses every allocated row, not num_tokens
        w = torch.softmax(torch.matmul(qp[:, :, 0], lay.key_coef.to(dtype).mT), dim=-1)
        out = torch.matmul(torch.matmul(w, lay.value_coef.to(dtype)), lay.value_bases[:, :, 0].to(dtype))
        return out.reshape(N, Hq, -1).to(q.dtype)
    logits = A.coefficient_logits(qp, state, index)
    if bug == "no_rescale":  # per-chunk maxima, never rescaled to the global one (spec A3 step 2.2)
        g, T = logits.shape[2], logits.shape[3]
        idx = index[:, :, None, :].expand(N, H, g, T)
        m = torch.full((N, H, g, J), float("-inf"), dtype=dtype).scatter_reduce(3, idx, logits, "amax")
        w = torch.exp(logits - m.gather(3, idx))
        Z = w.sum(-1, keepdim=True)
    else:
        w, Z = A.softmax_weights(logits)
    out = A.apply_value_bases(A.chunk_value_coefficients(w, state, J, index), state) / Z
    return out.reshape(N, Hq, -1).to(q.dtype)


MUTANTS = {  # bug -> (case, dtype) where it must be caught
    "gqa_interleaved": ("static-N2-gqa4-r_eq_d", "float32"),
    "chunk_off_by_one": ("adaptive-T_5L+1-N2", "float32"),
    "no_gamma": ("rotating-head_ranks", "float64"),
    "no_rescale": ("adaptive-head_ranks", "float32"),
    "reads_capacity": ("static-scale", "float32"),
    "half_precision_projection": ("static-N2-gqa4-r_eq_d", "float32"),
}


def _register(monkeypatch, name, bug):
    cls = type(name, (TorchBackend,), {"name": name, "attend": lambda self, q, s, sc: _pipeline(q, s, sc, bug)})
    monkeypatch.setitem(registry._added, name, cls)


@pytest.mark.parametrize("bug", sorted(MUTANTS))
def test_mutant_is_caught(monkeypatch, bug):
    case_name, dtype = MUTANTS[bug]
    case = next(c for c in CASES if c.name == case_name)
    _register(monkeypatch, f"mutant-{bug}", bug)
    with pytest.raises((AssertionError, ValueError)):  # ValueError: attend refuses a non-finite output
        _check(Target(f"mutant-{bug}", "cpu", dtype), case, record=False)
    _register(monkeypatch, "unmutated", None)  # the same pipeline without the bug passes
    _check(Target("unmutated", "cpu", dtype), case, record=False)


# Mutants of the triton backend's inputs for the int4/int2 and exact-token cases: each corrupts
# what the kernels read in a way an implementation could (a layout misread), and the harness
# must fail it on the named case.
def _swap_code_order(state):
    """Codes read high nibble / high pair first (spec/quantization.md Q1 puts code 0 lowest)."""
    lay = state.layout
    bits = lay.low_bits
    per, mask = 8 // bits, (1 << bits) - 1
    for name in ("key_coef", "value_coef"):
        x = getattr(lay, name).to(torch.int32)
        swapped = sum((((x >> (i * bits)) & mask) << ((per - 1 - i) * bits)) for i in range(per))
        setattr(lay, name, swapped.to(torch.uint8))


def _tail_dropped(state):
    """The unfinished key group read as zeros (as if only complete groups existed)."""
    state.layout.key_tail = torch.zeros_like(state.layout.key_tail)


def _sinks_dropped(state):
    """Attention sinks left out of the softmax (spec/window.md W8)."""
    from dataclasses import replace

    win = state.window
    state.window = replace(win, sink_keys=win.sink_keys[:, :, :0], sink_values=win.sink_values[:, :, :0])


TRITON_MUTANTS = {  # mutation -> (case, dtype) where it must be caught
    "swap_code_order": (_swap_code_order, "static-int4-N2-gqa4-G8", "float32"),
    "swap_code_order_int2": (_swap_code_order, "adaptive-int2-G8", "bfloat16"),
    "tail_dropped": (_tail_dropped, "static-int4-N2-gqa4-G8", "float16"),
    "sinks_dropped": (_sinks_dropped, "static-sinks-only-logits1e4", "float32"),
}


def _register_triton(monkeypatch, name, mutate):
    from subspace_ref_triton import TritonBackend

    def attend(self, q, state, scale):
        if mutate is not None:
            state = state.copy()
            mutate(state)
        return TritonBackend.attend(self, q, state, scale)

    monkeypatch.setitem(registry._added, name, type(name, (TritonBackend,), {"name": name, "attend": attend}))


@pytest.mark.parametrize("mutant", sorted(TRITON_MUTANTS))
def test_triton_mutant_is_caught(monkeypatch, mutant):
    from subspace_ref_triton import TritonBackend

    available = TritonBackend().availability()
    if not available or TritonBackend().devices[0] != "cpu":
        pytest.skip(f"the triton kernels do not run on the CPU here: {available.reason or 'compiled for the GPU'}")
    mutate, case_name, dtype = TRITON_MUTANTS[mutant]
    case = next(c for c in CASES if c.name == case_name)
    _register_triton(monkeypatch, f"triton-mutant-{mutant}", mutate)
    with pytest.raises(AssertionError, match=r"max \|backend - oracle64\|"):  # the tolerance, not a refusal
        _check(Target(f"triton-mutant-{mutant}", "cpu", dtype), case, record=False)
    _register_triton(monkeypatch, "triton-unmutated", None)  # the same inputs unmutated pass
    _check(Target("triton-unmutated", "cpu", dtype), case, record=False)
