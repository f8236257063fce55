"""Loading the project's small default causal language model (the library's part of it).

Nothing here is imported by :mod:`subspace_ref` itself: import
:mod:`subspace_ref.models.default_model` (needs the ``models`` extra: torch, transformers,
safetensors) explicitly. Its corpus and its training are the lab's:
:mod:`subspace_ref.lab.corpus`, :mod:`subspace_ref.lab.train_default_model`.
"""
