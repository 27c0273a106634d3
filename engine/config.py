"""Typed, frozen engine configuration, split by concern and validated once. Plain data:
torch loads only when a device or dtype is asked for."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16)."""
    from engine.utils.devices import cpu_flags

    return " avx512_bf16" in cpu_flags()


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # local directory or .gguf file; None = the default model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    num_threads: int | None = None  # CPU threads for torch; None: every core
    attention_backend: str = "auto"  # auto | torch | cpu | torch_varlen | flash_attn (engine.attention.backends)
    # Weights: auto (a GGUF file in its own block formats, a float checkpoint as it is), none
    # (everything in dtype), int8 | int4 (a float checkpoint quantized at load); engine.worker.loader
    quantization: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs (engine.worker.cuda_graphs); the CPU never uses them

    def __post_init__(self):
        check_quantization(self.quantization)

    def torch_device(self) -> torch.device:
        """The device (``engine.utils.devices.choose_device``: ValueError when CUDA is asked for and unusable)."""
        from engine.utils.devices import choose_device

        return choose_device(self.device).device

    def torch_dtype(self) -> torch.dtype:
        """auto: bfloat16 on CUDA, float32 on the CPU (our kernels' type). On the CPU, bfloat16
        runs only where the CPU multiplies it natively (AVX512-BF16; elsewhere oneDNN emulates
        it several times slower than float32), float16 not at all: ValueError, at start-up."""
        import torch

        cpu = self.torch_device().type == "cpu"
        if self.dtype == "auto":
            return torch.float32 if cpu else torch.bfloat16
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in names:
            raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {self.dtype!r}")
        if cpu and self.dtype == "float16":
            raise ValueError("--dtype float16 needs a CUDA device; on the CPU use float32 (or bfloat16 where the "
                             "CPU has AVX512-BF16)")
        if cpu and self.dtype == "bfloat16" and not cpu_has_bf16():
            raise ValueError("--dtype bfloat16 on the CPU needs AVX512-BF16, which this CPU lacks "
                             "(no avx512_bf16 in /proc/cpuinfo): use --dtype float32 (or auto)")
        return names[self.dtype]


QUANTIZATIONS = ("auto", "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "bfloat16")  # --kv-cache-dtype: auto = the model's dtype


def check_quantization(value: str) -> None:
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    memory_bytes: int = 1 << 30  # KV-cache budget; ignored when num_blocks is set
    num_blocks: int | None = None
    enable_prefix_caching: bool = True  # share full blocks of verified tokens between requests (kvcache.manager)
    # CUDA: the fraction of the GPU's memory this engine may use; the KV cache gets what the
    # weights and a profiled largest step leave of it (engine.worker.gpu_memory). Replaces memory_bytes.
    gpu_memory_utilization: float = 0.9
    # The KV cache's element type: auto (the model's dtype), or bfloat16 (keys and values rounded to
    # nearest even at the write, read back as the model's dtype: half the bytes per block).
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or (self.num_blocks is not None and self.num_blocks < 1):
            raise ValueError("block_size and num_blocks must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

    def torch_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's torch dtype for a model computing in ``model_dtype``."""
        import torch

        return model_dtype if self.kv_cache_dtype == "auto" else getattr(torch, self.kv_cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunk size)

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: ``tensor_parallel_size`` processes, each holding a shard of
    the target model and of its KV cache (``engine.distributed``), spread evenly over
    ``nnodes`` machines (torchrun's conventions: node ``node_rank`` runs ranks
    ``node_rank * L .. node_rank * L + L - 1``, L = size / nnodes; node 0 runs rank 0,
    the server). The group meets at ``master_addr:master_port`` (port 0: any free port,
    one machine only)."""

    tensor_parallel_size: int = 1
    collective_timeout_s: float = 60.0  # a collective waiting longer fails the step (a hung rank)
    heartbeat_timeout_s: float = 10.0  # a worker silent this long is declared hung
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.collective_timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise ValueError("collective_timeout_s and heartbeat_timeout_s must be positive")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0 .. nnodes - 1, got {self.node_rank} of {self.nnodes}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} does not split over {self.nnodes} nodes")
        if self.nnodes > 1 and not 0 < self.master_port < 65536:
            raise ValueError("several nodes need --master-port (the port rank 0 listens on for the group)")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The tensor-parallel ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: "SpeculativeConfig" = field(default_factory=lambda: SpeculativeConfig())
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        if self.speculative.uses_trees and self.parallel.tensor_parallel_size > 1:
            # The accepted path's KV is moved on rank 0 only (ModelRunner._keep_accepted_paths).
            raise ValueError("token trees do not run with tensor parallelism yet: use chains (tree_width 1)")

    def threads_per_rank(self) -> int:
        """CPU threads each tensor-parallel rank gives torch: ``num_threads`` when set,
        else this machine's cores shared out between its ranks (at least one each)."""
        return self.model.num_threads or cpu_share(self.parallel.ranks_per_node)


def cpu_share(num_ranks: int) -> int:
    """This machine's cores divided between ``num_ranks`` processes (at least one each)."""
    return max(1, (os.cpu_count() or 1) // num_ranks)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` (shaped like vLLM's). ``method`` None: no speculation."""

    method: str | None = None  # a name of engine.spec_decode.registry.DRAFTERS (ngram, draft_model, early_exit, eagle, ...)
    num_speculative_tokens: int = 4  # k: most drafts per request per step
    prompt_lookup_max: int = 4  # ngram: longest suffix matched
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    model: str | None = None  # draft_model: local directory or GGUF file
    quantization: str = "auto"  # draft_model: its weights, as ModelConfig.quantization
    num_layers: int | None = None  # early_exit: layers of the target that draft
    # True: each request's draft count from its measured acceptance and the measured step costs,
    # paused when drafts do not pay. False: num_speculative_tokens drafts (or the configured tree)
    # every step, and no start-up cost measurement (engine.spec_decode.fixed_policy).
    adaptive: bool = True
    # Extra cost of one verified draft, in decode steps. None: measured at start-up. Pin it to
    # make the policy's choices, and so seeded outputs, identical from one server start to the next.
    verify_cost: float | None = None
    # Token trees (engine.spec_decode.tree_policy): up to tree_width children per node (1: chains), at most
    # max_tree_nodes nodes; or vLLM's static tree literal (model drafters), e.g. [[0], [1], [0, 0]].
    tree_width: int = 1
    max_tree_nodes: int = 16
    speculative_token_tree: list | str | None = None
    # suffix (drafters.suffix), vLLM's keys: the trees' depth (pattern + drafts), finished requests whose
    # outputs stay in the global tree (0: none), drafts per matched pattern token, least draft probability.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self):
        check_quantization(self.quantization)
        self._check_suffix()
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.tree_width < 1 or self.max_tree_nodes < 1:
            raise ValueError("tree_width and max_tree_nodes must be at least 1")
        if self.speculative_token_tree is not None:
            if self.method == "ngram":
                raise ValueError('"speculative_token_tree" is for model drafters; ngram grows trees from "tree_width"')
            self._check_tree_depth(self.static_tree())  # validates

    def _check_suffix(self) -> None:
        if not 2 <= self.suffix_decoding_max_tree_depth <= 64:
            raise ValueError("suffix_decoding_max_tree_depth must be in [2, 64]")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be 0 (no global tree) or more")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError("suffix_decoding_max_spec_factor must be positive")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")

    def _check_tree_depth(self, parents: tuple[int, ...]) -> None:
        """A round accepts at most ``num_speculative_tokens`` drafts: the policy's records and
        the metrics' per-position counts have that many places."""
        from engine.utils.tree import depths

        depth = int(depths(parents).max()) + 1
        if depth > self.num_speculative_tokens:
            raise ValueError(
                f"speculative_token_tree is {depth} nodes deep, more than num_speculative_tokens="
                f"{self.num_speculative_tokens}: set num_speculative_tokens to {depth} or more, or use a shallower tree"
            )

    @property
    def uses_trees(self) -> bool:
        return self.tree_width > 1 or self.speculative_token_tree is not None

    def static_tree(self) -> tuple[int, ...] | None:
        """The parent list of ``speculative_token_tree`` (engine.utils.tree), or None."""
        from engine.utils.tree import parse_static_tree

        literal = self.speculative_token_tree
        if literal is None:
            return None
        if isinstance(literal, str):  # vLLM writes it as a string of a Python literal
            import ast

            try:
                literal = ast.literal_eval(literal)
            except (ValueError, SyntaxError) as e:
                raise ValueError(f"speculative_token_tree is not a list of tuples: {e}") from None
        if not isinstance(literal, (list, tuple)) or not literal or not all(isinstance(n, (list, tuple)) for n in literal):
            raise ValueError("speculative_token_tree must be a non-empty list of tuples of child indices")
        return parse_static_tree([tuple(n) for n in literal])

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig":
        if not d:
            return cls()
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown speculative-config keys {sorted(unknown)}; known: {sorted(known)}")
        if d.get("method") == "suffix":  # vLLM's default: drafts as deep as the tree; and trees
            d = {"num_speculative_tokens": d.get("suffix_decoding_max_tree_depth", 24), "tree_width": 4, **d}
        return cls(**d)
