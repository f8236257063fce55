"""The graph cache's quantised (int8, int4, int2) and pre-RoPE decode through the Triton kernels
as a torch operator (spec/models.md M11.6, M11.8, M11.10; ``subspace_ref_triton.graph_op``), on
Triton's CPU interpreter as the kernel tests run.

* One layer's kernel decode against the float64 oracle over the layer's own stored arrays
  (codes, scales, zero points, key tail), held to the differential harness's one rule
  (tests/differential/tolerance.py), in float32, bfloat16 and float16, with unwritten slots.
* ``torch.compile(fullgraph=True)`` traces generate's decode step through the operator (a graph
  break fails the compile) and gives the eager tokens; the kernel ran in every compiled step,
  and a new cache reuses the compiled graph.
* A left-padded batch hides written slots, which the kernel does not read: the layer decodes by
  SDPA instead; both forms match the numpy oracle cache.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.triton_interpreter import _interpreter_environment, load_kernels  # noqa: F401  (an autouse fixture)

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)
_AVAILABLE, DEVICE, (workspace,) = load_kernels("workspace")

from torch._dynamo.utils import counters  # noqa: E402

import subspace_ref as sr  # noqa: E402
from subspace_ref.hf import GraphSubspaceCache, SubspaceCache, graph_storage, static_states, use_subspace_attention  # noqa: E402
from subspace_ref.layout import BY_NAME, GROUP, TOKEN  # noqa: E402
from tests.differential.tolerance import reference_error, tolerance  # noqa: E402
from tests.test_graph_cache import compiled_against_eager, ids_of, make_model, mixed_layer_states, random_bases  # noqa: E402

pytestmark = pytest.mark.skipif(not _AVAILABLE, reason=f"triton backend unavailable: {_AVAILABLE.reason}")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Count the workspace steps the operator runs (eager or inside a compiled step)."""
    calls = []
    original = workspace.DecodeWorkspace.attend

    def counted(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(workspace.DecodeWorkspace, "attend", counted)
    return calls


def adopt_written(state64, layout, T: int) -> None:
    """Put the arrays a graph layer stored for its first T tokens (codes, scales, zero points, the
    key tail, float coefficients as rounded) into the float64 oracle state of the same tokens."""
    for name, x in graph_storage.sequence_arrays(layout).items():
        target = getattr(state64.layout, name)
        axis = BY_NAME[name].axis
        k = T if axis == TOKEN else T // layout.group if axis == GROUP else x.shape[2]
        src = x[:, :, :k].cpu()
        target[:, :, :k] = (src.float() if src.dtype == torch.bfloat16 else src).numpy().astype(target.dtype)


FORMATS = {"int8": "int8", "float-int8": ("float", "int8"), "int8-float": ("int8", "float"), "int4": "int4", "int2": "int2", "int4-int8": ("int4", "int8")}


PRE_ROPE = {"pre-RoPE float": "float", "pre-RoPE int8": "int8", "pre-RoPE int4": "int4"}


@pytest.mark.parametrize("coefficients", list(FORMATS) + list(PRE_ROPE))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_kernel_decode_within_the_harness_tolerance(dtype, coefficients, kernel_calls):
    """One layer's decode through the operator against the float64 oracle over the layer's own
    stored arrays (the oracle state holds them as written), held to the differential harness's
    rule. The layer stores 30 tokens in one block, then 10 one at a time (a low-bit key group of
    32 completes in the per-token writer), and holds unwritten slots. Pre-RoPE states (M11.10)
    run the pre-RoPE kernel, its base angles from the capacity's table."""
    torch_dtype = getattr(torch, dtype)
    model = make_model("llama", torch_dtype).to(DEVICE)
    H, d, T, Hq, N = 2, 16, 40, 4, 2
    rng = np.random.default_rng(11)
    basis = random_bases(model)[0]
    rope = sr.rope.RopeParams.from_config(model.config) if coefficients in PRE_ROPE else None
    empty = sr.SubspaceState.static(basis, batch=N, dtype=np.float64, coefficients=PRE_ROPE.get(coefficients, FORMATS.get(coefficients)), rope=rope)
    cache = GraphSubspaceCache(model.config, [empty, empty], max_cache_len=T + 9)  # unwritten slots the kernel must not read
    K, V, q = (torch.as_tensor(rng.standard_normal(shape)).to(torch_dtype).to(DEVICE) for shape in ((N, H, T, d), (N, H, T, d), (N, Hq, d)))
    layer = cache.layers[0]
    layer.update(K[:, :, :30], V[:, :, :30])
    for t in range(30, T):
        layer.update(K[:, :, t : t + 1], V[:, :, t : t + 1])
    scale = d**-0.5
    attention = model.model.layers[0].self_attn
    out = layer.attention_call(attention, q[:, :, None], None, scale, 0.0, {})[:, 0]
    assert len(kernel_calls) == 1 and layer.groups[0].workspace is not None

    state64 = empty.append(K.double().cpu().numpy(), V.double().cpu().numpy())
    adopt_written(state64, layer.groups[0].layout, T)
    q64 = q.double().cpu().numpy()
    out64 = np.asarray(sr.attend(q64, state64, backend="numpy", scale=scale))
    ref = reference_error(state64, q64, scale, out64, dtype)
    assert np.abs(out.double().cpu().numpy() - out64).max() <= tolerance(ref, out64, dtype)


@pytest.mark.parametrize("coefficients", ["int8", "int4", "pre-RoPE float", "pre-RoPE int4", "layer state", "windowed pre-RoPE int4", "windowed layer state"])
def test_compiled_generate_runs_the_kernel_without_graph_breaks(coefficients, kernel_calls):
    """generate compiles the decode step with the operator in it (fullgraph=True) and gives the
    eager tokens, whose top-2 margins are checked first; every compiled step ran the kernel once
    per layer (per head group of a layer state: M11.12), and a second generation on a new cache
    reuses the compiled graph. Pre-RoPE: the update un-rotates by device slots inside the
    compiled step (M11.10). Layer state: a pre-RoPE int4 head beside an identity int8 head.
    Windowed (M11.14): 4 sinks and 5 recent tokens written at device slots, the compressed part
    through the kernel, its merge launch adding them (M11.14 step 4)."""
    model = make_model("llama", torch.float32).to(DEVICE)
    bases = random_bases(model)
    ids = ids_of(10, 1).to(DEVICE)
    steps = 8
    use_subspace_attention(model)
    rope = sr.rope.RopeParams.from_config(model.config) if coefficients.startswith("pre-RoPE") else None
    # int4: key groups complete at 16 inside the compiled steps
    if coefficients.endswith("layer state"):
        factory, groups = mixed_layer_states(model, split=False, sinks=4 if coefficients.startswith("windowed") else 0,
                                             window=5 if coefficients.startswith("windowed") else 0), 2
    elif coefficients.startswith("windowed"):
        rope = sr.rope.RopeParams.from_config(model.config)
        factory, groups = static_states(bases, coefficients="int4", group_size=8, rope=rope, sinks=4, window=5), 1
    else:
        factory, groups = static_states(bases, coefficients=coefficients.removeprefix("pre-RoPE "), group_size=8, rope=rope), 1
    eager, compiled, _, compile_config = compiled_against_eager(model, factory, ids, steps)
    layers = model.config.num_hidden_layers * groups
    assert torch.equal(compiled, eager)
    assert len(kernel_calls) == 2 * layers * (steps - 1)  # the prefills attend by SDPA, each decode step, eager or compiled, through the kernel
    # a new cache's workspace is a new input of the same graph (graph_op's handle), not a recompile
    graphs = counters["stats"]["unique_graphs"]
    again = model.generate(ids, cache=GraphSubspaceCache(model.config, factory, max_cache_len=ids.shape[1] + steps), max_new_tokens=steps,
                           do_sample=False, compile_config=compile_config)
    assert torch.equal(again, eager) and counters["stats"]["unique_graphs"] == graphs
    assert len(kernel_calls) == 3 * layers * (steps - 1) and kernel_calls[-1] is not kernel_calls[0]


@pytest.mark.parametrize("coefficients", ["int8", "int4"])
@pytest.mark.parametrize("padded", [False, True])
def test_batch_decode_matches_the_oracle_cache(padded, coefficients, kernel_calls):
    """A batch of two prompts, prefill then one decode step, equal to the numpy oracle cache
    (1e-5 of the logits' scale, test_graph_cache's rule for Llama's float32 RMSNorm). Unpadded,
    the step runs the kernel; a padded prompt hides written slots from its queries, which the
    kernel (slots 0..T-1) cannot, so the layers note it at the prefill and decode by SDPA under
    the mask (M11.6)."""
    model = make_model("llama", torch.float32).to(DEVICE)  # float64 models have no kernel
    bases = random_bases(model)
    use_subspace_attention(model)
    ids = torch.cat([ids_of(9, 5), ids_of(9, 6)]).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = int(not padded)
    factory = static_states(bases, coefficients=coefficients, group_size=8)
    with torch.no_grad():
        graph_cache = GraphSubspaceCache(model.config, factory, max_cache_len=12)
        oracle_cache = SubspaceCache(model.config, factory, backend="numpy")
        logits = []
        for cache in (graph_cache, oracle_cache):
            first = model(input_ids=ids, attention_mask=mask, cache=cache).logits[:, -1]
            step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            second = model(input_ids=ids[:, -1:], attention_mask=step_mask, cache=cache).logits[:, -1]
            logits.append(torch.stack([first, second]))
    assert all(layer.groups[0].workspace is not None and layer.all_visible != padded for layer in graph_cache.layers)
    assert len(kernel_calls) == (0 if padded else model.config.num_hidden_layers)
    assert float((logits[0] - logits[1]).abs().max()) <= 1e-5 * float(logits[1].abs().max())


WINDOWED = [("float", 2, 3), ("float", 3, 0), ("float", 0, 3), ("float", 1, 1), ("int4", 2, 3), ("int4", 1, 1), ("layer state", 2, 3)]


@pytest.mark.parametrize("prompt", [2, 9])
@pytest.mark.parametrize(("coefficients", "sinks", "window"), WINDOWED, ids=[f"{c}-S{s}-W{w}" for c, s, w in WINDOWED])
def test_windowed_kernel_decode_matches_the_oracle_cache(coefficients, sinks, window, prompt, kernel_calls):
    """A windowed pre-RoPE layer (S sinks, W recent tokens; M11.14) decodes through the kernel,
    whose merge launch adds the exact sinks and ring to the compressed part: a prefill and 4
    decode steps equal the numpy oracle cache's logits (1e-5 of their scale, test_batch_decode's
    rule). A 2-token prompt decodes while the sinks and the ring fill (T_c = 0: the exact part
    alone, a prefix of the slots), then compresses; a 9-token one compresses every step. Sinks
    only (W = 0: the new token goes straight to the compressed part), a ring only, one of each.
    Layer state: two head groups of one KV head each, so the second reads exact row 1 for its
    head 0."""
    model = make_model("llama", torch.float32).to(DEVICE)
    rope = sr.rope.RopeParams.from_config(model.config)
    if coefficients == "layer state":
        factory, groups = mixed_layer_states(model, split=False, sinks=sinks, window=window), 2
    else:
        factory, groups = static_states(random_bases(model), coefficients=coefficients, group_size=4, rope=rope, sinks=sinks, window=window), 1
    use_subspace_attention(model)
    ids = ids_of(prompt, 5).to(DEVICE)
    with torch.no_grad():
        logits = []
        for cache in (GraphSubspaceCache(model.config, factory, max_cache_len=16), SubspaceCache(model.config, factory, backend="numpy")):
            out = [model(input_ids=ids, cache=cache).logits[:, -1]]
            for token in (3, 17, 40, 5):
                out.append(model(input_ids=torch.tensor([[token]], device=DEVICE), cache=cache).logits[:, -1])
            logits.append(torch.stack(out))
    assert len(kernel_calls) == 4 * model.config.num_hidden_layers * groups
    assert float((logits[0] - logits[1]).abs().max()) <= 1e-5 * float(logits[1].abs().max())
