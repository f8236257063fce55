"""The allocator's default loss (spec/layer_state.md L6.2): reconstruction errors weighted by the
gradient of the model's next-token loss, measured per (sinks, window) with only the queries that
read a token compressed counted, and the window chosen by that loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

from subspace_ref.allocation import side_losses  # noqa: E402
from subspace_ref.formats import of_bits  # noqa: E402


def _layer(rng, n=96, d=8):
    K = rng.standard_normal((n, d)) * np.linspace(2.0, 0.1, d)
    V = rng.standard_normal((n, d)) * np.linspace(1.5, 0.2, d)
    Wk = np.linalg.svd(K, full_matrices=False)[2]
    Wv = np.linalg.svd(V, full_matrices=False)[2]
    return dict(keys=K, keys_pre=None, values=V, positions=np.arange(n), Wk=Wk, Wk_pre=None, Wv=Wv)


def test_fisher_losses_are_mean_squared_gradient_products():
    rng = np.random.default_rng(0)
    layer = _layer(rng)
    K, V = layer["keys"], layer["values"]
    Gk, Gv = rng.standard_normal(K.shape), rng.standard_normal(V.shape)
    Q = rng.standard_normal((32, K.shape[1]))
    out = side_losses(layer, 0, Q, range(0, 9, 2), group=16, key_grads=Gk, value_grads=Gv)
    for r, b in ((2, 16), (4, 4), (6, 8)):
        dk = K - of_bits(b).reconstruct(K @ layer["Wk"][:r].T, "key", 16) @ layer["Wk"][:r]
        dv = V - of_bits(b).reconstruct(V @ layer["Wv"][:r].T, "value", 16) @ layer["Wv"][:r]
        assert out[("key", "post_rope")][(r, b)] == pytest.approx(np.mean(np.sum(dk * Gk, axis=1) ** 2), rel=1e-12)
        assert out[("value", "subspace")][(r, b)] == pytest.approx(np.mean(np.sum(dv * Gv, axis=1) ** 2), rel=1e-12)
    # a full-rank fp16 identity side loses (almost) nothing; rank 0 loses the whole projection
    assert out[("key", "identity")][(8, 16)] < 1e-6 * out[("key", "post_rope")][(0, 16)]
    assert out[("value", "subspace")][(0, 16)] == pytest.approx(np.mean(np.sum(V * Gv, axis=1) ** 2))
    # not the proxy: the proxy's tables differ
    proxy = side_losses(layer, 0, Q, range(0, 9, 2), group=16)
    assert proxy[("value", "subspace")][(2, 16)] != pytest.approx(out[("value", "subspace")][(2, 16)])


def test_errors_where_the_gradient_is_zero_cost_nothing():
    """Tokens whose key and value the loss does not depend on (zero gradient) do not count: the
    loss of any reconstruction is that of the other tokens alone."""
    rng = np.random.default_rng(1)
    layer = _layer(rng)
    n = len(layer["keys"])
    Gk, Gv = rng.standard_normal((n, 8)), rng.standard_normal((n, 8))
    Gk[: n // 2], Gv[: n // 2] = 0.0, 0.0
    full = side_losses(layer, 0, np.ones((4, 8)), [4], bits=(16,), identity=False, key_grads=Gk, value_grads=Gv)
    half = {k: v[n // 2 :] for k, v in layer.items() if k in ("keys", "values", "positions")}
    half = dict(layer, **half)
    rest = side_losses(half, 0, np.ones((4, 8)), [4], bits=(16,), identity=False, key_grads=Gk[n // 2 :], value_grads=Gv[n // 2 :])
    for side in full:
        assert full[side][(4, 16)] == pytest.approx(rest[side][(4, 16)] / 2)  # mean over n tokens, half of them zero


def test_stacked_gradients_give_one_table_per_set_and_bad_input_is_refused():
    rng = np.random.default_rng(2)
    layer = _layer(rng)
    G = [(rng.standard_normal((96, 8)), rng.standard_normal((96, 8))) for _ in range(3)]
    Q = rng.standard_normal((16, 8))
    stacked = side_losses(layer, 0, Q, [0, 4, 8], group=16, key_grads=np.stack([g[0] for g in G]), value_grads=np.stack([g[1] for g in G]))
    assert isinstance(stacked, list) and len(stacked) == 3
    for one, (gk, gv) in zip(stacked, G):
        alone = side_losses(layer, 0, Q, [0, 4, 8], group=16, key_grads=gk, value_grads=gv)
        assert one.keys() == alone.keys()
        for side in one:
            assert one[side] == pytest.approx(alone[side], rel=1e-12)
    with pytest.raises(ValueError, match="both"):
        side_losses(layer, 0, Q, [4], key_grads=G[0][0])
    with pytest.raises(ValueError, match="shapes"):
        side_losses(layer, 0, Q, [4], key_grads=G[0][0][:10], value_grads=G[0][1][:10])


# ------------------------------------------------------------------------------ on a model
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
    model = transformers.LlamaForCausalLM(config).eval()
    windows = np.random.default_rng(0).integers(0, 256, (3, 48))
    return model, windows


def _plain_gradients(model, windows):
    """The gradient of the summed next-token NLL with respect to every post-RoPE key and value
    through the model's own attention (autograd, another path than the probe)."""
    from subspace_ref.hf.attention import observe, subspace_attention_enabled

    out = {}
    for i in range(len(windows)):
        rec = {}

        def keep(m, q, k, v):
            k.retain_grad()
            v.retain_grad()
            rec[m.layer_idx] = (k, v)

        x = torch.as_tensor(windows[i : i + 1])
        with torch.enable_grad(), subspace_attention_enabled(model), observe(model, keep):
            logits = model(input_ids=x, use_cache=False).logits
            torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").backward()
        for li, (k, v) in rec.items():
            out.setdefault(li, ([], []))
            out[li][0].append(k.grad[0].double().numpy())
            out[li][1].append(v.grad[0].double().numpy())
    model.zero_grad(set_to_none=True)
    return [(np.concatenate(out[li][0], 1), np.concatenate(out[li][1], 1)) for li in sorted(out)]


def test_output_gradients_without_exact_tokens_are_the_plain_gradients(tiny):
    from subspace_ref.hf.calibration_losses import output_gradients

    model, windows = tiny
    before = model.config._attn_implementation
    [probe] = output_gradients(model, windows, 96)  # the first two windows
    plain = _plain_gradients(model, windows[:2])
    assert model.config._attn_implementation == before and not any(p.grad is not None for p in model.parameters())
    for (pk, pv), (qk, qv) in zip(probe, plain):
        assert pk.shape == qk.shape == (2, 96, 16)
        np.testing.assert_allclose(pk, qk, atol=1e-5 * np.abs(qk).max())
        np.testing.assert_allclose(pv, qv, atol=1e-5 * np.abs(qv).max())


def test_sinks_and_window_remove_the_queries_that_read_tokens_exactly(tiny):
    """Sinks get no gradient; in the last layer (no later layer to carry it) a value in the last
    ``window`` tokens of a window gets none either, and one further back does; the whole window
    exact (window >= T) leaves no gradient at all."""
    from subspace_ref.hf.calibration_losses import output_gradients

    model, windows = tiny
    T = windows.shape[1]
    some, none = output_gradients(model, windows, T, ((3, 10), (0, T)))
    for gk, gv in some:
        assert np.all(gk[:, :3] == 0) and np.all(gv[:, :3] == 0)
    gk, gv = some[-1]
    assert np.all(gv[:, T - 10 :] == 0) and np.all(gk[:, T - 10 :] == 0)
    assert np.abs(gv[:, 3 : T - 10]).min(axis=-1).max() > 0
    for gk, gv in none:
        assert np.all(gk == 0) and np.all(gv == 0)


def test_allocate_best_chooses_the_pair_of_least_loss(tiny):
    from subspace_ref.hf.calibration_losses import calibration_losses

    model, windows = tiny
    cal = calibration_losses(model, windows, ranks=range(0, 17, 4), group=8, batch=1, exact=((2, 0), (2, 4), (2, 8), (2, 30)))
    assert set(cal.by_exact) == {(0, 0), (2, 0), (2, 4), (2, 8), (2, 30)} and cal.loss == "fisher"
    assert cal.tables(0, 0) is cal.losses and cal.tables(2, 8) is cal.by_exact[(2, 8)] and cal.tables(1, 5) is cal.losses
    best = cal.allocate_best(model, compression_ratio=0.3)
    seen = best.meta["exact_losses"]
    assert seen["2,30"] is None  # 32 of 48 tokens exact: more than 30% of the bytes
    fitting = {k: v for k, v in seen.items() if v is not None}
    assert len(fitting) == 4
    for key, loss in fitting.items():
        s, w = map(int, key.split(","))
        assert cal.allocate(model, compression_ratio=0.3, sinks=s, window=w).calibration_loss == pytest.approx(loss)
    assert best.calibration_loss == min(fitting.values()) and f"{best.sinks},{best.window}" == min(fitting, key=fitting.get)
    proxy = calibration_losses(model, windows, ranks=range(0, 17, 4), group=8, batch=1, loss="proxy")
    assert proxy.by_exact is None and proxy.allocate_best(model, compression_ratio=0.3).window == 0
    with pytest.raises(ValueError, match="loss"):
        calibration_losses(model, windows, loss="kl")


def test_the_front_door_default_chooses_the_window_by_the_loss(tiny, tmp_path):
    from subspace_ref.hf.calibrate_checkpoint import calibrate_checkpoint

    model, _ = tiny
    model.save_pretrained(tmp_path / "ckpt")
    bases = calibrate_checkpoint(tmp_path / "ckpt", 0.3, context=64, tokens=640, group=8)
    a = bases.allocation
    seen = {k: v for k, v in a.meta["exact_losses"].items() if v is not None}
    assert bases.calibration["loss"] == "fisher" and (bases.calibration["sinks"], bases.calibration["window"]) == (a.sinks, a.window)
    assert f"{a.sinks},{a.window}" == min(seen, key=seen.get) and a.calibration_loss == min(seen.values())
    explicit = calibrate_checkpoint(tmp_path / "ckpt", 0.3, context=64, tokens=640, group=8, sinks=0, window=8)
    assert (explicit.allocation.sinks, explicit.allocation.window) == (0, 8) and "exact_losses" not in explicit.allocation.meta
    with pytest.raises(ValueError, match="loss"):
        calibrate_checkpoint(tmp_path / "ckpt", 0.3, loss="kl")


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Another spelling of the probe (spec L6.2): scores and outputs of the far pairs through the
    key and value, of the other pairs through detached copies; the query through every pair."""
    from subspace_ref.hf.calibration_losses import _PROBE

    probe = _PROBE[-1]
    key.retain_grad()
    value.retain_grad()
    probe["recorded"][module.layer_idx] = (key, value)
    T, g = query.shape[2], query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    i, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    far = (i - t >= probe["window"]) & (t >= probe["sinks"])
    s = torch.where(far, query @ k.mT, query @ k.detach().mT) * (scaling or query.shape[-1] ** -0.5)
    p = s.masked_fill(t > i, float("-inf")).softmax(-1)
    out = torch.where(far, p, 0.0) @ v + torch.where(far, 0.0, p) @ v.detach()
    return out.transpose(1, 2).contiguous(), None


def test_the_probe_matches_a_reference_and_keeps_the_stock_outputs(tiny, monkeypatch):
    """With sinks and a window, every layer's key and value gradients equal those of a reference
    spelling (so the queries still carry gradient from the exact pairs to earlier layers), and
    the probe's logits are the stock ones."""
    import importlib

    from subspace_ref.hf.calibration_losses import output_gradients

    CL = importlib.import_module("subspace_ref.hf.calibration_losses")  # the module (subspace_ref.hf exports a function of its name)

    model, windows = tiny
    [probe] = output_gradients(model, windows[:1], None, ((2, 6),))
    monkeypatch.setattr(CL, "_probe_attention", _reference_attention)
    [ref] = output_gradients(model, windows[:1], None, ((2, 6),))
    for (pk, pv), (rk, rv) in zip(probe, ref):
        np.testing.assert_allclose(pk, rk, atol=1e-5 * np.abs(rk).max())
        np.testing.assert_allclose(pv, rv, atol=1e-5 * np.abs(rv).max())
    assert np.abs(probe[0][0]).max() > 0
    monkeypatch.undo()
    from transformers import AttentionInterface

    x = torch.as_tensor(windows[:1])
    with torch.no_grad():
        stock = model(input_ids=x).logits
        AttentionInterface.register(CL.PROBE_ATTENTION, CL._probe_attention)
        previous = model.config._attn_implementation
        CL._PROBE.append(dict(sinks=2, window=6, recorded={}))
        try:
            model.set_attn_implementation(CL.PROBE_ATTENTION)
            probed = model(input_ids=x, use_cache=False).logits
        finally:
            CL._PROBE.pop()
            model.set_attn_implementation(previous)
    torch.testing.assert_close(probed, stock, atol=1e-4, rtol=1e-4)
