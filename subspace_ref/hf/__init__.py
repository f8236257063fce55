"""transformers integration: a compressed KV cache, its attention function, capture of keys /
values / queries, and teacher-forced log-likelihoods (spec/models.md).

Needs the ``models`` extra (torch, transformers >= 5); :mod:`subspace_ref` itself never imports
this package. Importing it registers nothing: :func:`use_subspace_attention` (or
:meth:`SubspaceCache.for_model`) registers the attention implementation and selects it for one
model.
"""

from subspace_ref.hf.attention import (
    ATTN_IMPLEMENTATION,
    causal_attention,
    observe,
    prefix_view,
    register,
    subspace_attention,
    subspace_attention_enabled,
    use_subspace_attention,
)
from subspace_ref.hf.cache import (
    StateSpec,
    SubspaceCache,
    SubspaceLayer,
    adaptive_states,
    full_rank_states,
    identity_bases,
    rotating_states,
    static_states,
)
from subspace_ref.hf.capture import LayerCapture, ModelCapture, capture
from subspace_ref.hf.teacher_forced import LogLikelihood, decode_token_by_token, perplexity, teacher_forced

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LayerCapture",
    "LogLikelihood",
    "ModelCapture",
    "StateSpec",
    "SubspaceCache",
    "SubspaceLayer",
    "adaptive_states",
    "capture",
    "causal_attention",
    "decode_token_by_token",
    "full_rank_states",
    "identity_bases",
    "observe",
    "perplexity",
    "prefix_view",
    "register",
    "rotating_states",
    "static_states",
    "subspace_attention",
    "subspace_attention_enabled",
    "teacher_forced",
    "use_subspace_attention",
]
