"""The subspace attention backend on vLLM's CPU paged kernel (docs/vllm.md).

vLLM's cache holds, per token and KV head, the coefficients ``c = B k`` and ``d = E v`` at the
plan's width W instead of ``k`` and ``v`` (``customize_spec`` sets head_size = head_size_v = W,
so page size, block count and admission follow). Writes project the post-RoPE keys and values
vLLM hands to ``do_kv_cache_update``; attention projects the queries ``q̃ = γ_h B_h q``, runs
vLLM's own paged kernel over the coefficients with the model's scale, and maps the result back
with ``Eᵀ``: spec A3 for a static state, ``ℓ_t = γ_h s (B_h q)·c_t``, ``o = Eᵀ Σ_t p_t d_t``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from subspace_ref.vllm.config import SubspaceConfigError, local_kv_heads
from subspace_ref.vllm.plugin import NAME, current_plan


def _plan():
    plan = current_plan()
    if plan is None:
        raise SubspaceConfigError("the subspace backend was selected without configured bases")
    return plan


class SubspaceCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with coefficients in the cache (its metadata builder and kernels, unchanged)."""

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type["SubspaceCPUAttentionImpl"]:
        return SubspaceCPUAttentionImpl

    @classmethod
    def customize_spec(cls, spec):
        plan = _plan()
        if spec.num_kv_heads % plan.pack:
            raise SubspaceConfigError(f"a layer holds {spec.num_kv_heads} KV heads on this rank, the plan packs {plan.pack} per cache head")
        spec = super().customize_spec(spec)
        return replace(spec, num_kv_heads=spec.num_kv_heads // plan.pack, head_size=plan.width, head_size_v=plan.width)


class SubspaceCPUAttentionImpl(CPUAttentionBackendImpl):
    """Projects on write and around vLLM's kernel; the layer's bases are bound on first use
    (vLLM names the layer only in the calls), sliced to this rank's KV heads."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes,
        sliding_window,
        kv_cache_dtype: str,
        logits_soft_cap=None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        sinks=None,
        **kwargs,
    ) -> None:
        refused = {
            "ALiBi slopes": alibi_slopes is not None,
            f"a sliding window of {sliding_window}": sliding_window is not None,
            "logit soft-capping": logits_soft_cap not in (None, 0),
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "KV sharing across layers": kv_sharing_target_layer_name is not None,
            "attention sinks": sinks is not None,
            f"kv_cache_dtype={kv_cache_dtype!r}": kv_cache_dtype not in ("auto", None),
            f"extra options {sorted(kwargs)}": bool(kwargs),
        }
        if any(refused.values()):
            raise SubspaceConfigError("the subspace backend does not serve a layer with " + ", ".join(k for k, v in refused.items() if v))
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.plan = _plan()
        self.model_head_size = head_size
        self.width = self.plan.width
        self._bound: str | None = None

    def _bind(self, layer) -> None:
        """This layer's bases on this rank: B^T (Hkv, d, r) and E^T (Hkv, d_v, r) for the writes;
        per query head γ B^T (Hq, d, W) and E (Hq, W, d_v), non-zero only at the slots of the
        head's KV head inside its cache head, around the kernel."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.model_executor.models.utils import extract_layer_index

        plan = self.plan
        bases = plan.layers[extract_layer_index(layer.layer_name)]
        heads = local_kv_heads(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), plan.num_kv_heads)
        if len(heads) != self.num_kv_heads:
            raise SubspaceConfigError(f"layer {layer.layer_name}: vLLM gave this rank {self.num_kv_heads} KV heads, the plan {len(heads)}")
        B = torch.from_numpy(bases.B[heads.start : heads.stop].copy())
        E = torch.from_numpy(bases.E[heads.start : heads.stop].copy())
        gamma = torch.from_numpy(bases.gamma[heads.start : heads.stop].copy())
        r, W = plan.rank, plan.width
        self.key_proj = B.transpose(1, 2).contiguous()
        self.value_proj = E.transpose(1, 2).contiguous()
        self.query_proj = torch.zeros(self.num_heads, self.model_head_size, W)
        self.out_proj = torch.zeros(self.num_heads, W, E.shape[2])
        for h in range(self.num_heads):
            k = h // self.num_queries_per_kv
            slot = slice((k % plan.pack) * r, (k % plan.pack + 1) * r)
            self.query_proj[h, :, slot] = gamma[k] * B[k].T
            self.out_proj[h, slot] = E[k]
        self._bound = layer.layer_name

    def _coefficients(self, x: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Tokens (T, Hkv, d) -> cache rows (T, Hkv / pack, W): each KV head's r coefficients in
        its slots of its cache head, zeros after the packed slots."""
        c = self._project(x, weights, torch.float32)
        T, H, r = c.shape
        c = c.reshape(T, H // self.plan.pack, self.plan.pack * r)
        if c.shape[2] < self.width:
            c = torch.nn.functional.pad(c, (0, self.width - c.shape[2]))
        return c.to(dtype).contiguous()

    @staticmethod
    def _project(x: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(T, H, a) x (H, a, b) -> (T, H, b) per head, computed in float32, contiguous in ``dtype``."""
        y = torch.bmm(x.transpose(0, 1).to(torch.float32), weights)
        return y.transpose(0, 1).to(dtype).contiguous()

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self._bound != layer.layer_name:
            self._bind(layer)
        coef_k = self._coefficients(key, self.key_proj, kv_cache.dtype)
        coef_v = self._coefficients(value, self.value_proj, kv_cache.dtype)
        super().do_kv_cache_update(layer, coef_k, coef_v, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # vLLM's warm-up call
            return output
        if self._bound != layer.layer_name:
            self._bind(layer)
        n = attn_metadata.num_actual_tokens
        q = self._project(query[:n], self.query_proj, kv_cache.dtype)
        coef_out = torch.empty_like(q)
        super().forward(layer, q, None, None, kv_cache, attn_metadata, coef_out, output_scale, output_block_scale)
        out = torch.bmm(coef_out.transpose(0, 1).to(torch.float32), self.out_proj)
        output[:n].copy_(out.transpose(0, 1))
        return output


__all__ = ["SubspaceCPUAttentionBackend", "SubspaceCPUAttentionImpl"]
