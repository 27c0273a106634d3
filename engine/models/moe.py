"""Sparse mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) and their families.

Routing: the router's logits [T, E] go through a softmax over all experts, each
token keeps its ``top_k`` experts with those probabilities as weights
(renormalized to sum 1 where the family does so). The experts run token-sorted,
never token by token: the ``T * top_k`` (token, expert) pairs are sorted by
expert, each expert multiplies its contiguous run of gathered token rows in one
batched matmul, and the weighted rows are added back to their tokens::

    tokens  t0 t1 t2, top-2: t0 -> (e3, e0), t1 -> (e0, e1), t2 -> (e3, e1)
    sorted  e0: [t0, t1]   e1: [t1, t2]   e3: [t0, t2]   (e2: none, skipped)

Under tensor parallelism every expert is split by rows, like a dense MLP (each
rank holds its slice of every expert's intermediate features, so routing skew
never leaves a rank idle); the experts' partial sums and the shared expert's
are all-reduced once per layer.

With the CPU kernels (float32, SiLU experts) the whole module is one C call,
``cpu_kernels.moe``, the same the one-call decoder layer makes: routing, the
token-sorted experts and the sum, with no torch op or host sync between them.
"""

import re

import torch
from torch import nn

from engine.layers import cpu_kernels
from engine.layers.linear import ReplicatedLinear
from engine.layers.mlp import LlamaMLP  # the experts are the dense MLP, summed by this module
from engine.models.arch import Arch, MoESpec, llama_arch
from engine.layers.parallel import TPGroup

EXPERT_NAMES = {"gate_proj": ".gate_proj.", "up_proj": ".up_proj.", "down_proj": ".down_proj."}


class SparseMoE(nn.Module):
    kernel: cpu_kernels.MoEArgs | None = None  # the module as cpu_kernels.moe takes it (set by prepack)

    def __init__(self, arch: Arch, tp: TPGroup):
        super().__init__()
        spec = arch.moe
        self.spec, self.tp = spec, tp
        self.gate = ReplicatedLinear(arch.hidden_size, spec.num_experts)  # the router
        expert = lambda size: LlamaMLP(arch.hidden_size, size, tp, arch.activation, reduce=False)  # noqa: E731
        self.experts = nn.ModuleList(expert(spec.intermediate_size) for _ in range(spec.num_experts))
        if spec.shared_intermediate_size:
            self.shared_expert = expert(spec.shared_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(arch.hidden_size, 1)
        self.activation = arch.activation

    def prepack(self) -> None:
        """Once its linear layers are laid out for the C matmul (``LlamaForCausalLM.prepack``):
        take their addresses for ``cpu_kernels.moe``, unless one of them is not in that layout
        (no kernels, not float32 on the CPU, GGUF blocks) or the experts are not SiLU's."""
        experts = [(e.gate_up_proj.kernel, e.down_proj.kernel) for e in self.experts]
        shared = None
        if hasattr(self, "shared_expert"):
            s = self.shared_expert
            shared = (self.shared_expert_gate.kernel, s.gate_up_proj.kernel, s.down_proj.kernel)
        matrices = [self.gate.kernel, *(m for pair in experts for m in pair), *(shared or ())]
        if self.activation != "silu" or any(m is None for m in matrices):
            self.kernel = None
            return
        self.kernel = cpu_kernels.moe_args(self.gate.kernel, experts, self.spec.top_k, self.spec.normalize, shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k] in x's dtype, expert ids [T, top_k])."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if self.kernel is not None and cpu_kernels.usable(x):
            return self.tp.all_reduce(cpu_kernels.moe(x, self.kernel))
        weights, ids = self.route(x)
        t, k = ids.shape
        order = torch.argsort(ids.view(-1), stable=True)  # [T * k] pairs sorted by expert
        counts = torch.bincount(ids.view(-1), minlength=self.spec.num_experts).tolist()
        rows = x.index_select(0, order // k)  # [T * k, hidden]: each pair's token, expert by expert
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, n in zip(self.experts, counts):  # a loop over experts, each a batched matmul
            if n:
                out_rows[start : start + n] = expert(rows[start : start + n])
                start += n
        # Back to token order ([T, k, hidden]), then each token's k rows weighted and summed in
        # rank order (index_add_ would scatter-add: slow on the CPU, and in no fixed order).
        pairs = out_rows.index_select(0, torch.argsort(order)).view(t, k, -1)
        out = (pairs * weights.unsqueeze(-1)).sum(dim=1)  # [T, hidden]
        if hasattr(self, "shared_expert"):
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def load_expert(self, rest: str, tensor) -> None:
        """A checkpoint tensor under ``.experts.``: ``{e}.{gate,up,down}_proj.weight`` (one
        expert's), or transformers 5's stacks of every expert, ``gate_up_proj`` [E, 2I, H] and
        ``down_proj`` [E, H, I]."""
        per_expert = re.fullmatch(r"(\d+)\.(\w+)\.weight", rest)
        if per_expert:
            e, which = int(per_expert[1]), per_expert[2]
            mlp = self.experts[e]
            if which == "down_proj":
                mlp.down_proj.load(None, tensor)
            else:
                mlp.gate_up_proj.load(("gate_proj", "up_proj").index(which), tensor)
            return
        for e, mlp in enumerate(self.experts):
            if rest == "gate_up_proj":
                mlp.gate_up_proj.load_fused(tensor[e])
            elif rest == "down_proj":
                mlp.down_proj.load(None, tensor[e])
            else:
                raise ValueError(f"unexpected expert tensor {rest!r}")


def _moe_layers(config, n: int) -> tuple[bool, ...]:
    """Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``: which layers are sparse."""
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))


def mixtral_arch(config) -> Arch:
    spec = MoESpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, normalize=True)
    renames = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
    return llama_arch(config, moe=spec, moe_layers=(True,) * config.num_hidden_layers, weight_renames=renames)


def qwen2_moe_arch(config) -> Arch:
    spec = MoESpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   bool(config.norm_topk_prob), config.shared_expert_intermediate_size)
    return llama_arch(config, qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False, moe=spec,
                      moe_layers=_moe_layers(config, config.num_hidden_layers))


def qwen3_moe_arch(config) -> Arch:
    spec = MoESpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   bool(config.norm_topk_prob))
    return llama_arch(config, qk_norm="head", moe=spec, moe_layers=_moe_layers(config, config.num_hidden_layers))


def olmoe_arch(config) -> Arch:
    spec = MoESpec(config.num_experts, config.num_experts_per_tok, config.intermediate_size,
                   bool(config.norm_topk_prob))
    return llama_arch(config, qk_norm="full", moe=spec, moe_layers=(True,) * config.num_hidden_layers)
