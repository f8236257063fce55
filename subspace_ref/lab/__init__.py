"""The lab: the research harness around the library, in one package the library never imports.

* :mod:`~subspace_ref.lab.experiments`: the papers' experiments and falsifiers (``subspace-kv experiments``, ...)
* :mod:`~subspace_ref.lab.tasks`: accuracy tasks (needle recall, next-token); ``subspace-kv tasks``
* :mod:`~subspace_ref.lab.baselines`: quantization and eviction baselines at matched KV bytes
* :mod:`~subspace_ref.lab.bounds`: the error bounds of spec/bounds.md as code; ``subspace-kv bounds``
* :mod:`~subspace_ref.lab.roofline_report`, :mod:`~subspace_ref.lab.demo`: ``subspace-kv roofline``, ``subspace-kv demo``
* :mod:`~subspace_ref.lab.corpus`, :mod:`~subspace_ref.lab.train_default_model`: the text and the
  training of the shipped model (loading it is the library's: :mod:`subspace_ref.models.default_model`)

The library (:mod:`subspace_ref`, its adapters :mod:`subspace_ref.hf` and :mod:`subspace_ref.vllm`,
and :mod:`subspace_ref.models`) imports nothing from here; only the command line
(:mod:`subspace_ref.cli`) sits above both (tests/test_import_graph.py).
"""
