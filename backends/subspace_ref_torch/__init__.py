"""PyTorch backend of subspace_ref (CPU and CUDA): ``TorchBackend`` and its reusable pieces.

``import subspace_ref_torch`` does not import torch; the submodules do:

* :mod:`subspace_ref_torch.append` -- spec A6/A7/A8 appends, exact ports of the oracle's order;
* :mod:`subspace_ref_torch.attend` -- spec A2/A3 attention split into reusable steps
  (``project_queries``, ``token_chunk_index``, ``coefficient_logits``, ``softmax_weights``,
  ``chunk_value_coefficients``, ``apply_value_bases``);
* :mod:`subspace_ref_torch.plan` -- ``plan_attend``, the one decision of which route serves an attend call;
* :mod:`subspace_ref_torch.maps` -- what the routes share (work dtype, chunks, token tiles, one-chunk maps);
* :mod:`subspace_ref_torch.rows` / :mod:`subspace_ref_torch.rotary` -- stored coefficients read, pre-RoPE logits;
* :mod:`subspace_ref_torch.cpu_kernels` -- the C kernel route (spec R14);
* :mod:`subspace_ref_torch.kernel_library` -- the C kernels' build and ctypes binding;
* :mod:`subspace_ref_torch.kernel_stores` -- the kernels' quantised stores and decode-step appends;
* :mod:`subspace_ref_torch.fd` -- Frequent Directions (spec A4) on batched tensors;
* :mod:`subspace_ref_torch.convert` -- dtype names and conversion of any array to torch.
"""

from subspace_ref_torch.backend import TorchBackend

__all__ = ["TorchBackend"]
