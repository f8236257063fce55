"""KV-cache compression baselines at matched KV bytes (issue 10; seed 001 §11 baselines).

One small dataclass per method, kvpress style; each knows its bytes per token
(:mod:`subspace_ref.byte_convention`; :mod:`.budget` configures each for a budget) and, except
:class:`Subspace` (scored by the project's own ``SubspaceCache``), gives a per-layer runtime for
the shared attention function (:mod:`._attention`): ``with applied(model, method): model(...)``.

================  =============================================================
``QuantizedKV``   2/4/8-bit KV, keys per channel over token groups, values per token
``SlidingWindow`` the last W tokens
``StreamingLLM``  S attention-sink tokens + the last W
``H2O``           heavy hitters by accumulated attention + the last R tokens
``Subspace``      static subspace projection, fp16 or INT8 coefficients
``SubspaceWindow`` static subspace projection + a sliding window
================  =============================================================

The experiment is ``subspace_ref.lab.experiments.baselines`` (``subspace-kv baselines``).
"""

from subspace_ref.lab.baselines._attention import ATTN_NAME, applied, token_logprobs
from subspace_ref.lab.baselines.budget import BUDGETS, methods_at, subspace_ranks_for
from subspace_ref.lab.baselines.combined import Subspace, SubspaceWindow
from subspace_ref.lab.baselines.h2o import H2O
from subspace_ref.lab.baselines.quantized import QuantizedKV, fake_quant, quantize_keys
from subspace_ref.lab.baselines.sliding_window import SlidingWindow, window_keep
from subspace_ref.lab.baselines.streaming_llm import StreamingLLM

__all__ = [
    "ATTN_NAME", "BUDGETS", "H2O", "QuantizedKV", "SlidingWindow", "StreamingLLM", "Subspace", "SubspaceWindow", "applied",
    "fake_quant", "methods_at", "quantize_keys", "subspace_ranks_for", "token_logprobs", "window_keep",
]
