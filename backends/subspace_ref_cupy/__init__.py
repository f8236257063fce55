"""subspace_ref_cupy: the ``cupy`` backend of subspace_ref, raw CUDA kernels through CuPy.

The kernels are CUDA C++ files in ``kernels/`` (decode attention over the chunked coefficient
cache, spec A3/A3.2; projection of new tokens, spec A6/A7; INT8 coefficient storage), compiled at
run time by NVRTC for the device in use. Importing this package imports neither cupy nor torch and
does not initialise CUDA; ``CupyBackend().availability()`` says whether this machine can run it.
"""

from subspace_ref_cupy.cupy_backend import CupyBackend

__all__ = ["CupyBackend"]
