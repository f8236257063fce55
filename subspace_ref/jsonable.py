"""Plain JSON types for the reports: NumPy scalars and arrays unwrapped, paths as strings."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np


def jsonable(x: Any, nonfinite: str = "string") -> Any:
    """``x`` with NumPy scalars/arrays, tuples and paths turned into JSON types. JSON has no
    literal for inf or nan: ``nonfinite="string"`` writes "inf", "-inf", "nan" (the bounds
    sweep, where they are results), ``"null"`` writes null (the experiment runner, where they
    mark a missing value)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v, nonfinite) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, nonfinite) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist(), nonfinite)
    if isinstance(x, (np.floating, float)):
        x = float(x)
        if math.isfinite(x):
            return x
        return None if nonfinite == "null" else ("inf" if x > 0 else "-inf" if x < 0 else "nan")
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, Path):
        return str(x)
    return x
