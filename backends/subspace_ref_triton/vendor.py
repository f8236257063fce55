"""The vendor path (issue 38 item 4, docs/gpu.md "The vendor path"): a static post-RoPE state
with float coefficients is exact attention over (γ B q, C, D) with head size r and scale 1/√d
(spec A2), so the device's fused attention (FlashAttention through torch SDPA) computes it, and
the value basis E maps its output back to d_v. The triton backend routes such states here: its
own split kernel was slower on an H200 in the first timing, and faster at 128k tokens in the
second (docs/gpu.md, "Fifth-pass kernels timed"), so the route waits on a timing of both.

GQA without expanding C and D: :func:`attention` gives SDPA one decode query per query head over
the H_kv heads of C and D (``enable_gqa``), the form timed in ``decode_gpu.py``; the same
attention written as g query rows per KV head ran 3.5x slower on an H200 (docs/gpu.md,
"Fifth-pass kernels timed"). :func:`partials` calls the flash operator itself, with the g query
heads of a KV head as its g query rows.

Exact tokens (spec/window.md W3) need the compressed part's log-sum-exp to join the merge
(spec A3.2): :func:`partials` returns it as one split partial (m = LSE, Z = 1, N = output) from
the flash operator that returns it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from subspace_ref.basis_storage import is_native
from subspace_ref.formats import FLOAT

# FlashAttention's head sizes (multiples of 8 up to 256) and 16-bit operands
HEAD_MULTIPLE = 8
MAX_HEAD = 256
DTYPES = (torch.float16, torch.bfloat16)


def refusals(q, state) -> list[str]:
    """Why ``state`` is not served by the vendor path ([] when it is)."""
    lay = state.layout
    reasons = []
    if state.policy.kind != "static":
        reasons.append(f"{state.policy.kind} states have one basis per chunk; SDPA takes one key space per head")
    if getattr(state.policy, "rope", None) is not None:
        reasons.append("pre-RoPE keys are rotated per token after the rebuild (spec/rope.md P3)")
    if lay.key_format != FLOAT or lay.value_format != FLOAT:
        reasons.append(f"{lay.coefficients} coefficients are dequantised in the kernel")
    if not is_native(lay.basis_format):
        reasons.append(f"bases stored as {lay.basis_format!r}")
    r, r_v = lay.key_coef.shape[3], lay.value_coef.shape[3]
    if r != r_v or r % HEAD_MULTIPLE or r > MAX_HEAD:
        reasons.append(f"FlashAttention takes equal key and value head sizes, multiples of {HEAD_MULTIPLE} up to {MAX_HEAD}; got r = {r}, r_v = {r_v}")
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < (8, 0):
        reasons.append("FlashAttention needs compute capability 8.0 or newer")
    if q.dtype not in DTYPES or lay.key_coef.dtype != q.dtype:
        reasons.append(f"FlashAttention takes float16/bfloat16 operands of one dtype; got q {q.dtype}, coefficients {lay.key_coef.dtype}")
    return reasons


def _projected_queries(q, layout):
    """γ_h B_h q for the g query heads of every KV head: (N, H_kv, g, r) in q's dtype (spec A2)."""
    N, Hq, d = q.shape
    H = layout.key_coef.shape[1]
    B = layout.key_bases[:, :, 0]  # (N, H, r, d): the static basis
    qg = q.view(N, H, Hq // H, d).float()
    qt = torch.matmul(qg, B.float().mT) * layout.gamma.float()[None, :, None, None]
    return qt.to(q.dtype)


def _coefficients(layout):
    T = int(layout.num_tokens)
    return layout.key_coef[:, :, :T], layout.value_coef[:, :, :T]


def _to_values(y, layout, Hq: int):
    """E_h^T y for every query row: (N, H_q, d_v) in float32."""
    E = layout.value_bases[:, :, 0].float()  # (N, H, r_v, d_v)
    out = torch.matmul(y.float(), E)
    return out.reshape(out.shape[0], Hq, out.shape[-1])


def _scale(q, scale: float | None) -> float:
    """1/√d by default (spec A2): d is the query's head size, not SDPA's (r)."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def attention(q, layout, scale: float | None):
    """Spec A2/A3 of q (N, H_q, d) over a static float layout through torch SDPA: (N, H_q, d_v) in q's dtype."""
    C, D = _coefficients(layout)
    N, Hq = q.shape[:2]
    qt = _projected_queries(q, layout).reshape(N, Hq, 1, -1)  # query head h reads KV head h // g
    y = F.scaled_dot_product_attention(qt, C, D, scale=_scale(q, scale), enable_gqa=True)  # (N, H_q, 1, r_v)
    return _to_values(y.view(N, C.shape[1], Hq // C.shape[1], -1), layout, Hq).to(q.dtype)


def partials(q, layout, scale: float | None):
    """The compressed part as one split partial (m, Z, N) of spec A3.2, shapes (N, H_q, 1),
    (N, H_q, 1), (N, H_q, 1, d_v), float32: m the log-sum-exp of the logits, Z = 1, N the output."""
    C, D = _coefficients(layout)
    qt = _projected_queries(q, layout)
    scale = _scale(q, scale)
    if q.device.type == "cuda":
        y, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, C, D, scale=scale)[:2]
    else:
        y, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, C, D, scale=scale)
    N, Hq = q.shape[:2]
    out = _to_values(y, layout, Hq)
    m = lse.float().reshape(N, Hq, 1)
    return m, torch.ones_like(m), out[:, :, None, :]


__all__ = ["attention", "partials", "refusals"]
