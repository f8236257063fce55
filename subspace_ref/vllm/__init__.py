"""vLLM plugin: serve a model with its KV cache in subspace coefficients (docs/vllm.md).

Installed with the ``vllm`` extra, vLLM finds :func:`register` through the
``vllm.general_plugins`` entry point and calls it in every process it starts. Bases come from
``additional_config={"subspace_bases": DIR}`` (``--additional-config`` for ``vllm serve``) or
from ``<model>/subspace_bases``; without either, vLLM runs untouched. Importing this package
imports neither vLLM nor torch, and :mod:`subspace_ref` never imports it.
"""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the subspace attention backend and
    the start-up checks (idempotent; vLLM calls it once per process).

    Users do not call it: with the ``vllm`` extra installed vLLM does, and bases are chosen
    through ``additional_config`` (docs/vllm.md).

    Returns
    -------
    None

    Raises
    ------
    ModuleNotFoundError
        Without vLLM installed.

    Examples
    --------
    In the vLLM venv (``.venv-vllm``, docs/vllm.md "Install")::

        import subspace_ref.vllm
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        subspace_ref.vllm.register()
        "SUBSPACE_CPU_ATTN" in AttentionBackendEnum.__members__   # True
    """
    from subspace_ref.vllm.plugin import install

    install()


__all__ = ["register"]
