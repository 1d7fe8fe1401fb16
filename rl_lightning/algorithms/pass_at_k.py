"""The unbiased pass@k estimator: the chance that at least one of k completions is correct, from n >= k samples.

Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (https://arxiv.org/abs/2107.03374), eq. 1:
with n samples per prompt of which c are correct,

    pass@k = E_prompts[ 1 - C(n - c, k) / C(n, k) ]

computed as the paper's numerically stable product 1 - prod_{i = n - c + 1}^{n} (1 - k / i) (their Figure 3), which
never forms the binomial coefficients.
"""

from __future__ import annotations

import torch


def pass_at_k(num_samples: torch.Tensor, num_correct: torch.Tensor, k: int) -> torch.Tensor:
    """(B,) per-prompt unbiased pass@k, 1 - C(n - c, k) / C(n, k), for n = `num_samples` (B,), c = `num_correct` (B,).

    Exactly 1 where n - c < k (every k-subset holds a correct sample). Average the result over prompts for the
    dataset's pass@k. Raises `ValueError` for k < 1, k > n or c outside [0, n].
    """
    n, c = num_samples.to(torch.float64), num_correct.to(torch.float64)
    if k < 1 or bool((n < k).any()):
        raise ValueError(f"pass@k needs 1 <= k <= n samples per prompt, got k={k} and n={num_samples.tolist()}")
    if bool((c < 0).any() or (c > n).any()):
        raise ValueError(f"pass@k needs 0 <= correct <= n, got correct={num_correct.tolist()} for n={num_samples.tolist()}")
    i = torch.arange(1, int(n.max()) + 1, dtype=torch.float64)  # (I,)
    # prod_{i = n-c+1}^{n} (1 - k/i): factors outside (n - c, n] are 1
    inside = (i > (n - c)[:, None]) & (i <= n[:, None])  # (B, I)
    factors = torch.where(inside, 1.0 - k / i, torch.ones((), dtype=torch.float64))  # (B, I)
    return 1.0 - factors.prod(dim=-1)
