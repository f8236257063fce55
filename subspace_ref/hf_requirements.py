"""The transformers release the caches of :mod:`subspace_ref.hf` need, and its one check
(spec/models.md M9).

A module beside the ``hf`` package, not in it, so that reading :data:`MIN_TRANSFORMERS` imports
neither torch nor transformers (the tests' skips read it first; the import graph counts it with
``hf``). Only the caches need that release: the rest of :mod:`subspace_ref.hf` (capture,
:class:`~subspace_ref.hf.CalibratedBases`) imports and runs on older ones, as in the vLLM
plugin's venv (docs/vllm.md).
"""

from __future__ import annotations

#: The first transformers release whose ``generate`` takes ``cache=`` and whose ``Cache`` /
#: ``StaticLayer`` the caches subclass as they do (pyproject.toml's ``models`` extra says the same).
MIN_TRANSFORMERS = "5.24"


def installed_transformers() -> str:
    """The installed transformers' ``__version__``, which :func:`require_cache_api` compares."""
    import transformers

    return transformers.__version__


def require_cache_api(what: str) -> None:
    """ImportError naming ``what``, the installed transformers version and
    :data:`MIN_TRANSFORMERS` when the installed one is older; what every cache's constructor
    calls first, before anything changes."""
    from packaging.version import Version  # a dependency of transformers

    found = installed_transformers()
    if Version(found) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"{what} needs transformers >= {MIN_TRANSFORMERS} (generate's cache= keyword and the Cache API it subclasses), "
            f"found transformers {found}; pip install -c constraints.txt 'subspace_ref[models]'",
            name="transformers",
        )


__all__ = ["MIN_TRANSFORMERS", "installed_transformers", "require_cache_api"]
