"""The one builder of every generated page and printed table of the experiment runner.

``Page`` collects markdown lines and the figures they reference; ``table`` writes a markdown
table and ``text_table`` the same rows aligned for a terminal; the formatters give every page the
same spelling of a percentage with its interval. ``report`` (docs/experiments.md), ``tasks``
(docs/tasks.md), the bounds sweep (docs/theory.md) and the subcommands' printed tables use them.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path


def num(x, fmt: str = ".3f", none: str = "–") -> str:
    """``x`` formatted, or ``none`` for a missing value."""
    if x is None:
        return none
    try:
        return format(x, fmt)
    except (TypeError, ValueError):
        return str(x)


def pct(x, fmt: str = "+.2f") -> str:
    """A signed percentage; three significant digits from 1000% on (the digits beyond say nothing)."""
    if x is None:
        return "–"
    return f"{x:{fmt}}%" if abs(x) < 1000 else f"{x:+.3g}%"


def pct_ci(x, ci: Sequence[float] | None) -> str:
    """``+31.20% [+18.51%, +49.47%]``: a percentage with its 95% interval, at any size."""
    if x is None:
        return "–"
    return pct(x) if not ci else f"{pct(x)} [{pct(ci[0])}, {pct(ci[1])}]"


def table(head: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> list[str]:
    """Markdown table lines; ``align`` one letter per column, ``l`` or ``r`` (default all left)."""
    marks = ["---:" if a == "r" else "---" for a in (align or "l" * len(head))]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(marks) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def text_table(head: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> str:
    """The same rows for a terminal: columns as wide as their widest cell, ``r`` columns right-aligned."""
    cells = [[str(c) for c in head]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    align = align or "l" * len(head)

    def line(r):
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(r, widths, align)).rstrip()

    return "\n".join([line(cells[0]), "-" * (sum(widths) + 2 * (len(widths) - 1))] + [line(r) for r in cells[1:]])


class Page:
    """Markdown lines and the figures they reference; :meth:`write` copies the figures next to the page."""

    def __init__(self, path: Path, figures_from: Path | None = None):
        self.path, self.figures_from = Path(path), figures_from
        self.lines: list[str] = []
        self.figures: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def table(self, head: Sequence[str], rows: Sequence[Sequence], align: str | None = None) -> None:
        self.add(*table(head, rows, align), "")

    def figure(self, name: str, caption: str) -> None:
        src = None if self.figures_from is None else self.figures_from / name
        if src is not None and src.exists():
            self.figures.append(name)
            self.add(f"![{caption}](figures/{name})", "", f"*{caption}*", "")
        else:
            self.add(f"*(figure {name} was not produced)*", "")

    def scope_and_limits(self, items: Sequence[str]) -> None:
        """The section every generated page ends with: what its numbers do not say."""
        self.add("## Scope and limits", "")
        self.add(*[f"- {x}" for x in items], "")

    def write(self) -> Path:
        figdir = self.path.parent / "figures"
        figdir.mkdir(parents=True, exist_ok=True)
        for name in self.figures:
            shutil.copyfile(self.figures_from / name, figdir / name)
        self.path.write_text("\n".join(self.lines).rstrip() + "\n")
        return self.path


#: What every page's numbers rest on (the shared part of each "Scope and limits" section).
SHIPPED_MODEL_SCOPE = (
    "One model: the {description} ({parameters} parameters, {layers} layers, head size d = {head_dim}, context {max_context}). "
    "The seeds test GPT-2 Small, Pythia-410M and TinyLlama on WikiText/C4; a verdict here is about this model and this "
    "text, not about those models.",
    "Little long-range dependence: a model this small, trained on code, predicts most bytes from the last few hundred "
    "(keeping only a recent window of tokens costs it little: `docs/baselines.md`), so methods that drop or blur distant "
    "tokens cost it less than they would cost a large model on prose. A method that passes here may still fail there.",
)


def model_scope(facts: dict) -> list[str]:
    """:data:`SHIPPED_MODEL_SCOPE` filled in with the model's facts (the ``meta.model`` of an output)."""
    keys = ("description", "parameters", "layers", "head_dim", "max_context")
    values = {k: (f"{facts[k]:,}" if k == "parameters" and isinstance(facts.get(k), int) else facts.get(k, "?")) for k in keys}
    return [s.format(**values) for s in SHIPPED_MODEL_SCOPE]
