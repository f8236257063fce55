"""The experiment runner: the papers' experiments and falsifiers on the shipped model and MiniLM.

One module per subcommand, each exposing ``add_arguments(parser)`` and ``run(args) -> int``:

========================  ==============================================================
``calibration``           static bases, energy ranks, gamma (MSE, held out), tau (95th pct.)
``ppl``                   perplexity vs rank: static / adaptive / rotating, gamma, sides,
                          INT8, energy vs uniform ranks, by position, KV bytes per token
``spectra``               singular values and energy vs r, pre/post RoPE, per window;
                          residual traces with chunk triggers
``falsify``               seed 001 §11 falsifiers 1-4 and seed 003's three, with verdicts
``variants``              the papers' variants and ablations against the plain methods, with
                          verdicts (pays off / costs / trade-off)
``minilm``                all-MiniLM-L6-v2 (BERT): spectra and embedding fidelity per rank
``report``                docs/experiments.md and its figures, from the JSON outputs
``main_job``              ``experiments``: the short version (``--quick``, default) or all of
                          the above in sequence (``--full``)
========================  ==============================================================

Shared by them: ``_common`` (model, corpus windows, profiles, JSON, figures), ``statistics``
(intervals that resample whole windows or instances), ``rules`` (every verdict's decision rule with
its revision history), ``page`` (the one markdown/text table and page builder).

Every subcommand writes JSON (and CSV where tabular) under ``--out`` (default
``results/experiments``) and figures under ``OUT/figures``; ``report`` copies the figures it
references to ``docs/figures``. ``python -m subspace_ref.lab.experiments SUBCOMMAND ...`` runs one
without the ``subspace-kv`` entry points.
"""

#: subcommand name -> (module, help): the entries for subspace_ref.cli.SUBCOMMANDS.
SUBCOMMANDS = {
    "experiments": (
        "subspace_ref.lab.experiments.main_job",
        "the experiments: --quick table (default, about 1 min) or --full run and docs/experiments.md (about 25 min)",
    ),
    "calibration": ("subspace_ref.lab.experiments.calibrate", "the calibration study: static bases, energy ranks, gamma and tau from calibration text"),
    "ppl": ("subspace_ref.lab.experiments.ppl", "perplexity vs rank for static, adaptive, rotating states"),
    "spectra": ("subspace_ref.lab.experiments.spectra", "K/V singular values, energy vs rank, pre/post RoPE, residual traces"),
    "falsify": ("subspace_ref.lab.experiments.falsify", "the seeds' falsifiers with verdicts"),
    "minilm": ("subspace_ref.lab.experiments.minilm", "all-MiniLM-L6-v2: K/V spectra and embedding fidelity per rank"),
    "variants": ("subspace_ref.lab.experiments.variants", "the papers' variants (RoPE, storage, sharing, sketches, ranks, window) against the plain methods"),
    "report": ("subspace_ref.lab.experiments.report", "write docs/experiments.md from the experiment outputs"),
}
