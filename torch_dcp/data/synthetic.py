"""Synthetic document lengths with a long tail."""

from __future__ import annotations

import numpy as np

__all__ = ["long_tail_lengths"]


def long_tail_lengths(total: int = 131072, alpha: float = 1.1, scale: int = 800, min_len: int = 64,
                      max_len: int = 32768, seed: int = 0) -> list[int]:
    """Document lengths summing to exactly ``total`` tokens, Pareto-tailed.

    Each length is ``min(max_len, min_len + floor(scale * X))`` with ``X`` Pareto(``alpha``)
    (NumPy's Lomax form, ``P(X > x) = (1 + x)^-alpha``): most documents are a few hundred
    tokens, a few run to ``max_len``. The last document is cut so the lengths sum to
    ``total``. Defaults: alpha 1.1, scale 800, 64..32768 tokens.

    Raises:
        ValueError: non-positive ``total``, ``min_len`` > ``max_len``, or ``alpha <= 0``.
    """
    if total <= 0 or min_len <= 0 or min_len > max_len or alpha <= 0:
        raise ValueError(f"bad long-tail parameters: total={total}, min_len={min_len}, max_len={max_len}, alpha={alpha}")
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    used = 0
    while used < total:
        n = int(min(max_len, min_len + np.floor(scale * rng.pareto(alpha))))
        n = min(n, total - used)
        lens.append(n)
        used += n
    return lens
