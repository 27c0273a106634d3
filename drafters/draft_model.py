"""Drafting with a separate, smaller model that shares the target's tokenizer.

The drafter keeps its own paged KV cache. Each step it first reads the
committed tokens it has not seen (a new request's whole context; afterwards the
correction or bonus token, plus its own last draft after a fully accepted
round), then drafts ``k`` tokens one forward pass at a time, batched over the
requests. Each draft is sampled from q, the draft model's distribution processed
with the request's own sampling settings (temperature, top-k, top-p, min-p,
penalties with the earlier drafts in the context); q travels with the drafts so
that verification divides by the distribution really sampled from.

Cache contents after drafting ``d_1 .. d_k`` over ``L0`` committed tokens: the
``L0`` tokens and ``d_1 .. d_{k-1}`` (``d_k`` is sampled, never fed). ``commit``
keeps the longest prefix of that which the target committed and rolls back
the rest.

Chains and token trees grow alike (``drafters.tree_drafting``; a chain is a tree of
width 1), one depth per forward; node ``i`` (of every level but the deepest, which
is never fed) sits at offset ``L0 + i``. After a tree, ``commit`` first moves the
accepted path's entries to ``L0, L0 + 1, ...`` (``kvcache.tensors.move_slots``), as
the target's runner does, then rolls back as for a chain.
"""

import torch

from drafters.tree_drafting import GrowingTree, grow_trees, template_of
from engine.utils import tree
from engine.attention import SeqSpec
from engine.attention.backends import TORCH, AttentionBackend
from engine.worker.gpu_memory import DrafterMemory
from engine.models.decoder import head_dim_of
from engine.core.request import Request
from engine.worker.sampler import build_sampling_batch, mask_logits, penalized_logits, processed_probs
from engine.spec_decode.drafter import Draft, Drafter, DraftSlot
from engine.utils.transfer import to_device
from kvcache import KVCacheManager
from kvcache.manager import slot_mapping
from kvcache.tensors import KVSpec, PagedKV, move_slots


class SamplingDrafter(Drafter):
    """A drafter that samples each draft from a model's processed distribution q."""

    deterministic = False

    def __init__(self, device):
        self.device = device
        self.generators: dict[str, tuple[int, torch.Generator]] = {}  # id -> (committed length, its round's stream)

    @torch.inference_mode()
    def propose(self, slots: list[DraftSlot]) -> dict[str, Draft]:
        """A tree per slot, a chain where the slot has no shape (``grow_trees`` over
        ``_tree_forward``: one forward per depth)."""
        live = [s for s in slots if s.num_draft_tokens > 0 and self._can_draft(s) and self._reserve_tree(s)]
        return grow_trees(live, self._tree_forward, self._distributions, self._generator, self.device) if live else {}

    def _can_draft(self, slot: DraftSlot) -> bool:
        return True

    def _reserve_tree(self, slot: DraftSlot) -> bool:
        """KV for every node the slot's tree may have (False: no blocks left, no draft)."""
        return True

    def _distributions(self, logits: torch.Tensor, requests: list[Request], prefixes: list[tuple[int, ...]]):
        """(q, penalized logits) [n, vocab] of each row, after the drafts ``prefixes[i]``."""
        batch = build_sampling_batch(requests, logits.shape[-1], self.device, [None] * len(requests), prefixes)
        logits = mask_logits(logits, requests, [list(p) for p in prefixes])
        return processed_probs(logits, batch), penalized_logits(logits, batch)

    def _generator(self, request: Request) -> torch.Generator | None:
        """A seeded request's draft stream for this round: seeded from its seed and its
        committed length, so what it draws never depends on what happened to the drafter's
        state (a failed batch, a reset) nor on other requests."""
        seed = request.params.seed
        if seed is None or request.params.greedy:
            return None
        held = self.generators.get(request.request_id)
        if held is None or held[0] != request.num_tokens:
            g = torch.Generator(self.device).manual_seed(round_seed(seed, request.num_tokens))
            held = self.generators[request.request_id] = (request.num_tokens, g)
        return held[1]

    def rollback(self, request: Request) -> None:
        self.generators.pop(request.request_id, None)  # the round's stream restarts from its key
        self.commit(request)

    def free(self, request_id: str) -> None:
        self.generators.pop(request_id, None)


def round_seed(seed: int, num_tokens: int) -> int:
    """The seed of a request's draft stream in the round after ``num_tokens`` committed
    tokens: distinct from the target sampler's ``seed`` and from every other round's."""
    return (seed * 0x9E3779B97F4A7C15 + num_tokens * 0xBF58476D1CE4E5B9 + 0x5DEECE66D) % (1 << 63)


class ModelDrafter(SamplingDrafter):
    """``target_vocab``: the target's vocabulary size where the draft's differs (the same
    tokenizer, embedding rows padded to another size, as Qwen2.5 0.5B and 7B): the draft's
    logits are cut or padded (-inf) to it, so that q is a distribution over the target's
    token ids, sampled from as it is; a token id past the draft's rows reaches it as id 0,
    which only changes its guesses, never what is accepted."""

    def __init__(self, model, num_layers: int, num_blocks: int, block_size: int, kv_dtype, device, cost_per_token: float,
                 attention: AttentionBackend = TORCH, target_vocab: int | None = None):
        super().__init__(device)
        self.model, self.num_layers = model, num_layers
        self.target_vocab = target_vocab or model.config.vocab_size
        self.block_size = block_size
        self.build_metadata = attention.build_metadata  # the target's backend (``cpu``: one C call a layer)
        cfg = model.config
        spec = KVSpec(num_layers, cfg.num_key_value_heads, head_dim_of(cfg), block_size, kv_dtype)
        self.kv = KVCacheManager(num_blocks, block_size)
        self.paged = PagedKV(spec, num_blocks, device)
        self.cost_per_token = cost_per_token
        self.cached: dict[str, list[int]] = {}  # request id -> tokens whose KV is in the draft cache
        self.grown: dict[str, tuple[int, GrowingTree, int]] = {}  # id -> (L0, its tree this step, nodes fed)

    def _reserve_tree(self, slot: DraftSlot) -> bool:
        """KV for the committed tokens and every node the slot's tree may have."""
        self._cached(slot.request)
        return self.kv.allocate_slots(slot.request.request_id, slot.request.num_tokens + len(template_of(slot)))

    def _tree_forward(self, trees: list[GrowingTree], depth: int) -> torch.Tensor:
        """Logits [rows, vocab] after each node of ``depth - 1`` (the root at 0) of every tree: one
        forward over the committed tokens not yet cached (at depth 0) and the tree's nodes
        not in the cache (``GrowingTree.unfed``: node ``i`` sits at offset ``L0 + i``)."""
        specs, ids, positions, rows, start = [], [], [], [], 0
        for g in trees:
            rid, tokens = g.slot.request.request_id, g.slot.request.token_ids
            cached = self._cached(g.slot.request)
            feed = tokens[len(cached) :]  # empty past depth 0
            first, nodes = g.unfed() or (0, tuple(g.parents))
            fed = tree.with_prefix(len(feed), nodes) if feed else nodes
            specs.append(SeqSpec(len(cached) + first, len(fed), self.kv.block_table(rid),
                                 None if tree.is_chain(fed) else fed))
            ids.extend(feed + g.token_ids[first:])
            positions.extend((len(cached) + first + tree.depths(fed)).tolist())
            rows.extend(start + len(feed) + n - first for n in g.level(depth))
            start += len(fed)
            cached.extend(feed)
            g.num_fed = len(g.parents)
            self.grown[rid] = (len(tokens), g, len(g.parents))
        t = lambda a: to_device(a, self.device, torch.long)  # noqa: E731
        meta = self.build_metadata(specs, self.block_size, self.device)
        hidden = self._hidden(t(ids), t(positions), meta)  # [T, hidden]
        return self._logits(hidden[t(rows)])  # one head pass for every tree

    def _cached(self, request: Request) -> list[int]:
        return self.cached.setdefault(request.request_id, [])

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """ids, positions [T] -> the draft's hidden states [T, hidden]."""
        ids = torch.where(ids < self.model.config.vocab_size, ids, 0)  # a target id past the draft's rows
        return self.model(ids, positions, meta, self.paged, num_layers=self.num_layers)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, target vocabulary]."""
        logits = self.model.compute_logits(hidden)
        extra = self.target_vocab - logits.shape[-1]
        if extra < 0:
            return logits[:, : self.target_vocab]
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf")) if extra else logits

    def commit(self, request: Request) -> None:
        cached = self.cached.get(request.request_id)
        if cached is None:
            return
        self._keep_tree_path(request, cached)
        keep = 0
        final = request.token_ids
        # The last committed token is always fed again: drafting needs its logits.
        while keep < len(cached) and keep < len(final) - 1 and cached[keep] == final[keep]:
            keep += 1
        del cached[keep:]
        self.kv.truncate(request.request_id, keep)

    def _keep_tree_path(self, request: Request, cached: list[int]) -> None:
        """After a tree round: the accepted path's fed nodes, moved to follow the ``L0``
        committed tokens, become the cached tokens after them."""
        grown = self.grown.pop(request.request_id, None)
        if grown is None:
            return
        base, g, num_fed = grown
        path, node = [], -1
        for token in request.token_ids[base:]:
            node = next((i for i, p in enumerate(g.parents) if p == node and g.token_ids[i] == token), None)
            if node is None or node >= num_fed:
                break
            path.append(node)
        table = self.kv.block_table(request.request_id)
        if path != list(range(len(path))):
            src = slot_mapping(table, base, base + path[-1] + 1, self.block_size)[path]
            dst = slot_mapping(table, base, base + len(path), self.block_size)
            move_slots(self.paged, to_device(src, self.device), to_device(dst, self.device))
        del cached[base:]
        cached.extend(g.token_ids[i] for i in path)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.grown.pop(request_id, None)
        self.cached.pop(request_id, None)
        self.kv.free(request_id)


def build(spec, *, target, tokenizer, num_blocks, block_size, dtype, device, attention=TORCH, kv_dtype=None,
          target_path: str = "the target", **_) -> ModelDrafter:
    """A separate, smaller model that shares the target's tokenizer (of any family)."""
    from engine.worker.loader import load_model, load_tokenizer
    from engine.worker.model_store import resolve_model

    if not spec.model:
        raise ValueError('speculative method "draft_model" needs "model": a local directory or GGUF file')
    path = resolve_model(spec.model, spec.quantization)
    draft = load_model(path, dtype, device, max_positions=target.rotary.cos.shape[0], quantization=spec.quantization)
    check_same_tokenizer(tokenizer, load_tokenizer(path), target_path, str(path))
    ratio = _param_count(draft) / _param_count(target)
    return ModelDrafter(draft, draft.config.num_hidden_layers, num_blocks, block_size, kv_dtype or dtype, device, ratio,
                        attention,
                        target.config.vocab_size)


def memory_needs(spec, *, dtype, block_size, kv_dtype=None, **_) -> DrafterMemory:
    """The draft model's weights and KV bytes per block, for the GPU memory budget."""
    from engine.worker.loader import load_config, weight_bytes
    from engine.worker.model_store import resolve_model

    cfg = load_config(resolve_model(spec.model))
    kv = KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), block_size, kv_dtype or dtype)
    return DrafterMemory(weight_bytes(cfg, dtype), kv.bytes_per_block())


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """ValueError naming both models unless their tokenizers map the same strings to the same
    ids (their embedding tables may differ in padding rows: ``ModelDrafter`` bridges that)."""
    if target_tok is None or draft_tok is None:
        return
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        differ = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"the draft model {draft_name} and the target {target_name} have different tokenizers "
            f"({len(draft_vocab)} and {len(target_vocab)} tokens; first differing entries {differ}): a draft "
            "model must share the target's tokenizer"
        )


def _param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
