"""docs/hf.md's opening example runs as written, and the shipped model's tokenizer is the byte
tokenizer it says: id = byte value, any UTF-8 text encoded to its bytes and decoded back."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from subspace_ref.hf_requirements import MIN_TRANSFORMERS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # older: generate has no cache= (skipped, both versions named)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "hf.md"
MODEL = ROOT / "subspace_ref" / "data" / "stdlib_llama"
REL = "subspace_ref/data/stdlib_llama"


def example() -> tuple[str, str]:
    """The first bash block and the first python block of the page's opening section."""
    text = DOC.read_text()
    first = text[text.index("\n## ") : text.index("\n## ", text.index("\n## ") + 1)]
    shell = re.search(r"```bash\n(.*?)```", first, re.S)
    code = re.search(r"```python\n(.*?)```", first, re.S)
    assert shell and code, "docs/hf.md must open with a bash block (calibrate) and a python block (generate)"
    return shell.group(1).strip(), code.group(1)


def test_the_opening_example_runs_as_written(tmp_path, monkeypatch):
    """The calibrate command (one window of 1024 calibration tokens instead of 8192, to stay fast)
    and then the Python block, in a fresh directory with the model path made absolute: the bases
    hold the allocation asked for, the prompt is its UTF-8 bytes, the generation is 64 new tokens
    through a cache of one LayerState per layer holding that allocation, and what is printed is
    their text."""
    from subspace_ref import LayerState
    from subspace_ref.cli import main
    from subspace_ref.hf.calibration_losses import EXACT

    shell, code = example()
    argv = shlex.split(shell)
    assert argv[:2] == ["subspace-kv", "calibrate"] and REL in argv
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([a.replace(REL, str(MODEL)) for a in argv[1:]] + ["--calibration-tokens", "1024", "--no-progress"]) == 0
    saved = json.loads((tmp_path / "bases" / "subspace_bases.json").read_text())
    chosen = (saved["allocation"]["sinks"], saved["allocation"]["window"])
    tried = saved["allocation"]["meta"]["exact_losses"]  # the command chose sinks and window by its loss (spec L6.2)
    assert chosen in EXACT and tried[f"{chosen[0]},{chosen[1]}"] == min(v for v in tried.values() if v is not None)

    assert code.count(REL) == 1
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(REL, str(MODEL)), str(DOC), "exec"), scope)
    ids, out, tokenizer, bases, model = (scope[k] for k in ("ids", "out", "tokenizer", "bases", "model"))
    assert ids[0].tolist() == list("def read_config(path):\n".encode("utf-8"))
    new = out[0, ids.shape[1] :]
    assert new.numel() == 64
    assert printed.getvalue() == bytes(new.tolist()).decode("utf-8", errors="replace") + "\n"
    assert (bases.allocation.sinks, bases.allocation.window) == chosen

    from subspace_ref.hf import compress

    with compress(model, bases) as kv:  # the same generation, with a cache to look into
        cache = kv.cache()
        again = kv.generate(ids, cache=cache, max_new_tokens=64, do_sample=False)
    assert torch.equal(again, out)
    for layer, heads in zip(cache.layers, bases.allocation.heads):  # one group per distinct head configuration
        assert isinstance(layer.state, LayerState) and len(layer.state.groups) == len(set(heads))


def byte_level_tokenizer():
    """The shipped tokenizer, rebuilt: GPT-2's byte-level pre-tokenizer (one character per byte,
    no regex split, no prefix space), a BPE model without merges whose vocabulary maps the
    character of byte b to id b, and the byte-level decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    for i, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + i)  # GPT-2's table for the bytes that are not printable
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_shipped_tokenizer_is_the_byte_tokenizer():
    from tokenizers import Tokenizer

    shipped = json.loads(Tokenizer.from_file(str(MODEL / "tokenizer.json")).to_str())
    assert shipped == json.loads(byte_level_tokenizer().to_str())
    config = json.loads((MODEL / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_auto_tokenizer_round_trips_utf8_to_byte_ids():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    assert len(tok) == 256 and tok.all_special_ids == []
    rng = np.random.default_rng(0)
    samples = ["", " a  b\t\r\n", "def f(x):\n    return x  # é ü 😀", "日本語\x00\x7f<s></s><unk>"]
    for _ in range(50):  # random code points: ASCII, the BMP without surrogates, the astral planes
        cps = np.concatenate([rng.integers(0, 128, 20), rng.integers(0xE000, 0x10000, 10), rng.integers(0x10000, 0x110000, 10)])
        samples.append("".join(chr(int(c)) for c in rng.permutation(cps)))
    for text in samples:
        ids = tok(text)["input_ids"]
        assert ids == list(text.encode("utf-8")), text
        assert tok.decode(ids) == text


def test_calibration_tokenizes_to_bytes():
    """``calibrate_checkpoint.token_ids`` uses the checkpoint's tokenizer when it has one: on the
    shipped model that is still the text's UTF-8 bytes."""
    from subspace_ref.hf.calibrate_checkpoint import stdlib_text, token_ids

    text = stdlib_text(20000) + "é😀"
    ids = token_ids(str(MODEL), text, 256)
    assert np.array_equal(ids, np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64))
