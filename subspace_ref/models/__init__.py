"""The project's small default causal language model and its corpus.

Nothing here is imported by :mod:`subspace_ref` itself: import
:mod:`subspace_ref.models.default_model` (needs the ``models`` extra: torch, transformers,
safetensors) or :mod:`subspace_ref.models.corpus` (NumPy only) explicitly.
"""
