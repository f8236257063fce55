"""Triton backend of subspace_ref: ``TritonBackend`` and its kernels.

``import subspace_ref_triton`` imports neither torch nor triton, and never touches CUDA. The
kernel modules are imported on first use, because Triton decides when a kernel is *decorated*
whether it will run compiled (GPU) or on the CPU interpreter (``TRITON_INTERPRET=1``):

* :mod:`subspace_ref_triton.decode` -- decode attention over the chunked coefficient cache
  (spec A2, A3, A3.2): ``decode_partials`` / ``merge_partials`` / ``decode_attention``, each
  beside a pure-torch ``*_reference``;
* :mod:`subspace_ref_triton.project` -- the projection step of appending (spec A6 step 1,
  A7 steps 1-2): ``project_append`` and ``project_append_reference``.

Everything else (FD sketches, triggers, warm-up, rotation) is the torch backend's code.
"""

from subspace_ref_triton.backend import TritonBackend

__all__ = ["TritonBackend"]
