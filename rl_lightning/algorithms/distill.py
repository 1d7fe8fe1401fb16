"""On-policy distillation: a teacher's per-token log-probabilities on the student's own samples are the signal.

Two forms, as pure tensor functions:

- **Reverse KL as a per-token reward** (Agarwal et al. 2024, GKD with lambda = 1 and beta = 1; Thinking Machines'
  "On-Policy Distillation", 2025; prime-rl ``algo.type = opd``). For a completion y sampled from the student pi_s,
  the single-sample estimate of KL(pi_s || pi_t) at token t is log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t); its
  negation is the per-token reward `reverse_kl_rewards`, which `distillation_advantages` adds to each completion
  token's advantage (discount 0: each token answers for its own next-token choice, as in the blog post), scaled by
  a coefficient. The policy gradient of that reward is the gradient of the reverse KL on the student's own
  distribution (mode seeking: the student is pushed off tokens the teacher finds unlikely).
- **Generalised Jensen-Shannon divergence over the vocabulary** (`generalized_jsd`, GKD's Eq. 1,
  https://arxiv.org/abs/2306.13649): with p_t, p_s the teacher's and student's next-token distributions and the
  mixture m = beta p_t + (1 - beta) p_s, JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m). beta = 0 and 1
  are, by the paper's convention (and TRL's ``GKDTrainer``), the limits of JSD_beta / beta and JSD_beta / (1 - beta):
  the forward KL(p_t || p_s) and the reverse KL(p_s || p_t).
- **GKD's on-policy fraction lambda** (`on_policy_draw`, the paper's Algorithm 1): each step draws u ~ U[0, 1) and
  trains on the student's own samples when u < lambda, else on the dataset's completions. The draw here is a
  function of a seed and the step only (its own generator), so every rank and a resumed run draw the same.

Paper links: GKD https://arxiv.org/abs/2306.13649; MiniLLM (reverse KL) https://arxiv.org/abs/2306.08543.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["distillation_advantages", "generalized_jsd", "masked_token_mean", "on_policy_draw", "reverse_kl_rewards",
           "token_kl"]


def reverse_kl_rewards(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, completion_mask: torch.Tensor
                       ) -> torch.Tensor:
    """Per-token reward log pi_t(y_t) - log pi_s(y_t): minus the sampled estimate of KL(student || teacher).

    Args:
        logprobs: (B, T) the sampling student's log-probabilities of the sampled tokens.
        teacher_logprobs: (B, T) the teacher's log-probabilities of the same tokens.
        completion_mask: (B, T) 1 on completion tokens.

    Returns:
        (B, T) rewards, 0 off the completion.
    """
    # r_t = log pi_t(y_t | y_<t) - log pi_s(y_t | y_<t)
    return (teacher_logprobs.float() - logprobs.float()) * completion_mask


def distillation_advantages(advantages: torch.Tensor, logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                            completion_mask: torch.Tensor, coef: float) -> torch.Tensor:
    """The advantages plus `coef` x the per-token reverse-KL reward (discount 0: no reward-to-go).

    Args:
        advantages: (B, T) the task reward's advantages (any estimator; zeros for distillation alone).
        logprobs: (B, T) the sampling student's log-probabilities.
        teacher_logprobs: (B, T) the teacher's.
        completion_mask: (B, T) 1 on completion tokens.
        coef: weight of the distillation reward.

    Returns:
        (B, T) advantages.
    """
    # A_t <- A_t + coef (log pi_t(y_t) - log pi_s(y_t))
    return advantages + coef * reverse_kl_rewards(logprobs, teacher_logprobs, completion_mask)


def token_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p || q) of the next-token distributions at every position, summed over the vocabulary.

    Args:
        logits_p: (..., V) logits of p.
        logits_q: (..., V) logits of q.
        temperature: both are divided by it before the softmax.

    Returns:
        (...) KL per position (float32, or float64 for float64 logits).
    """
    logp, logq = _log_softmax(logits_p, temperature), _log_softmax(logits_q, temperature)
    # KL(p || q) = sum_v p(v) (log p(v) - log q(v))
    return (logp.exp() * (logp - logq)).sum(-1)


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(..., V) log-softmax of logits / temperature in float32 at least (float64 stays float64)."""
    return F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5,
                    temperature: float = 1.0) -> torch.Tensor:
    """GKD's generalised Jensen-Shannon divergence JSD_beta(p_t || p_s) at every position.

    Args:
        student_logits: (..., V) the student's logits.
        teacher_logits: (..., V) the teacher's logits (same vocabulary).
        beta: mixture weight of the teacher in m = beta p_t + (1 - beta) p_s, in [0, 1]; 0: forward KL(p_t || p_s),
            1: reverse KL(p_s || p_t).
        temperature: both are divided by it before the softmax.

    Returns:
        (...) divergence per position (float32, or float64 for float64 logits).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return token_kl(teacher_logits, student_logits, temperature)
    if beta == 1.0:
        return token_kl(student_logits, teacher_logits, temperature)
    logp_s, logp_t = _log_softmax(student_logits, temperature), _log_softmax(teacher_logits, temperature)  # (..., V)
    # log m = log(beta p_t + (1 - beta) p_s), stably
    log_m = torch.logaddexp(logp_t + math.log(beta), logp_s + math.log1p(-beta))
    kl_teacher = (logp_t.exp() * (logp_t - log_m)).sum(-1)  # KL(p_t || m)
    kl_student = (logp_s.exp() * (logp_s - log_m)).sum(-1)  # KL(p_s || m)
    # JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)
    return beta * kl_teacher + (1.0 - beta) * kl_student


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor | float | None = None
                      ) -> torch.Tensor:
    """Sum of `values` over the masked tokens divided by `num_tokens` (the global count; default: this mask's).

    Args:
        values: (B, T) per-token values.
        mask: (B, T) 1 on the tokens that count.
        num_tokens: the normaliser (e.g. summed over data-parallel ranks); None: ``mask.sum()`` (at least 1).

    Returns:
        Scalar.
    """
    total = num_tokens if num_tokens is not None else mask.sum().clamp(min=1)
    return (values * mask).sum() / total



def on_policy_draw(seed: int, step: int, lmbda: float) -> bool:
    """GKD's per-step choice: the student's own samples (True, probability `lmbda`) or the dataset's completions.

    Algorithm 1 of https://arxiv.org/abs/2306.13649: u ~ U[0, 1); on-policy iff u < lambda. u comes from a generator
    seeded by (`seed`, `step`) alone and the global random state is untouched, so ranks agree, a resumed run draws
    what the uninterrupted one drew, and lambda = 1 (always True) changes nothing else.

    Args:
        seed: the run's seed.
        step: the step's index (the rollout count).
        lmbda: lambda in [0, 1]; 1 is fully on-policy, 0 supervised on the dataset's completions only.

    Returns:
        Whether this step trains on the student's own samples.
    """
    if not 0.0 <= lmbda <= 1.0:
        raise ValueError(f"lmbda must be in [0, 1], got {lmbda}")
    generator = torch.Generator().manual_seed((seed * 1_000_003 + 7_919 * step + 0x6B0) % 2**63)
    return bool(torch.rand((), generator=generator) < lmbda)
