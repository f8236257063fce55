"""Write the fixture of the vLLM plugin tests: run in the project's MAIN venv (transformers
5.24+, which the library's transformers path needs and vLLM's venv cannot have).

    python tests/vllm/make_reference.py            # bases kept if present, references rewritten
    python tests/vllm/make_reference.py --recalibrate
    python tests/vllm/make_reference.py --check    # exit 1 if the stored tokens are stale

It writes into tests/vllm/data/:

* ``shipped_r32/``, ``shipped_r16/``: CalibratedBases of the shipped model at r_k = r_v = 32 and
  16 (2048 tokens of standard-library sources, γ by MSE, then spread per head by ±10% so that
  heads differ; float32);
* ``replicated_r32/``: the same at r = 32 for the random-init model with one KV head
  (``_vllm_support.numpy_llama``, rebuilt from its seed wherever needed);
* ``shipped_energy/``: what ``subspace-kv calibrate --compression-ratio 0.25 --rule energy``
  makes (energy ranks, uneven per head, layer and side; served with ``subspace_pad``; float32);
* ``shipped_allocator/``: what the CLI's default rule makes (int8/int4, pre-RoPE and identity
  heads: the plugin refuses it; no tokens);
* ``reference.json``: greedy tokens of the library's transformers path (``subspace_ref.hf.compress``)
  for the tests' prompts with each servable set above, with ``shipped_r32/`` carrying a per-head
  allocation of float post-RoPE heads (``_vllm_support.with_allocation``, made where needed:
  ``compress`` then builds ``allocated_states``), and of the stock shipped model.

The vLLM tests serve the same bases and compare token for token. Re-run it when the library's
numerics or the prompts change (``--check`` tells).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_support import DATA, NEW_TOKENS, PROMPTS, RANKS, REFERENCE, REPLICATED, numpy_llama, with_allocation  # noqa: E402

GAMMA_SPREAD = 0.2


def byte_windows(n_tokens: int, context: int = 1024):
    """Calibration windows of the standard library's sources as bytes (the calibrate CLI's default text)."""
    import torch

    from subspace_ref.hf.calibrate_checkpoint import stdlib_text

    ids = np.frombuffer(stdlib_text(4 * n_tokens).encode("utf-8"), dtype=np.uint8).astype(np.int64)[:n_tokens]
    return [torch.as_tensor(w)[None] for w in ids.reshape(-1, context)]


def calibrate(model_dir: str, out: Path, rank: int, tokens: int = 2048) -> Path:
    """Static bases at r_k = r_v = rank for a local checkpoint, γ by MSE times
    1 + GAMMA_SPREAD (h - (H - 1) / 2) for head h (MSE γ of SVD bases is 1 up to rounding, and
    a backend that mixed heads up would pass unseen), saved in float32."""
    from subspace_ref.hf import CalibratedBases, capture
    from subspace_ref.models.default_model import load_model

    model, config = load_model(model_dir)
    cap = capture(model, byte_windows(tokens), queries=True)
    layers = []
    for b in cap.calibrate(rank_k=rank, rank_v=rank, gamma="mse"):
        spread = 1 + GAMMA_SPREAD * (np.arange(b.heads) - (b.heads - 1) / 2)
        layers.append(replace(b, B=b.B.astype(np.float32), E=b.E.astype(np.float32), gamma=(b.gamma * spread).astype(np.float32)))
    facts = dict(source=Path(model_dir).name, tokens=tokens, rank_k=rank, rank_v=rank, gamma="mse", gamma_spread=GAMMA_SPREAD, made_by="tests/vllm/make_reference.py")
    CalibratedBases.for_model(config, layers, calibration=facts).save_pretrained(out)
    return out


def cli_bases(model_dir: str, out: Path, rule: str, ratio: float = 0.25, tokens: int = 2048) -> Path:
    """The calibrate CLI's bases (``calibrate_checkpoint``) by ``rule`` at ``ratio``, arrays stored in float32."""
    from subspace_ref.hf.calibrate_checkpoint import calibrate_checkpoint

    bases = calibrate_checkpoint(model_dir, ratio, rule=rule, tokens=tokens)
    layers = tuple(replace(b, B=b.B.astype(np.float32), E=b.E.astype(np.float32), gamma=b.gamma.astype(np.float32)) for b in bases.layers)
    replace(bases, layers=layers, calibration=bases.calibration | dict(source=Path(model_dir).name)).save_pretrained(out)
    return out


def greedy(model_dir: str, bases: Path | None) -> list[list[int]]:
    """Greedy tokens of the library's transformers path with ``bases`` (the stock model for None)."""
    import torch

    from subspace_ref.hf import CalibratedBases, compress
    from subspace_ref.models.default_model import load_model

    model, config = load_model(model_dir)
    out = []
    for p in PROMPTS:
        ids = torch.tensor(list(p))[None]
        if bases is None:
            tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        else:
            with compress(model, CalibratedBases.from_pretrained(bases, config)) as kv:
                tokens = kv.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(tokens[0, ids.shape[1] :].tolist())
    assert all(len(t) == NEW_TOKENS for t in out), "generation stopped early"
    return out


def references(shipped: str, replicated: str, tmp: Path) -> dict:
    tokens = {"shipped/stock": greedy(shipped, None)}
    tokens |= {f"shipped/r{r}": greedy(shipped, DATA / f"shipped_r{r}") for r in RANKS}
    tokens["shipped/r32-allocation"] = greedy(shipped, with_allocation(DATA / "shipped_r32", tmp / "r32_allocation"))
    tokens["shipped/energy"] = greedy(shipped, DATA / "shipped_energy")
    tokens["replicated/r32"] = greedy(replicated, DATA / "replicated_r32")
    return tokens


def dumps(record: dict) -> str:
    """JSON with one line per prompt's tokens (diffs show which prompt changed)."""
    head = {k: v for k, v in record.items() if k != "tokens"}
    lines = json.dumps(head, indent=1)[:-2].splitlines()
    lines[-1] += ","
    lines.append(' "tokens": {')
    sets = []
    for name, rows in record["tokens"].items():
        sets.append(f"  {json.dumps(name)}: [\n" + ",\n".join("   " + json.dumps(r) for r in rows) + "\n  ]")
    return "\n".join(lines) + "\n" + ",\n".join(sets) + "\n }\n}\n"


def main(argv=None) -> int:
    import torch
    import transformers

    from subspace_ref.models.default_model import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recalibrate", action="store_true", help="rebuild the bases directories too")
    parser.add_argument("--check", action="store_true", help="recompute the references and compare with the stored ones")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shipped = str(default_model_dir())
    with tempfile.TemporaryDirectory() as tmp:
        replicated = str(numpy_llama(Path(tmp) / "replicated", **REPLICATED))
        if not args.check:
            for name, model, rank in [*((f"shipped_r{r}", shipped, r) for r in RANKS), ("replicated_r32", replicated, 32)]:
                if args.recalibrate or not (DATA / name / "subspace_bases.json").is_file():
                    calibrate(model, DATA / name, rank)
            for rule in ("energy", "allocator"):
                if args.recalibrate or not (DATA / f"shipped_{rule}" / "subspace_bases.json").is_file():
                    cli_bases(shipped, DATA / f"shipped_{rule}", rule)
        tokens = references(shipped, replicated, Path(tmp))
    if args.check:
        stored = json.loads(REFERENCE.read_text())
        stale = [k for k in tokens if stored["tokens"].get(k) != tokens[k]]
        if stored["prompts"] != [p.decode() for p in PROMPTS] or stale:
            print(f"{REFERENCE} is stale ({', '.join(stale) or 'prompts'}): run python tests/vllm/make_reference.py")
            return 1
        print(f"{REFERENCE}: up to date ({len(tokens)} sets of {len(PROMPTS)} x {NEW_TOKENS} tokens)")
        return 0
    record = dict(
        made_by="tests/vllm/make_reference.py (main venv)",
        date=datetime.date.today().isoformat(),
        versions=dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__),
        prompts=[p.decode() for p in PROMPTS],
        new_tokens=NEW_TOKENS,
        tokens=tokens,
    )
    REFERENCE.write_text(dumps(record))
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
