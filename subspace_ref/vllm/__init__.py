"""vLLM plugin: serve a model with its KV cache in subspace coefficients (docs/vllm.md).

Installed with the ``vllm`` extra, vLLM finds :func:`register` through the
``vllm.general_plugins`` entry point and calls it in every process it starts. Bases come from
``additional_config={"subspace_bases": DIR}`` (``--additional-config`` for ``vllm serve``) or
from ``<model>/subspace_bases``; without either, vLLM runs untouched. Importing this package
imports neither vLLM nor torch, and :mod:`subspace_ref` never imports it.
"""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the subspace attention backend and
    the start-up checks (idempotent; vLLM calls it once per process)."""
    from subspace_ref.vllm.plugin import install

    install()


__all__ = ["register"]
