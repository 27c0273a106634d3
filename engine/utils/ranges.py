"""Concatenated integer ranges in one numpy pass: a step's per-request offsets (positions,
rows, query offsets) without one ``np.arange`` per request."""

import numpy as np


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``arange(starts[i], starts[i] + lengths[i])`` for each i, concatenated. [sum(lengths)] int64.

    >>> ranges(np.array([5, 0]), np.array([2, 3])).tolist()
    [5, 6, 0, 1, 2]
    """
    offsets = np.cumsum(lengths) - lengths  # where each range begins in the result
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - offsets, lengths)
