"""Triton backend of subspace_ref: ``TritonBackend`` and its kernels.

``import subspace_ref_triton`` imports neither torch nor triton, and never touches CUDA. The
kernel modules are imported on first use, because Triton decides when a kernel is *decorated*
whether it will run compiled (GPU) or on the CPU interpreter (``TRITON_INTERPRET=1``):

* :mod:`subspace_ref_triton.decode` -- decode attention over the chunked coefficient cache
  (spec A2, A3, A3.2): ``decode_partials`` / ``merge_partials`` / ``decode_attention``, each
  beside a pure-torch ``*_reference``;
* :mod:`subspace_ref_triton.project` -- the projection step of appending (spec A6 step 1,
  A7 steps 1-2): ``project_append`` and ``project_append_reference``;
* :mod:`subspace_ref_triton.workspace` -- ``DecodeWorkspace``, a decode step that a CUDA graph
  can capture (device-resident token count, preallocated partials);
  :mod:`subspace_ref_triton.graph_op` -- the same step as the torch operator
  ``subspace_ref_triton::workspace_decode``, which a compiled step calls without a graph break;
* :mod:`subspace_ref_triton.occupancy` -- resident programs per SM and the split count that
  fills the device once; :mod:`subspace_ref_triton.compile_report` and
  :mod:`subspace_ref_triton.gpu_report` -- ``subspace-kv gpu-report``, the kernels compiled for
  sm_80 / sm_90 as they launch, on a machine without a GPU.

Everything else (FD sketches, triggers, warm-up, rotation) is the torch backend's code.
"""

from subspace_ref_triton.backend import TritonBackend

__all__ = ["TritonBackend"]
