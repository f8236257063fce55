"""hf/ along its seams (docs/architecture.md): the registration of the attention function imports
nothing else from hf/, and the tag that carries a cache layer from ``update`` to the attention
call is set and read only through ``hf.attention.tag`` / ``tagged_layer`` / ``untag``."""

from __future__ import annotations

import ast
from pathlib import Path

HF = Path(__file__).resolve().parents[1] / "subspace_ref" / "hf"


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: inside subspace_ref.hf
                base = "subspace_ref.hf" + (f".{base}" if base else "")
            out.update({base} | {f"{base}.{a.name}" for a in node.names})
    return out


def test_attention_registration_imports_nothing_else_from_hf():
    hf_imports = sorted(m for m in _imported_modules(HF / "attention.py") if m.startswith("subspace_ref.hf"))
    assert hf_imports == []


def test_the_layer_tag_is_touched_only_through_its_functions():
    """No module but hf/attention.py names the tag attribute or sets attributes on key tensors."""
    offenders = []
    for path in sorted(HF.glob("*.py")):
        if path.name == "attention.py":
            continue
        text = path.read_text()
        for needle in ("_attn.TAG", "_subspace_ref_layer", "setattr(key"):
            if needle in text:
                offenders.append(f"{path.name}: {needle}")
    assert offenders == []


def test_tagged_layer_reads_back_only_pending_keys():
    torch = __import__("pytest").importorskip("torch")
    from subspace_ref.hf.attention import tag, tagged_layer, untag

    class Layer:
        pending_keys = None

    layer, keys = Layer(), torch.zeros(1)
    assert tagged_layer(keys) is None
    tag(keys, layer)
    assert tagged_layer(keys) is None  # tagged, but no longer the layer's pending keys
    layer.pending_keys = keys
    assert tagged_layer(keys) is layer
    untag(keys)
    assert tagged_layer(keys) is None
