"""Rows of the "storage" group (spec/storage.md; seed 001 §10 "bases in FP16 by default;
optional FP8/INT8 bases ablated"): static and adaptive at ``plain_rank`` with bases stored
native, float16, float8_e4m3 or int8, and INT8 coefficients (spec A10) with float16 bases.
Bytes per token come with every scored row (``score``'s ``bytes_per_token``)."""

from __future__ import annotations

from subspace_ref.basis_storage import FORMATS
from subspace_ref.lab.experiments.variant_rows import Variant, adaptive_options, plain_rank, static_bases


def variants(ctx, record: dict, svd: list[dict]) -> list[Variant]:
    from subspace_ref.hf import adaptive_states, static_states

    r = plain_rank(ctx, record)
    bases = static_bases(record, svd, r)
    rows = []
    for fmt in FORMATS:
        for plain, factory in (
            ("static", static_states(bases, basis_format=fmt)),
            ("adaptive", adaptive_states(**adaptive_options(ctx, record, r), basis_format=fmt)),
        ):
            rows.append(Variant(f"{plain} r={r}, {fmt} bases", "storage", plain, factory,
                                note="spec/storage.md S1", extra={"bases": fmt, "rank": r}))
    for plain, factory in (
        ("static", static_states(bases, coefficients="int8", basis_format="float16")),
        ("adaptive", adaptive_states(**adaptive_options(ctx, record, r), coefficients="int8", basis_format="float16")),
    ):
        rows.append(Variant(f"{plain} r={r}, int8 coefficients + float16 bases", "storage", plain, factory,
                            note="spec A10 + spec/storage.md S1 (seed 001 §10's default storage)",
                            extra={"bases": "float16", "coefficients": "int8", "rank": r}))
    return rows
