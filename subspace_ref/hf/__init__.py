"""transformers integration: a compressed KV cache, its attention function, capture of keys /
values / queries, and teacher-forced log-likelihoods (spec/models.md).

Needs the ``models`` extra (torch, transformers >= 5); :mod:`subspace_ref` itself never imports
this package. Importing it registers nothing: ``with compress(model, bases) as kv:`` selects
the subspace attention for one model inside a block (:func:`use_subspace_attention` or
:meth:`SubspaceCache.for_model` do it until undone). Bases are saved and loaded as
:class:`CalibratedBases` (``save_pretrained`` / ``from_pretrained``).
"""

from subspace_ref.hf.allocated_states import allocated_states
from subspace_ref.hf.artifact import CalibratedBases, config_hash
from subspace_ref.hf.calibration_losses import CalibrationLosses, calibration_losses
from subspace_ref.hf.attention import (
    ATTN_IMPLEMENTATION,
    observe,
    register,
    subspace_attention,
    subspace_attention_enabled,
    use_subspace_attention,
)
from subspace_ref.hf.causal_attention import causal_attention, prefix_view
from subspace_ref.hf.cache import SubspaceCache
from subspace_ref.hf.cache_layer import SubspaceLayer
from subspace_ref.hf.grouped_layer import GroupedLayer
from subspace_ref.hf.state_factories import StateSpec, adaptive_states, full_rank_states, identity_bases, rotating_states, static_states
from subspace_ref.hf.compress import Compressed, compress
from subspace_ref.hf.graph_cache import GraphSubspaceCache, graph_refusals
from subspace_ref.hf.capture import LayerCapture, ModelCapture, capture
from subspace_ref.hf.teacher_forced import LogLikelihood, decode_token_by_token, perplexity, teacher_forced

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CalibratedBases",
    "CalibrationLosses",
    "calibration_losses",
    "Compressed",
    "GraphSubspaceCache",
    "GroupedLayer",
    "compress",
    "config_hash",
    "LayerCapture",
    "LogLikelihood",
    "ModelCapture",
    "StateSpec",
    "SubspaceCache",
    "SubspaceLayer",
    "adaptive_states",
    "allocated_states",
    "capture",
    "causal_attention",
    "decode_token_by_token",
    "full_rank_states",
    "graph_refusals",
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
