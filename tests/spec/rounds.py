"""Distribution checks over several speculative rounds, on a tiny Llama whose
output depends on its KV cache, its positions and its attention masks.

Every emitted token must follow the target's processed distribution given the
tokens before it, whichever round, draft, sibling, recovered or bonus position
it came from. ``conditional_p_value`` tests exactly that: it groups the samples
by the tokens they emitted before position ``j`` (for every ``j``), compares each
group's counts at ``j`` with the target's processed row after that prefix (one
exact forward of the target per group, no enumeration), and adds the groups'
Pearson statistics, which under exactness are asymptotically independent
chi-squares (the chain rule: each group's counts are multinomial given the
prefixes). So a round's later positions and later rounds count as the first does.

Power is stated per test: the noncentrality ``lambda`` a bug gives at the test's
sample size (measured once, from the statistic minus its degrees of freedom over a
large run of the bugged engine, scaled to the sample size), and the probability
that the chi-square at ``df`` rejects at p < 1e-3 with it.
"""

from collections import defaultdict

import numpy as np
from scipy.stats import chi2

from tests.spec.distribution import PROMPT, V, processed

MIN_GROUP = 25  # smaller groups are left out (their expected counts are mostly below 5)


def conditional_stat(outputs: list[list[int]], next_logits, settings: dict) -> tuple[float, int]:
    """(Pearson statistic, degrees of freedom) summed over every prefix group of ``outputs``."""
    stat, df = 0.0, 0
    for j in range(min(len(o) for o in outputs)):
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for out in outputs:
            groups[tuple(out[:j])].append(out[j])
        for prefix, tokens in groups.items():
            if len(tokens) < MIN_GROUP:
                continue
            context = PROMPT + list(prefix)
            p = processed(next_logits(context), settings, context, prefix)
            s, d = _pearson(np.bincount(tokens, minlength=V), p)
            stat, df = stat + s, df + d
    return stat, df


def conditional_p_value(outputs: list[list[int]], next_logits, settings: dict) -> float:
    stat, df = conditional_stat(outputs, next_logits, settings)
    assert df > 0
    return float(chi2.sf(stat, df))


def _pearson(observed: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """One group's statistic and degrees of freedom: cells expected below 5 pooled into
    one; an observed token of probability 0 is impossible (an infinite statistic)."""
    n = observed.sum()
    if observed[p <= 0].sum() > 0:
        return float("inf"), 1
    expected = p * n
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if len(obs) < 2:
        return 0.0, 0
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
