"""The shipped default model (subspace_ref/data/stdlib_llama) and its stdlib corpus."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from subspace_ref.lab import corpus

DATA = Path(__file__).resolve().parent.parent / "subspace_ref" / "data" / "stdlib_llama"
FILES = ("model.safetensors", "config.json", "training_report.json")
LIMIT = 25 * 1024 * 1024


@pytest.fixture(scope="module")
def report():
    return json.loads((DATA / "training_report.json").read_text())


@pytest.fixture(scope="module")
def loaded():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from subspace_ref.models.default_model import load_default_model

    return load_default_model()


# ------------------------------------------------------------------ shipped files


def test_shipped_files_exist_and_are_small():
    sizes = {}
    for name in FILES:
        p = DATA / name
        assert p.is_file(), f"missing shipped file {p}"
        sizes[name] = p.stat().st_size
        assert sizes[name] > 0
    assert sum(sizes.values()) < LIMIT, sizes
    assert sum(f.stat().st_size for f in DATA.iterdir() if f.is_file()) < LIMIT


def test_report_records_corpus_and_baseline(report):
    c = report["corpus"]
    for key in ("python_version", "train_files", "train_bytes", "heldout_files", "heldout_bytes", "train_sha256"):
        assert key in c
    assert c["train_files"] > 0 and c["heldout_files"] > 0
    assert c["train_bytes"] > 10 * c["heldout_bytes"] / 2  # roughly a 90/10 split
    assert len(c["train_sha256"]) == 64
    ev = report["evaluation"]
    ng = ev["ngram_baseline"]["heldout_loss_nats_per_byte"]
    assert ev["heldout_loss_nats_per_byte"] < ng
    assert ev["heldout_loss_bits_per_byte"] == pytest.approx(ev["heldout_loss_nats_per_byte"] / np.log(2), abs=1e-3)
    assert report["training"]["total_steps"] > 0
    assert np.isfinite(report["training"]["final_train_loss_nats_per_byte"])


# ------------------------------------------------------------------ the model


def test_config_is_small_gqa_llama(loaded):
    model, config = loaded
    assert config.model_type == "llama"
    assert type(model).__name__ == "LlamaForCausalLM"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim == 64
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.vocab_size in (256, 257)
    assert config.max_position_embeddings >= 1024


def test_loads_float32_in_eval_mode(loaded):
    import torch

    model, _ = loaded
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n < 6_000_000


def test_heldout_loss_beats_recorded_ngram(loaded, report):
    """A real check: the model must predict unseen stdlib code better than the byte n-gram."""
    from subspace_ref.lab.train_default_model import model_loss

    model, _ = loaded
    windows = corpus.eval_windows(n=8, length=512, seed=20240611, split="heldout")
    loss = model_loss(model, windows, batch_size=8)
    ngram = report["evaluation"]["ngram_baseline"]["heldout_loss_nats_per_byte"]
    assert np.isfinite(loss)
    assert loss < ngram, (loss, ngram)


def test_ngram_on_same_windows_is_worse():
    from subspace_ref.lab.train_default_model import ByteNGram

    held = corpus.load_stream("heldout")
    windows = corpus.eval_windows(n=4, length=256, seed=7, stream=held)
    ng = ByteNGram(held, order=3)  # fit on the held-out bytes themselves: a sanity check of the code
    probs = ng.target_probs(windows)
    assert probs.shape == (4, 255)
    assert np.all((probs > 0) & (probs <= 1))
    assert ng.loss(windows) < np.log(256)


def test_generate_with_kv_cache_matches_full_forward(loaded):
    import torch

    model, _ = loaded
    from subspace_ref.models.default_model import decode, encode

    prompt = encode("def __init__(self, ")[None]
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
    assert out.shape == (1, prompt.shape[1] + 12)
    assert isinstance(decode(out[0]), str)
    with torch.no_grad():
        full = model(input_ids=out[:, :-1]).logits[0, prompt.shape[1] - 1 :].argmax(-1)
    assert torch.equal(full, out[0, prompt.shape[1] :])


# ------------------------------------------------------------------ corpus


def test_split_is_deterministic_and_disjoint():
    all_files = corpus.list_all_files()
    train = corpus.train_files()
    held = corpus.heldout_files()
    assert train == corpus.list_files("train") and held == corpus.list_files("heldout")
    assert train == sorted(train) and held == sorted(held)
    assert not set(train) & set(held)
    assert sorted(train + held) == all_files
    assert len(held) > 0 and len(train) > 5 * len(held)
    for rel in held:
        assert int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 10 == 0
    for rel in all_files:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not {"site-packages", "test", "tests", "idle_test"} & set(parts[:-1]), rel
    with pytest.raises(ValueError):
        corpus.list_files("validation")


def test_eval_windows_are_deterministic():
    held = corpus.load_stream("heldout")
    a = corpus.eval_windows(n=5, length=64, seed=3, stream=held)
    b = corpus.eval_windows(n=5, length=64, seed=3)
    c = corpus.eval_windows(n=5, length=64, seed=4, stream=held)
    assert a.shape == (5, 64) and a.dtype == np.int64
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() < 256
    assert np.array_equal(corpus.eval_windows(n=2, length=64, seed=3, stream=held), a[:2])


def test_corpus_hash_matches_report_when_same_interpreter(report):
    c = report["corpus"]
    if c["python_version"] != sys.version.split()[0]:
        pytest.skip(f"report built on Python {c['python_version']}")
    stats = corpus.corpus_stats()
    if stats.train_files != c["train_files"]:
        pytest.skip("a different standard library layout")
    assert stats.train_bytes == c["train_bytes"]
    assert stats.heldout_files == c["heldout_files"]
    assert stats.train_sha256 == c["train_sha256"]


# ------------------------------------------------------------------ load_model and imports


def test_load_model_missing_path_raises_plain_error(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from subspace_ref.models.default_model import ModelNotFoundError, load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelNotFoundError, match=r"not found locally: .*pass a local path or pre-download it"):
        load_model(str(missing))
    with pytest.raises(FileNotFoundError, match="not found locally"):
        load_model("subspace-ref-nonexistent-org/no-such-model-xyz")


def test_load_model_local_dir_and_default_alias(loaded, tmp_path):
    import torch

    from subspace_ref.models.default_model import load_model

    model, _ = loaded
    model.save_pretrained(tmp_path / "ckpt")
    again, cfg = load_model(tmp_path / "ckpt")
    assert cfg.model_type == "llama" and not again.training
    x = torch.arange(32)[None] + 40
    with torch.no_grad():
        assert torch.allclose(model(input_ids=x).logits, again(input_ids=x).logits, atol=1e-5)
    default, _ = load_model("default")
    assert type(default) is type(model)


def test_corpus_module_does_not_import_torch():
    code = "import sys, subspace_ref.lab, subspace_ref.lab.corpus; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_insert_copies_repeats_earlier_spans_within_rows():
    """The copy objective the shipped model was fine-tuned with: every changed stretch of a row
    repeats bytes that occur earlier in that row, rows not drawn stay untouched."""
    torch = pytest.importorskip("torch")
    from subspace_ref.lab.train_default_model import insert_copies

    rng = np.random.default_rng(3)
    x = torch.as_tensor(rng.integers(0, 256, size=(64, 512)))
    before = x.clone()
    insert_copies(x, np.random.default_rng(0), frac=0.5, copies=1, span=(40, 96))
    changed = (x != before).any(1)
    assert 16 < int(changed.sum()) < 48  # about half of the rows
    for row in np.flatnonzero(changed.numpy()):
        pos = np.flatnonzero((x[row] != before[row]).numpy())
        a, b = int(pos.min()), int(pos.max()) + 1
        assert b - a <= 96
        text, piece = bytes(x[row, :a].numpy().astype(np.uint8)), bytes(x[row, a:b].numpy().astype(np.uint8))
        assert piece in text  # the changed bytes were copied from earlier in the row
    x2 = before.clone()
    insert_copies(x2, np.random.default_rng(0), frac=0.0, copies=3)
    assert torch.equal(x2, before)
