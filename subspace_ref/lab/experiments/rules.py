"""The decision rules of every verdict the experiment pages print, with their revision history.

This is the one place a rule is written down: ``falsify`` attaches each falsifier's text and
history to its verdict, and the generated page prints both. A rule is *pre-registered* only in
its first version; a revision made after numbers were seen is weaker evidence, so every revision
says when, what changed and why, and the page lists it beside the verdict.

Verdicts are about the *claim* a falsifier tests: ``supported`` (it did not fire), ``refuted``
(it fired), ``inconclusive`` (the data cannot decide). The papers' other quantitative claims are
``held`` / ``did not hold``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Revision:
    date: str
    change: str
    why: str
    after_seeing_numbers: bool


@dataclass(frozen=True)
class Rule:
    text: str
    revisions: tuple[Revision, ...] = ()

    @property
    def revised_after_numbers(self) -> bool:
        return any(r.after_seeing_numbers for r in self.revisions)

    def history(self) -> str:
        """One line for the page: 'no' or each revision, dated."""
        if not self.revisions:
            return "no"
        return "; ".join(f"{r.date}{' (after seeing numbers)' if r.after_seeing_numbers else ''}: {r.change} — {r.why}" for r in self.revisions)


_AUDIT = "2026-11-23"  # issue 20: an audit found verdicts judged on a chosen slice of the data

#: Falsifiers of seed 001 §11 and seed 003 ("Clear falsifiers"), by id.
FALSIFIERS = {
    "001-1": Rule(
        "refuted when no run compressing keys and values with every head's r, r_v ≤ d/4 has Δppl ≤ 1%; "
        "counts the post-RoPE coefficient-space caches (static, adaptive, rotating)"),
    "003-1": Rule(
        "as 001-1, also counting the pre-RoPE-basis ablation (seed 003: \"compare bases computed pre- vs post-RoPE; report best\")",
        (Revision("2026-11-21", "the pre-RoPE ablation added, and kept out of 001-1",
                  "the first runs on the trained model showed keys to be the bottleneck; the ablation's numbers were not known then", True),)),
    "001-2": Rule("refuted when the better adaptive variant has higher perplexity than static (γ = 1) at more than half of the matched ranks"),
    "003-2": Rule(
        "refuted unless the best online state beats static with a 95% interval of the paired NLL difference below 0 at more than "
        "half of the ranks; the interval resamples whole held-out windows",
        (Revision(_AUDIT, "interval by resampling windows instead of 64-token blocks pooled over windows",
                  "tokens of one window share their context; blocks understate the spread between windows", False),)),
    "001-3": Rule(
        "refuted when, at the best run (lowest overall Δppl) of every adaptive sketch variant (paper sketches, sketch_reset), the "
        "last context bucket's Δppl is more than 1 point above and more than twice that of the C/16–C/4 bucket; supported when "
        "for none; inconclusive when the variants disagree",
        (Revision("2026-11-21", "from the adaptive rank nearest d/4 to the best adaptive run",
                  "at d/4 every method is already above +100%, where growth with context says little", True),
         Revision(_AUDIT, "from the single best run to the best run of each sketch variant",
                  "the verdict flipped with the reset variant: one chosen run is not the claim", True))),
    "001-4": Rule(
        "refuted when any of FD ε_K ~ logit error, FD ε_V ~ output error, max‖ΔK_j‖ ~ logit error, max‖ΔV_j‖ ~ output error "
        "has pooled Spearman ρ < 0.5 or p ≥ 0.05, or median ρ < 0.3 among the states of one rank; states from several held-out "
        "windows, several query positions per head",
        (Revision("2026-11-21", "the within-rank condition added",
                  "the first full run showed the pooled correlations to be carried by the rank (pooled alone: supported)", True),
         Revision(_AUDIT, "4 windows and 2 query positions per state instead of 1 and 1",
                  "one window and one query per head cannot tell a predictor from the window it was measured on", False))),
    "003-3": Rule(
        "refuted when r near d is required (post-RoPE static basis needs r ≥ 3d/4 for Δppl ≤ 1%, or half the KV heads need "
        "r ≥ 3d/4 for 95% of post-RoPE key energy) and RoPE is the reason (pre-RoPE basis meets 1% at a smaller rank, or "
        "pre-RoPE keys have a smaller median r95); inconclusive when only the first holds",
        (Revision("2026-11-21", "the perplexity criterion added with the pre-RoPE ablation",
                  "first spectral only (which gives supported: no head needs r ≥ 3d/4 for 95% energy)", True),)),
}

#: The papers' other quantitative claims whose rule was revised (the rest are stated with their numbers).
CLAIMS = {
    "adaptive savings": Rule(
        "held when the best calibrated-τ adaptive run of every rank stores fewer bytes than the full cache",
        (Revision(_AUDIT, "every rank instead of r ≈ d/4 only", "adaptive r = 3d/4 stores more bytes than the full cache", True),)),
    "energy ranks": Rule(
        "an energy-rank run wins when its perplexity is below that of every uniform run (same γ) storing at most its bytes; "
        "held when wins outnumber losses",
        (Revision(_AUDIT, "measured uniform runs at ≤ the bytes instead of log-bytes interpolation",
                  "interpolating across the rank → perplexity cliff favoured energy ranks that a measured cheaper uniform run beats", True),)),
    "FD ε ~ residuals": Rule(
        "held when FD ε ~ max‖ΔK_j‖ and FD ε ~ max‖ΔV_j‖ both have pooled Spearman ρ ≥ 0.5 with p < 0.05",
        (Revision(_AUDIT, "keys and values instead of keys only", "the claim is about both; values were left out", True),)),
    "γ default": Rule(
        "held when γ = √(r/d) is at most 1 point of Δppl worse than γ = 1 at every rank with both runs",
        (Revision(_AUDIT, "every rank instead of r ≈ d/4 only", "a claim about a default holds at every rank or not at all", False),)),
}
