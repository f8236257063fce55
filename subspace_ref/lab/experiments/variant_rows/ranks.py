"""Rows of per-head ranks by energy against uniform ranks at the same mean (seed 001 §10 "per-head
ranks by energy; adaptive per-head selection ablated"; spec/sketch_variants.md S5), for static and
adaptive states.

The packed layout (spec A9) stores max-rank coefficient columns and basis rows for every head of
a layer, so the state's ``nbytes`` counts the zero padding of the narrower heads; each energy row
carries both counts (``extra``) and says in its note how much of the saving the padding eats.
"""

from __future__ import annotations

import numpy as np

from subspace_ref.lab.experiments.variant_rows import Variant, adaptive_options, plain_rank, static_bases

GROUP = "ranks"


def matched_energy(record: dict, rank: int) -> str:
    """The calibrated energy level whose per-head ranks have the mean (keys and values, over
    layers and heads) nearest ``rank``."""
    def mean(e):
        return float(np.mean(record["energy_ranks"][e]["k"] + record["energy_ranks"][e]["v"]))

    return min(record["energy_ranks"], key=lambda e: abs(mean(e) - rank))


def coefficient_bytes(rk: list[list[int]], rv: list[list[int]], itemsize: int = 4) -> tuple[int, int]:
    """(padded, unpadded) coefficient bytes per token over all layers and heads: the layout stores
    H (max r + max r_v) numbers per layer; the heads need sum_h (r_h + r_v,h)."""
    padded = sum(len(k) * (max(k) + max(v)) for k, v in zip(rk, rv)) * itemsize
    unpadded = sum(sum(k) + sum(v) for k, v in zip(rk, rv)) * itemsize
    return padded, unpadded


def variants(ctx, record, svd) -> list[Variant]:
    from subspace_ref.lab.experiments.calibrate import static_basis
    from subspace_ref.hf import adaptive_states, static_states

    r = plain_rank(ctx, record)
    e = matched_energy(record, r)
    rk, rv = record["energy_ranks"][e]["k"], record["energy_ranks"][e]["v"]
    mk, mv = int(round(float(np.mean(rk)))), int(round(float(np.mean(rv))))
    uk = [[mk] * len(h) for h in rk]
    uv = [[mv] * len(h) for h in rv]
    padded, unpadded = coefficient_bytes(rk, rv)
    uniform_bytes, _ = coefficient_bytes(uk, uv)
    ranks_text = f"energy {float(e):.0%}: mean ranks {np.mean(rk):.1f}/{np.mean(rv):.1f} (keys/values), widest {max(map(max, rk))}/{max(map(max, rv))}"
    padding_note = (f"nbytes counts padded zero columns: {padded} coefficient bytes per token (float32) stored vs {unpadded} the "
                    f"per-head ranks need and {uniform_bytes} for uniform ranks {mk}/{mv}")
    extra = dict(energy=e, rank_k=rk, rank_v=rv, coef_bytes_per_token_padded=padded, coef_bytes_per_token_unpadded=unpadded,
                 coef_bytes_per_token_uniform=uniform_bytes)
    # tau is calibrated per uniform rank only: every adaptive row uses the plain rank's tau
    opts = adaptive_options(ctx, record, r)
    rows = [
        Variant(f"static per-head {ranks_text.split(':')[0]}", GROUP, "static",
                static_states([static_basis(record, svd, li, energy=e) for li in range(len(svd))]),
                note=f"{ranks_text}; {padding_note}", extra=extra),
        Variant(f"static uniform r{mk}/{mv}", GROUP, "static", static_states(static_bases_pair(record, svd, mk, mv)),
                note=f"uniform ranks at the mean of the {ranks_text.split(':')[0]} row", extra=dict(rank_k=mk, rank_v=mv)),
        Variant(f"adaptive per-head {ranks_text.split(':')[0]}", GROUP, "adaptive",
                adaptive_states(**{**opts, "rank_k": lambda li: tuple(rk[li]), "rank_v": lambda li: tuple(rv[li])}),
                note=f"{ranks_text}; tau of the plain rank r{r}; {padding_note}", extra=extra),
        Variant(f"adaptive uniform r{mk}/{mv}", GROUP, "adaptive", adaptive_states(**{**opts, "rank_k": mk, "rank_v": mv}),
                note=f"uniform ranks at the mean of the {ranks_text.split(':')[0]} row; tau of the plain rank r{r}", extra=dict(rank_k=mk, rank_v=mv)),
    ]
    return rows


def static_bases_pair(record: dict, svd: list[dict], rank_k: int, rank_v: int) -> list:
    """Calibrated static bases with uniform key rank ``rank_k`` and value rank ``rank_v``."""
    if rank_k == rank_v:
        return static_bases(record, svd, rank_k)
    from subspace_ref.lab.experiments.calibrate import basis_from_svd

    H = record["kv_heads"]
    return [basis_from_svd(svd[li], [rank_k] * H, [rank_v] * H, 1.0) for li in range(len(svd))]
