"""What every experiment subcommand shares: thread limits, the model, the corpus windows, the
settings profiles, JSON/CSV output, progress bars and figures.

Nothing here computes a result; the subcommands do (see the package docstring).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from subspace_ref.jsonable import jsonable as _jsonable
from subspace_ref.threads import limit_threads as _limit_threads, requested_threads
from subspace_ref.linalg import svd  # noqa: F401  (the runner's modules call C.svd)

#: Default output folder of every subcommand.
DEFAULT_OUT = Path("results/experiments")
#: Where ``report`` writes the page and its figures.
DEFAULT_DOCS = Path("docs")
#: Resolution of every figure: legible at 100% zoom (issue 20).
FIGURE_DPI = 150
#: A figure larger than this is stored with a 256-colour palette (same resolution; docs stay small).
MAX_FIGURE_BYTES = 200_000
#: Keyword arguments of ``legend`` that put it right of the axes, off the data.
LEGEND_OUTSIDE = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)

#: Seeds of the corpus windows: calibration bases and held-out calibration (gamma, tau) come from
#: the training split, evaluation from the held-out split (seed 0 = the training report's windows).
SEED_BASES, SEED_HOLDOUT_CALIB, SEED_EVAL = 1, 2, 0


# ----------------------------------------------------------------------------- threads
def limit_threads(n: int = 1) -> None:
    """At most ``n`` threads for BLAS (:func:`subspace_ref.threads.limit_threads`) and for torch,
    which the runner always loads."""
    import torch

    _limit_threads(n)
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- profiles
@dataclass(frozen=True)
class Profile:
    """Sizes of one run. Ranks are fractions of the head size d (rounded, at least 1)."""

    name: str
    calib_windows: int  # training-split windows for the bases
    holdout_windows: int  # training-split windows (other seed) for gamma and tau
    eval_windows: int  # held-out windows for perplexity: the unit every interval resamples
    spectra_windows: int
    context: int | None  # window length; None = the model's maximum
    rank_fractions: tuple[float, ...]  # uniform ranks for static states
    online_fractions: tuple[float, ...]  # ranks for adaptive and rotating states
    energies: tuple[float, ...]
    gammas: tuple[str, ...]  # for static states: unit, paper, mse
    sides: bool  # keys-only / values-only runs
    int8: bool
    sketch_resets: tuple[bool, ...]
    rotating: bool
    max_chunk: int
    refresh_every: int
    bounds_windows: int  # windows captured for the falsifier-4 correlations (the independent unit)
    bounds_fractions: tuple[float, ...]
    bounds_lengths: tuple[float, ...]  # prefix lengths as fractions of the context
    bounds_queries: int = 2  # query positions per head and state for falsifier 4 (the last, then evenly spaced)
    batch: int = 4
    paper_taus: tuple[float, ...] = ()  # extra adaptive runs at r ≈ d/4 with seed 001's "typical" τ
    pre_rope: bool = True  # static runs on a pre-RoPE key basis (seed 003 RoPE ablation)


PROFILES = {
    "full": Profile(
        name="full",
        calib_windows=8,
        holdout_windows=2,
        eval_windows=12,
        spectra_windows=4,
        context=None,
        rank_fractions=(1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 3 / 4),
        online_fractions=(1 / 8, 1 / 4, 1 / 2, 3 / 4),
        energies=(0.90, 0.95, 0.98, 0.99),
        gammas=("unit", "paper", "mse"),
        sides=True,
        int8=True,
        sketch_resets=(False, True),
        rotating=True,
        max_chunk=256,
        refresh_every=64,
        bounds_windows=4,
        bounds_fractions=(1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4),
        bounds_lengths=(1 / 4, 1 / 2, 1.0),
        paper_taus=(0.2,),
    ),
    "quick": Profile(
        name="quick",
        calib_windows=4,
        holdout_windows=1,
        eval_windows=2,
        spectra_windows=2,
        context=None,
        rank_fractions=(1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4),
        online_fractions=(1 / 4, 3 / 4),
        energies=(0.95, 0.99),
        gammas=("unit", "mse"),
        sides=False,
        int8=True,
        sketch_resets=(False, True),
        rotating=True,
        max_chunk=256,
        refresh_every=64,
        bounds_windows=1,
        bounds_fractions=(1 / 8, 1 / 4),
        bounds_lengths=(1 / 2, 1.0),
    ),
    "tiny": Profile(
        name="tiny",
        calib_windows=2,
        holdout_windows=1,
        eval_windows=2,
        spectra_windows=2,
        context=48,
        rank_fractions=(1 / 8, 1 / 4, 1 / 2),
        online_fractions=(1 / 4,),
        energies=(0.9, 0.99),
        gammas=("unit", "paper", "mse"),
        sides=True,
        int8=True,
        sketch_resets=(False, True),
        rotating=True,
        max_chunk=16,
        refresh_every=8,
        bounds_windows=1,
        bounds_fractions=(1 / 4, 1 / 2),
        bounds_lengths=(1 / 2, 1.0),
        batch=2,
        paper_taus=(0.2,),
    ),
}


def ranks_from(fractions: Iterable[float], d: int) -> list[int]:
    """Distinct ranks round(f d), clipped to [1, d], in increasing order."""
    return sorted({min(d, max(1, int(round(f * d)))) for f in fractions})


# ----------------------------------------------------------------------------- arguments
def add_common_arguments(parser: argparse.ArgumentParser, default_profile: str | None = "full") -> None:
    parser.add_argument(
        "--model", default="default", help='"default" (the shipped stdlib Llama), a local checkpoint folder, or "tiny-random" (a tiny random Llama, for tests)'
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=default_profile,
        help="sizes of the run: windows, ranks, variants (default " + (default_profile or "quick without --full, full with it") + "; tiny is for tests)",
    )
    parser.add_argument("--context", type=int, default=None, help="window length in tokens (default: the profile's, else the model's maximum)")
    parser.add_argument("--threads", type=int, default=1, help="torch and BLAS threads (default 1: fastest on a shared 2-core machine)")
    parser.add_argument("--backend", default="torch", help="backend for float states: torch (default) or numpy; INT8 states always use numpy")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


# ----------------------------------------------------------------------------- model
def tiny_random_llama(seed: int = 0):
    """A 2-layer random Llama (4 query / 2 KV heads of size 16, RoPE, bytes as tokens): the
    tests' stand-in for the shipped model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()
    return model, model.config


def _sha256(path: Path) -> str | None:
    try:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    except OSError:
        return None


def load_model(name: str):
    """``(model, facts)`` for ``--model``; facts describe it for the JSON outputs."""
    from subspace_ref.models import default_model as dm

    if name == "tiny-random":
        model, config = tiny_random_llama()
        facts = dict(name="tiny-random", description="tiny random Llama (tests only)", weights_sha256=None)
    else:
        model, config = dm.load_model(name)
        facts = dict(name=name, description=getattr(config, "model_type", "?"))
        if name in dm.DEFAULT_ALIASES:
            weights = dm.default_model_files()["model.safetensors"]
            facts["weights_sha256"] = _sha256(Path(str(weights)))
            try:
                rep = dm.load_training_report()
                ev = rep.get("evaluation", {})
                facts["training"] = dict(
                    heldout_bits_per_byte=ev.get("heldout_loss_bits_per_byte"),
                    total_steps=rep.get("training", {}).get("total_steps"),
                    tokens_seen=rep.get("training", {}).get("tokens_seen"),
                    ngram_bits_per_byte=ev.get("ngram_baseline", {}).get("heldout_loss_bits_per_byte"),
                )
            except (OSError, ValueError, KeyError):
                pass
            facts["description"] = "shipped byte-level Llama trained on the Python stdlib (subspace_ref/data/stdlib_llama)"
        else:
            facts["weights_sha256"] = None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    d = getattr(text, "head_dim", None) or text.hidden_size // heads
    facts.update(
        model_type=text.model_type,
        layers=text.num_hidden_layers,
        query_heads=heads,
        kv_heads=kv,
        head_dim=d,
        max_context=int(getattr(text, "max_position_embeddings", 1024)),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        parameters=int(sum(p.numel() for p in model.parameters())),
    )
    return model, facts


# ----------------------------------------------------------------------------- corpus
@lru_cache(maxsize=2)
def stream(split: str) -> np.ndarray:
    from subspace_ref.lab import corpus

    return corpus.load_stream(split)


def windows(split: str, n: int, length: int, seed: int) -> np.ndarray:
    """``n`` deterministic windows (n, length) of token ids (bytes) of a corpus split."""
    from subspace_ref.lab import corpus

    return corpus.eval_windows(n=n, length=length, seed=seed, stream=stream(split))


# ----------------------------------------------------------------------------- context
@dataclass
class Context:
    """One run: arguments, profile, model and its facts, output folder."""

    args: argparse.Namespace
    profile: Profile
    model: Any
    facts: dict
    out: Path
    progress: bool
    started: float = field(default_factory=time.perf_counter)

    @property
    def d(self) -> int:
        return self.facts["head_dim"]

    @property
    def context(self) -> int:
        c = getattr(self.args, "context", None) or self.profile.context or self.facts["max_context"]
        return int(min(c, self.facts["max_context"]))

    @property
    def figures(self) -> Path:
        p = self.out / "figures"
        p.mkdir(parents=True, exist_ok=True)
        return p

    def calib_windows(self) -> np.ndarray:
        return windows("train", self.profile.calib_windows, self.context, SEED_BASES)

    def holdout_windows(self) -> np.ndarray:
        return windows("train", self.profile.holdout_windows, self.context, SEED_HOLDOUT_CALIB)

    def eval_windows(self, n: int | None = None) -> np.ndarray:
        return windows("heldout", n or self.profile.eval_windows, self.context, SEED_EVAL)

    def bar(self, iterable=None, **kw):
        return progress(iterable, self.progress, **kw)

    def settings(self) -> dict:
        p = self.profile
        return dict(
            profile=p.name,
            context=self.context,
            calib_windows=p.calib_windows,
            holdout_windows=p.holdout_windows,
            eval_windows=p.eval_windows,
            seeds=dict(bases=SEED_BASES, holdout=SEED_HOLDOUT_CALIB, eval=SEED_EVAL),
            backend=getattr(self.args, "backend", "torch"),
        )


_CONTEXTS: dict[tuple, Context] = {}


def make_context(args: argparse.Namespace) -> Context:
    """The run's :class:`Context`; the model is loaded once per process and model name."""
    limit_threads(requested_threads(args))
    require_pyplot()
    profile = PROFILES[getattr(args, "profile", "full")]
    key = (args.model,)
    if key in _CONTEXTS:
        model, facts = _CONTEXTS[key].model, _CONTEXTS[key].facts
    else:
        model, facts = load_model(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args=args, profile=profile, model=model, facts=facts, out=out, progress=not getattr(args, "no_progress", False))
    _CONTEXTS[key] = ctx
    return ctx


def environment() -> dict:
    import scipy

    env = dict(python=platform.python_version(), numpy=np.__version__, scipy=scipy.__version__, platform=platform.platform(), cpu_count=os.cpu_count())
    for mod in ("torch", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


# ----------------------------------------------------------------------------- progress
def progress(iterable=None, enabled: bool = True, **kw):
    """tqdm over ``iterable`` (to stderr), or the iterable itself when disabled or tqdm is missing."""
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, leave=False, **kw)
        except ImportError:
            pass
    return _Quiet(iterable)


class _Quiet:
    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- JSON / CSV
def jsonable(x: Any) -> Any:
    """JSON types; non-finite floats become null (a missing value in the runner's outputs)."""
    return _jsonable(x, nonfinite="null")


def write_json(path: Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(jsonable(obj), indent=1) + "\n")
    tmp.replace(path)
    return path


def read_json(path: Path) -> dict | None:
    path = Path(path)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def write_csv(path: Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in keys and not isinstance(v, (dict, list)):
                keys.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in keys})
    return path


def _csv_value(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def meta(ctx: Context, command: str, **extra) -> dict:
    """The ``meta`` block of every JSON output: what ran, on what, with which settings."""
    return dict(
        command=command,
        model=ctx.facts,
        settings=ctx.settings(),
        environment=environment(),
        runtime_s=round(time.perf_counter() - ctx.started, 2),
        **extra,
    )


# ----------------------------------------------------------------------------- figures
class MissingDependency(ImportError):
    """An optional package a subcommand needs, named with the extra that installs it (the command
    line prints it instead of a traceback)."""


def require_pyplot() -> None:
    """Fail before any work when matplotlib (every runner subcommand draws figures) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise MissingDependency("needs matplotlib for its figures: pip install 'subspace_ref[models]' (or pip install matplotlib)") from err


def pyplot():
    require_pyplot()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 10, "legend.fontsize": 8, "xtick.labelsize": 9, "ytick.labelsize": 9, "figure.dpi": FIGURE_DPI})
    return plt


def save_figure(fig, path: Path, dpi: int = FIGURE_DPI) -> Path:
    """PNG at ``dpi`` (legends outside the axes are kept by the tight bounding box); one over
    :data:`MAX_FIGURE_BYTES` is re-stored with a 256-colour palette rather than at a lower resolution."""
    plt = pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    if path.stat().st_size > MAX_FIGURE_BYTES:
        from PIL import Image

        with Image.open(path) as im:
            im.convert("RGB").quantize(256).save(path, optimize=True)
    return path


def legend_right(fig, ax) -> None:
    """One legend for the whole figure, right of every panel, from ``ax``'s labelled artists."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.95), frameon=False)


def symlog_percent(ax, axis: str = "y") -> None:
    """A percent axis that shows decreases too: logarithmic beyond ±1%, linear inside, where a
    compressed cache can beat the stock model by noise (a negative Δppl is drawn where it is,
    not clipped to a small positive number)."""
    (ax.set_yscale if axis == "y" else ax.set_xscale)("symlog", linthresh=1.0, linscale=0.5)


# ----------------------------------------------------------------------------- small statistics
def percent(x: float) -> float:
    return 100.0 * x


def position_edges(context: int) -> list[int]:
    """Context-length buckets [1, C/16), [C/16, C/4), [C/4, C/2), [C/2, C]: for C = 1024 the
    buckets 1-63, 64-255, 256-511, 512-1023 of the training report."""
    c = int(context)
    edges = [1, max(2, c // 16), max(3, c // 4), max(4, c // 2), c]
    return sorted(set(edges))


def bucket_label(a: int, b: int) -> str:
    return f"{a}-{b - 1}"


def block_bootstrap(diff: np.ndarray, block: int, reps: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(diff) by resampling blocks of ``block`` consecutive tokens of each
    row of ``diff`` (windows x tokens); neighbouring tokens' errors are correlated."""
    diff = np.asarray(diff, dtype=np.float64)
    n_blocks = max(1, diff.shape[1] // block)
    means = np.stack([diff[:, i * block : (i + 1) * block if i < n_blocks - 1 else None].mean(axis=1) for i in range(n_blocks)], axis=1).ravel()
    sizes = np.stack(
        [np.full(diff.shape[0], diff[:, i * block : (i + 1) * block if i < n_blocks - 1 else None].shape[1]) for i in range(n_blocks)], axis=1
    ).ravel()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, means.size, size=(reps, means.size))
    boot = (means[idx] * sizes[idx]).sum(axis=1) / sizes[idx].sum(axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(lo), float(hi)


def spearman(x: Iterable[float], y: Iterable[float]) -> dict:
    from scipy.stats import spearmanr

    pairs = [(a, b) for a, b in zip(x, y) if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 3 or len({a for a, _ in pairs}) < 2 or len({b for _, b in pairs}) < 2:
        return dict(rho=None, p=None, n=len(pairs))
    res = spearmanr([a for a, _ in pairs], [b for _, b in pairs])
    return dict(rho=float(res.statistic), p=float(res.pvalue), n=len(pairs))


def matches(record: dict | None, ctx: Context) -> bool:
    """Whether an output record was produced by this model, context and profile."""
    try:
        m = record["meta"]
        return (
            m["model"].get("name") == ctx.facts["name"]
            and m["model"].get("weights_sha256") == ctx.facts.get("weights_sha256")
            and m["settings"]["context"] == ctx.context
            and m["settings"]["profile"] == ctx.profile.name
        )
    except (KeyError, TypeError):
        return False


def ensure(ctx: Context, filename: str, runner) -> dict:
    """``OUT/filename`` when it matches this run (:func:`matches`), else ``runner(ctx)``."""
    record = read_json(ctx.out / filename)
    if not matches(record, ctx):
        record = runner(ctx)
    return record
