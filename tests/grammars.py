"""Grammars over a tiny model's vocabulary of plain strings."""

import xgrammar as xgr

from engine.worker.grammar import Grammars


def vocab_grammars(tokens: list[str], stop_ids: list[int]) -> Grammars:
    """``Grammars`` for a vocabulary of plain strings, token id = index."""
    return Grammars(xgr.TokenizerInfo(tokens, stop_token_ids=stop_ids))
