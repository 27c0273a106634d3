"""``train-eagle``'s data: the target's own greedy answers to the distillation prompts
(``training.eagle_prompts``), with what the head learns from at every token -- the
features it reads and the target's next-token distribution -- captured while the
target writes the answers.

Captured while decoding, which computes them anyway: a second target pass over the
finished chats for those labels would cost as much as the head's training step, and
halve the steps the time budget allows.

Prompts are prefilled and their answers decoded greedily, one token per chat per
pass, until EOS or ``max_tokens``, many chats to a pass. Per token: the features
(``capture`` layers, bfloat16) and the ``TOP`` likeliest next tokens with their
probabilities over the whole vocabulary (``train`` restricts them to the draft
vocabulary and renormalizes). A chat's features are those of its own context,
as when drafting. Kept in ``train/distilled.safetensors`` for resumed runs.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import SeqSpec
from engine.attention.backends import select_backend
from engine.models.decoder import head_dim_of
from kvcache.tensors import KVSpec, PagedKV

TOP = 32  # next-token probabilities kept per token
LABEL_ROWS = 1024  # rows of logits over the vocabulary at a time (a prefill has thousands)
PASS_TOKENS = 2048  # most tokens in one pass, as the engine's max_num_batched_tokens


@dataclass
class Distilled:
    """Chats laid end to end: chat ``c`` is ``tokens[starts[c] : starts[c + 1]]``."""

    tokens: torch.Tensor  # [N] int64
    starts: torch.Tensor  # [C + 1] int64
    feats: torch.Tensor  # [N, F] bfloat16: the head's features at each token
    top_ids: torch.Tensor  # [N, TOP] int32: the target's likeliest next tokens after each token
    top_p: torch.Tensor  # [N, TOP] float16: their probabilities

    def positions(self, chats: list[int]) -> torch.Tensor:
        """Positions [n] of the tokens of ``chats``, in that order."""
        return torch.cat([torch.arange(int(self.starts[c]), int(self.starts[c + 1])) for c in chats])

    def save(self, file: Path) -> None:
        from safetensors.torch import save_file

        tmp = file.with_suffix(".tmp")
        save_file({k: getattr(self, k).contiguous() for k in self.__dataclass_fields__}, str(tmp))
        tmp.replace(file)

    @classmethod
    def load(cls, file: Path) -> "Distilled":
        from safetensors.torch import load_file

        return cls(**load_file(str(file)))


@torch.no_grad()
def distill(target, prompts: list[list[int]], max_tokens: int, layers, eos: set[int], batch: int = 128,
            progress=None) -> Distilled:
    """Every prompt followed by the target's greedy answer (at most ``max_tokens``, ending
    at EOS), with features and labels. Up to ``batch`` chats are decoded at once, and a
    finished chat's place goes to the next prompt in the same pass (continuous batching,
    as the engine does); ``progress(1)`` as each chat ends."""
    cfg, block = target.config, 16
    per = -(-(max(map(len, prompts)) + max_tokens) // block)  # KV blocks per place
    kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), block, torch.float32),
                 min(batch, len(prompts)) * per, "cpu")
    attention = select_backend("auto", torch.device("cpu"), torch.float32)  # the engine's: the C kernels here
    # Rows are written in place, chat c from row base[c] on: many small tensors kept per pass
    # between the passes' large ones fragmented the heap (RSS grew 25 MB a pass, out of memory).
    base = [0]
    for p in prompts:
        base.append(base[-1] + len(p) + max_tokens)
    top = min(TOP, cfg.vocab_size)
    feats_out = torch.empty(base[-1], len(layers) * cfg.hidden_size, dtype=torch.bfloat16)
    ids_out, p_out = torch.empty(base[-1], top, dtype=torch.int32), torch.empty(base[-1], top, dtype=torch.float16)
    chats = [list(p) for p in prompts]
    waiting = list(range(len(prompts)))[::-1]
    feed: dict[int, tuple[int, list[int]]] = {}  # place -> (chat, its tokens of this pass)
    while waiting or feed:
        _admit(feed, waiting, prompts, min(batch, len(prompts)))
        places = sorted(feed)
        specs = [SeqSpec(len(chats[feed[q][0]]) - len(feed[q][1]), len(feed[q][1]), list(range(q * per, (q + 1) * per)))
                 for q in places]
        ids = torch.tensor([t for q in places for t in feed[q][1]])
        positions = torch.cat([torch.arange(s.context_len, s.context_len + s.query_len) for s in specs])
        meta = attention.build_metadata(specs, block, torch.device("cpu"))
        hidden, feats = target(ids, positions, meta, kv, capture=layers)
        top_p, top_ids = _labels(target, hidden)
        rows = torch.cat([torch.arange(base[feed[q][0]] + s.context_len, base[feed[q][0]] + s.context_len + s.query_len)
                          for q, s in zip(places, specs)])
        feats_out[rows], ids_out[rows], p_out[rows] = feats.bfloat16(), top_ids.int(), top_p.half()
        ends = (torch.tensor([s.query_len for s in specs]).cumsum(0) - 1).tolist()
        for q, end in zip(places, ends):
            c = feed[q][0]
            tokens = chats[c]
            answered = len(tokens) - len(prompts[c])
            if answered >= max_tokens or (answered and tokens[-1] in eos):
                del feed[q]  # every token of the chat has been through a pass
                if progress:
                    progress(1)
            else:
                tokens.append(int(top_ids[end, 0]))  # the argmax: greedy
                feed[q] = (c, tokens[-1:])
    keep = torch.cat([torch.arange(base[c], base[c] + len(t)) for c, t in enumerate(chats)])
    return Distilled(
        tokens=torch.tensor([t for c in chats for t in c]),
        starts=torch.tensor([0] + [len(c) for c in chats]).cumsum(0),
        feats=feats_out[keep],
        top_ids=ids_out[keep],
        top_p=p_out[keep],
    )


def _admit(feed: dict[int, tuple[int, list[int]]], waiting: list[int], prompts: list[list[int]], places: int) -> None:
    """Each free place of ``places`` gets the next waiting chat (``waiting``'s last), its prompt
    to feed, while the pass's tokens stay within ``PASS_TOKENS`` (the rest wait for the next
    pass: a pass's activations stay bounded)."""
    tokens_in_pass = len(feed)  # the decoding chats' one token each
    for place in range(places):
        if place in feed or not waiting:
            continue
        if feed and tokens_in_pass + len(prompts[waiting[-1]]) > PASS_TOKENS:
            break
        c = waiting.pop()
        feed[place] = (c, prompts[c])
        tokens_in_pass += len(prompts[c])


def _labels(target, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H] -> the ``TOP`` likeliest next tokens after each row: (probs, ids) [T, TOP]."""
    top = min(TOP, target.config.vocab_size)
    parts = [torch.softmax(target.compute_logits(h).float(), dim=-1).topk(top, dim=-1) for h in hidden.split(LABEL_ROWS)]
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])
