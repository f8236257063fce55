"""subspace_ref: KV-cache compression by per-head low-rank subspaces, attention in coefficient space.

The NumPy/SciPy reference here is the oracle; accelerated backends (torch, triton, cupy) load
lazily by name. The mathematics is in ``spec/``; docstrings cite its items.
"""

from subspace_ref.attention import attend
from subspace_ref.backend import Availability, Backend
from subspace_ref.calibration import StaticBasis, calibrate
from subspace_ref.exact import exact_attention
from subspace_ref.frequent_directions import FrequentDirections
from subspace_ref.layer_state import HeadConfig, LayerState
from subspace_ref.registry import backends, get_backend, register_backend
from subspace_ref.state import SubspaceState

__all__ = [
    "Availability",
    "Backend",
    "FrequentDirections",
    "HeadConfig",
    "LayerState",
    "StaticBasis",
    "SubspaceState",
    "attend",
    "backends",
    "calibrate",
    "exact_attention",
    "get_backend",
    "register_backend",
]
__version__ = "0.1.0"
