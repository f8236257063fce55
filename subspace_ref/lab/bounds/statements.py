"""The error bounds of seed 001 §8 and seed 003 "Approximation error and stability", one function
per statement, each a function of exactly the quantities the statement names (spec B1-B8).

The functions are plain arithmetic on floats: they say what the bound *is*, not whether it holds.
Which statements are theorems, which are the papers' forms known to fail (and their concrete
counterexamples), and which corrected forms replace them is recorded in :data:`CLAIMS` and
:data:`COUNTEREXAMPLES`; the derivations are in ``spec/bounds.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np


def _max(values: Iterable[float]) -> float:
    # an empty collection (no chunk, no token) contributes nothing to a worst case
    return max((float(v) for v in values), default=0.0)


# --------------------------------------------------------------------------- B1, B2: logits
def logit_single(gamma: float, d: int, key_residual_op: float, q_norm: float) -> float:
    """Spec B1 (seed 001 §8, paper form): ||l - l_hat||_inf <= (gamma_B / sqrt(d)) ||dK||_op ||q||_2
    with dK = K (I - P_B). Not a guarantee when gamma_B != 1 (spec B1, counterexample "gamma")."""
    return gamma / math.sqrt(d) * key_residual_op * q_norm


def logit_multichunk(gamma: float, d: int, q_norm: float, chunk_residual_ops: Iterable[float]) -> float:
    """Spec B2 (seed 001 §8 multi-chunk, paper form):
    ||l - l_hat||_inf <= (gamma_B / sqrt(d)) ||q||_2 max_j ||K_j (I - P_{B_j})||_op."""
    return gamma / math.sqrt(d) * q_norm * _max(chunk_residual_ops)


def logit_corrected(gamma: float, d: int, q_norm: float, residual_row_max: float, recon_row_max: float) -> float:
    """Spec B1.c / B2.c (corrected, a guarantee for every gamma and every reconstruction):
    ||l - l_hat||_inf <= (||q||_2 / sqrt(d)) (max_i ||k_i - k_hat_i|| + |1 - gamma| max_i ||k_hat_i||).

    For a projection state k_i - k_hat_i = (I - P_{B_j}) k_i and k_hat_i = P_{B_j} k_i."""
    return q_norm / math.sqrt(d) * (residual_row_max + abs(1.0 - gamma) * recon_row_max)


# --------------------------------------------------------------------------- B3: softmax
def softmax_tanh(logit_error: float) -> float:
    """Spec B3.1 (seed 001 §8): ||alpha - alpha_hat||_1 <= 2 tanh(||l - l_hat||_inf / 2). Tight."""
    return 2.0 * math.tanh(logit_error / 2.0)


def softmax_linear(logit_error: float) -> float:
    """Spec B3.2 (seed 001 §8): ||alpha - alpha_hat||_1 <= ||l - l_hat||_inf."""
    return float(logit_error)


# --------------------------------------------------------------------------- B4: outputs
def output_key_term(weight_error_l1: float, value_row_max: float) -> float:
    """Spec B4.1 (seed 001 §8, key term): ||(alpha - alpha_hat)^T V||_2 <= ||alpha - alpha_hat||_1 max_i ||v_i||_2."""
    return weight_error_l1 * value_row_max


def output_value_term(value_residual_ops: Iterable[float]) -> float:
    """Spec B4.2 (seed 001 §8, value term; multi-chunk form, one chunk = single basis):
    ||alpha_hat^T dV||_2 <= max_j ||dV_j||_op. Paper: dV_j = V_j (I - P_{E_j}); B4.2.c: dV_j = V_j - V_hat_j."""
    return _max(value_residual_ops)


def output_combined(logit_error: float, value_row_max: float, value_residual_ops: Iterable[float]) -> float:
    """Spec B4.3 (seed 001 §8, combined): ||o - o_hat||_2 <= 2 tanh(||l - l_hat||_inf / 2) max_i ||v_i||_2 + max_j ||dV_j||_op."""
    return softmax_tanh(logit_error) * value_row_max + output_value_term(value_residual_ops)


def output_multichunk(
    gamma: float, d: int, q_norm: float, key_residual_ops: Iterable[float], value_row_max: float, value_residual_ops: Iterable[float]
) -> float:
    """Spec B4.4 (seed 001 §8 multi-chunk, paper form):
    ||o - o_hat||_2 <= 2 tanh((gamma_B ||q||_2 / (2 sqrt d)) max_j ||K_j (I - P_{B_j})||_op) max_i ||v_i||_2
    + max_j ||V_j (I - P_{E_j})||_op."""
    logit = logit_multichunk(gamma, d, q_norm, key_residual_ops)
    return output_combined(logit, value_row_max, value_residual_ops)


def output_corrected(
    gamma: float,
    d: int,
    q_norm: float,
    key_residual_row_max: float,
    key_recon_row_max: float,
    value_row_max: float,
    value_residual_ops: Iterable[float],
) -> float:
    """Spec B4.4.c (corrected a-priori output bound, a guarantee): B4.3 with the logit error replaced
    by its bound B2.c and dV_j = V_j - V_hat_j."""
    logit = logit_corrected(gamma, d, q_norm, key_residual_row_max, key_recon_row_max)
    return output_combined(logit, value_row_max, value_residual_ops)


# --------------------------------------------------------------------------- B5, B6: Frequent Directions
def fd_lower() -> float:
    """Spec B5.1: 0 <= A^T A - S^T S, i.e. lambda_min(A^T A - S^T S) >= 0; the bound on -lambda_min is 0."""
    return 0.0


def fd_covariance(tail_energy: float, ell: int, k: int) -> float:
    """Spec B5.2 (seed 001 §8, spec A4.1): ||A^T A - S^T S||_op <= ||A - A_k||_F^2 / (ell - k) for k < ell.
    ``tail_energy`` is ||A - A_k||_F^2 = sum_{i > k} sigma_i(A)^2. With k = r this is the paper's eps."""
    if not 0 <= k < ell:
        raise ValueError(f"k must satisfy 0 <= k < ell = {ell}, got {k}")
    return tail_energy / (ell - k)


def fd_projection_paper(eps: float, gap: float) -> float:
    """Spec B6.1 (seed 001 §8, paper form): ||A (I - P)||_op <= sqrt(eps) + eta with eta = 2 eps / gap,
    gap = sigma_r(A)^2 - sigma_{r+1}(A)^2 (the gap around the r-th eigenvalue of A^T A). Not a
    guarantee: it misses sigma_{r+1}(A) (counterexample "fd_gap")."""
    eta = math.inf if gap <= 0 else 2.0 * eps / gap
    return math.sqrt(eps) + eta


def fd_projection_corrected(sigma_next: float, eps: float) -> float:
    """Spec B6.2 (corrected, a guarantee): ||A (I - P)||_op <= sqrt(sigma_{r+1}(A)^2 + eps)."""
    return math.sqrt(sigma_next**2 + eps)


def davis_kahan_angle(eps: float, gap: float) -> float:
    """Spec B6.3 (the Davis-Kahan term, used as what it bounds, an angle):
    ||sin Theta(P, P_A)||_op <= min(1, 2 eps / gap), P_A the top-r right singular space of A."""
    if gap <= 0:
        return 1.0
    return min(1.0, 2.0 * eps / gap)


def paper_fd_condition(sigma_next: float, eps: float, gap: float) -> bool:
    """When B6.1 follows from B6.2 (spec B6.1): sigma_{r+1}^2 <= eta^2 + 2 eta sqrt(eps)."""
    eta = math.inf if gap <= 0 else 2.0 * eps / gap
    return eta == math.inf or sigma_next**2 <= eta**2 + 2.0 * eta * math.sqrt(eps)


# --------------------------------------------------------------------------- B7, B8: seed 003
def seed003_logit(q_norm: float, recon_residual_op: float, d_k: int) -> float:
    """Spec B7 (seed 003): ||l - l_hat||_inf <= ||q|| ||K - C B||_op / sqrt(d_k) (the logits of
    seed 003 carry no gamma; a guarantee at gamma = 1 for every state, the rotating one included)."""
    return q_norm * recon_residual_op / math.sqrt(d_k)


def seed003_logit_gamma(q_norm: float, gamma_recon_residual_op: float, d_k: int) -> float:
    """Spec B7.c (corrected for a logit scale): ||l - l_hat||_inf <= ||q|| ||K - gamma K_hat||_op / sqrt(d_k)."""
    return q_norm * gamma_recon_residual_op / math.sqrt(d_k)


def seed003_value(energy_captured: float, value_frobenius: float) -> float:
    """Spec B8 (seed 003: "choosing r_v by energy capture bounds output error in Frobenius norm"):
    ||alpha_hat^T (V - V_hat)||_2 <= sqrt(1 - e) ||V||_F. Paper: e = sum_j ||V_j P_{E_j}||_F^2 / ||V||_F^2
    (energy the bases capture); B8.c: e = 1 - ||V - V_hat||_F^2 / ||V||_F^2 (energy the state keeps)."""
    return math.sqrt(max(1.0 - energy_captured, 0.0)) * value_frobenius


# --------------------------------------------------------------------------- the claims
@dataclass(frozen=True)
class Claim:
    """One statement of spec/bounds.md.

    ``kind`` is "guarantee" (proved in spec/bounds.md for every input it applies to) or
    "paper form" (the seeds' own statement, which the spec shows can fail; ``condition`` says
    when it still holds, ``corrected_by`` names the guarantee that replaces it and
    ``counterexample`` the entry of :data:`COUNTEREXAMPLES` that refutes it).
    """

    id: str
    title: str
    source: str
    formula: str
    kind: str
    measured: str
    condition: str = ""
    corrected_by: str | None = None
    counterexample: str | None = None
    function: Callable | None = None
    note: str = ""


_CLAIMS = [
    Claim("B1", "logit error, single basis", "seed 001 §8", "‖ℓ−ℓ̂‖∞ ≤ (γ_B/√d)·‖K(I−P_B)‖_op·‖q‖₂",
          "paper form", "‖ℓ−ℓ̂‖∞", "γ_B = 1 and k̂_i = P_B k_i (static, adaptive); more generally whenever B1.c ≤ B1",
          "B1.c", "gamma", logit_single,
          "fails at the paper's own default γ_B⁰ = √(r/d); also fails for the rotating state at γ = 1"),
    Claim("B1.c", "logit error, single basis, corrected", "spec B1", "‖ℓ−ℓ̂‖∞ ≤ (‖q‖₂/√d)·(max_i‖k_i−k̂_i‖ + |1−γ|·max_i‖k̂_i‖)",
          "guarantee", "‖ℓ−ℓ̂‖∞", function=logit_corrected),
    Claim("B2", "logit error, multi-chunk", "seed 001 §8", "‖ℓ−ℓ̂‖∞ ≤ (γ_B/√d)·‖q‖₂·max_j‖K_j(I−P_{B_j})‖_op",
          "paper form", "‖ℓ−ℓ̂‖∞", "γ_B = 1 and k̂_i = P_{B_j} k_i (static, adaptive); more generally whenever B2.c ≤ B2",
          "B2.c", "gamma", logit_multichunk),
    Claim("B2.c", "logit error, multi-chunk, corrected", "spec B2", "‖ℓ−ℓ̂‖∞ ≤ (‖q‖₂/√d)·(max_i‖k_i−k̂_i‖ + |1−γ|·max_i‖k̂_i‖)",
          "guarantee", "‖ℓ−ℓ̂‖∞", function=logit_corrected),
    Claim("B3.1", "softmax sensitivity, tanh form", "seed 001 §8", "‖α−α̂‖₁ ≤ 2·tanh(‖ℓ−ℓ̂‖∞/2)",
          "guarantee", "‖α−α̂‖₁", function=softmax_tanh, note="tight: equality at ℓ = (−δ/2, δ/2), ℓ̂ = (δ/2, −δ/2)"),
    Claim("B3.2", "softmax sensitivity, linear form", "seed 001 §8", "‖α−α̂‖₁ ≤ ‖ℓ−ℓ̂‖∞",
          "guarantee", "‖α−α̂‖₁", function=softmax_linear),
    Claim("B4.1", "output error, key term", "seed 001 §8", "‖(α−α̂)ᵀV‖₂ ≤ ‖α−α̂‖₁·max_i‖v_i‖₂",
          "guarantee", "‖(α−α̂)ᵀV‖₂", function=output_key_term),
    Claim("B4.2", "output error, value term", "seed 001 §8", "‖α̂ᵀΔV‖₂ ≤ max_j‖V_j(I−P_{E_j})‖_op",
          "paper form", "‖α̂ᵀ(V−V̂)‖₂", "v̂_i = P_{E_j} v_i (static, adaptive)", "B4.2.c", "rotating", output_value_term),
    Claim("B4.2.c", "output error, value term, corrected", "spec B4", "‖α̂ᵀ(V−V̂)‖₂ ≤ max_j‖V_j−V̂_j‖_op",
          "guarantee", "‖α̂ᵀ(V−V̂)‖₂", function=output_value_term),
    Claim("B4.3", "output error, combined", "seed 001 §8", "‖o−ô‖₂ ≤ 2·tanh(‖ℓ−ℓ̂‖∞/2)·max_i‖v_i‖₂ + max_j‖V_j(I−P_{E_j})‖_op",
          "paper form", "‖o−ô‖₂", "v̂_i = P_{E_j} v_i (static, adaptive)", "B4.3.c", "rotating", output_combined),
    Claim("B4.3.c", "output error, combined, corrected", "spec B4", "‖o−ô‖₂ ≤ 2·tanh(‖ℓ−ℓ̂‖∞/2)·max_i‖v_i‖₂ + max_j‖V_j−V̂_j‖_op",
          "guarantee", "‖o−ô‖₂", function=output_combined),
    Claim("B4.4", "output error, multi-chunk a priori", "seed 001 §8",
          "‖o−ô‖₂ ≤ 2·tanh((γ_B‖q‖₂/2√d)·max_j‖K_j(I−P_{B_j})‖_op)·max_i‖v_i‖₂ + max_j‖V_j(I−P_{E_j})‖_op",
          "paper form", "‖o−ô‖₂", "B2 and B4.2 are guaranteed (γ_B = 1, static or adaptive)", "B4.4.c", "gamma", output_multichunk),
    Claim("B4.4.c", "output error, multi-chunk a priori, corrected", "spec B4",
          "‖o−ô‖₂ ≤ 2·tanh(δ_c/2)·max_i‖v_i‖₂ + max_j‖V_j−V̂_j‖_op, δ_c the bound B2.c",
          "guarantee", "‖o−ô‖₂", function=output_corrected),
    Claim("B5.1", "FD sketch never overestimates", "spec A4.1", "λ_min(AᵀA − SᵀS) ≥ 0",
          "guarantee", "max(0, −λ_min(AᵀA−SᵀS))", function=fd_lower),
    Claim("B5.2", "FD covariance guarantee", "seed 001 §8, spec A4.1", "‖AᵀA − SᵀS‖_op ≤ ‖A−A_r‖_F²/(ℓ−r) = ε",
          "guarantee", "‖AᵀA−SᵀS‖_op", function=fd_covariance),
    Claim("B6.1", "FD-to-projection linkage (Davis–Kahan)", "seed 001 §8", "‖A(I−P)‖_op ≤ √ε + η, η = 2ε/gap",
          "paper form", "‖A(I−P)‖_op", "σ_{r+1}(A)² ≤ η² + 2η√ε (then it follows from B6.2)", "B6.2", "fd_gap",
          fd_projection_paper, "misses σ_{r+1}(A): no rank-r projector does better than σ_{r+1}(A)"),
    Claim("B6.2", "FD-to-projection linkage, corrected", "spec B6", "‖A(I−P)‖_op ≤ √(σ_{r+1}(A)² + ε)",
          "guarantee", "‖A(I−P)‖_op", function=fd_projection_corrected),
    Claim("B6.3", "Davis–Kahan angle", "spec B6", "‖sin Θ(P, P_A)‖_op ≤ min(1, 2ε/gap)",
          "guarantee", "‖(I−P)P_A‖_op", function=davis_kahan_angle),
    Claim("B7", "logit error via the reconstruction", "seed 003", "‖ℓ−ℓ̂‖∞ ≤ ‖q‖·‖K − CB‖_op/√d_k",
          "paper form", "‖ℓ−ℓ̂‖∞", "γ = 1 (any state, the rotating one included); more generally whenever B7.c ≤ B7",
          "B7.c", "gamma", seed003_logit),
    Claim("B7.c", "logit error via the reconstruction, with γ", "spec B7", "‖ℓ−ℓ̂‖∞ ≤ ‖q‖·‖K − γK̂‖_op/√d_k",
          "guarantee", "‖ℓ−ℓ̂‖∞", function=seed003_logit_gamma),
    Claim("B8", "value error by energy capture", "seed 003", "‖α̂ᵀ(V−V̂)‖₂ ≤ √(1−e)·‖V‖_F, e = Σ_j‖V_jP_{E_j}‖_F²/‖V‖_F²",
          "paper form", "‖α̂ᵀ(V−V̂)‖₂", "v̂_i = P_{E_j} v_i (static, adaptive)", "B8.c", "rotating", seed003_value),
    Claim("B8.c", "value error by kept energy", "spec B8", "‖α̂ᵀ(V−V̂)‖₂ ≤ √(1−ê)·‖V‖_F = ‖V−V̂‖_F, ê = 1 − ‖V−V̂‖_F²/‖V‖_F²",
          "guarantee", "‖α̂ᵀ(V−V̂)‖₂", function=seed003_value),
]

#: Every statement of spec/bounds.md by id, in spec order.
CLAIMS: dict[str, Claim] = {c.id: c for c in _CLAIMS}


# --------------------------------------------------------------------------- counterexamples
@dataclass(frozen=True)
class Counterexample:
    """Concrete inputs on which the paper forms named in ``refutes`` fail (spec B1, B6.1, B8)."""

    name: str
    refutes: tuple[str, ...]
    description: str
    build: Callable[[], dict] = field(repr=False)


def _gamma_example() -> dict:
    """Keys and values inside span(B), span(E): every residual is 0, so every paper bound with
    gamma_B is 0, yet l_hat = gamma l != l at the paper's default gamma_B^0 = sqrt(r/d)."""
    from subspace_ref import StaticBasis, SubspaceState

    d = 2
    B = np.array([[[1.0, 0.0]]])  # r = 1
    E = np.eye(2)[None]  # values stored exactly
    gamma = math.sqrt(1 / d)  # the paper's gamma_B^0 = sqrt(r/d)
    state = SubspaceState.static(StaticBasis.from_bases(B, E, gamma=gamma))
    K = np.array([[[2.0, 0.0], [0.0, 0.0]]])
    V = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    state.append(K, V)
    return dict(q=np.array([[3.0, 0.0]]), K=K, V=V, state=state)


def _fd_gap_example(r: int = 2, d: int = 8) -> dict:
    """Singular values (100 x r, 1, 0, ...) and ell = r + 4: eps = 1/4, eta ~ 5e-5, so B6.1 says
    ||A(I-P)|| <= 0.50005, but no rank-r projector gets below sigma_{r+1} = 1."""
    from subspace_ref import SubspaceState

    A = np.zeros((r + 1, d))
    A[np.arange(r), np.arange(r)] = 100.0
    A[r, r] = 1.0
    state = SubspaceState.adaptive(1, d, rank_k=r, rank_v=r, ell_k=r + 4, ell_v=r + 4)
    state.append(A[None], A[None])
    return dict(q=np.ones((1, d)), K=A[None], V=A[None].copy(), state=state)


def _rotating_example() -> dict:
    """The rotating state (spec A8) after one refresh: k_1 was stored in the warm-up basis e_1,
    then projected onto the new basis, losing half of it, while K(I - P_B) only sees the current
    basis. gamma = 1; the query is small (so the weights barely differ and the value error shows)
    and points along the lost part."""
    from subspace_ref import SubspaceState

    c = math.sqrt(0.5)
    K = np.array([[[1.0, 0.0], [10 * c, 10 * c]]])
    state = SubspaceState.rotating(1, 2, rank_k=1, rank_v=1, ell_k=2, ell_v=2, refresh_every=1)
    state.append(K, K.copy())
    return dict(q=np.array([[0.01 * c, 0.01 * c]]), K=K, V=K.copy(), state=state)


COUNTEREXAMPLES: dict[str, Counterexample] = {
    "gamma": Counterexample(
        "gamma", ("B1", "B2", "B4.4", "B7"),
        "d = 2, r = 1, B = e₁, E = I, γ = √(r/d) = 0.707 (the paper's default); K = [(2,0); (0,0)], V = I, "
        "q = (3,0). Every residual is 0 so the bounds are 0, but ℓ̂ = γℓ ≠ ℓ.",
        _gamma_example),
    "fd_gap": Counterexample(
        "fd_gap", ("B6.1",),
        "A = diag(100, 100, 1) padded to d = 8 (σ = 100, 100, 1, 0, …), r = 2, ℓ = r + 4 = 6: ε = 1/4, "
        "η = 2ε/gap ≈ 5·10⁻⁵, bound ≈ 0.50005 < σ₃(A) = 1 ≤ ‖A(I−P)‖ for every rank-2 P.",
        _fd_gap_example),
    "rotating": Counterexample(
        "rotating", ("B1", "B2", "B4.2", "B4.3", "B4.4", "B8"),
        "rotating state (spec A8), d = 2, r = 1, ℓ = 2, refresh every token, γ = 1, V = K: k₀ = e₁, "
        "k₁ = 10·(1,1)/√2, q = 0.01·(1,1)/√2. k₁ is coded in the warm-up basis e₁ and then "
        "projected onto the refreshed basis, so ‖k₁ − k̂₁‖ ≈ 4.98 while ‖K(I−P_B)‖_op ≈ 0.71.",
        _rotating_example),
}
