"""Offline accuracy tasks on the shipped model (issue 12).

* :mod:`.needle`: long-range recall ("needle in a haystack") built from held-out stdlib code;
* :mod:`.next_token`: next-token top-1 accuracy and a LAMBADA-style last-identifier task.

Their intervals (``bootstrap_ci``) are in :mod:`subspace_ref.lab.experiments.statistics`.

Instances are deterministic given their seed and are saved as JSON by
``subspace_ref.lab.experiments.tasks`` so two runs compare exactly. Every task is scored from the
logits of one teacher-forced pass: greedy exact match of an answer equals "every answer byte is the
argmax given the previous bytes", and every cache here reproduces token-by-token decoding in one
pass (``subspace_ref.hf.teacher_forced``, ``subspace_ref.lab.baselines._attention``).
"""

from subspace_ref.lab.tasks.needle import NeedleInstance, make_needles, score_answer
from subspace_ref.lab.tasks.next_token import lambada_targets, next_token_correct

__all__ = ["NeedleInstance", "lambada_targets", "make_needles", "next_token_correct", "score_answer"]
