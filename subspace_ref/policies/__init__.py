"""One small dataclass per compression method: its hyper-parameters, checked on construction."""

from subspace_ref.policies.adaptive import AdaptivePolicy
from subspace_ref.policies.rotating import RotatingPolicy
from subspace_ref.policies.static import StaticPolicy

__all__ = ["AdaptivePolicy", "RotatingPolicy", "StaticPolicy"]
