"""Typed, frozen server settings, filled from CLI flags and SPECSERVE_* environment variables.

Precedence: a CLI flag, then the environment (``SPECSERVE_MAX_MODEL_LEN=4096``),
then the default below. Flags are the field names with dashes
(``--max-model-len``), named as vLLM names them where vLLM has the setting.
Each component gets only its slice: the engine an ``EngineConfig``
(``engine_config()``), uvicorn the host and port, the serving layer the limits.
"""

from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from engine.worker.model_store import DEFAULT_MODEL_NAME
from engine.spec_decode.registry import DRAFTERS, check_speculative


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_", frozen=True, extra="forbid")

    # -- model (engine) --
    model: str | None = Field(
        None, description="local Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    served_model_name: Annotated[list[str] | None, NoDecode] = Field(
        None, description="model name(s) clients use; the first is reported (default: the --model value)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="weight and activation dtype")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto", description="weights: auto (a GGUF file kept in its own block formats, a Hugging Face checkpoint as "
        "it is), none (dequantized to --dtype), int8 | int4 (a Hugging Face checkpoint quantized at load, "
        "group-wise); see docs/quantization.md"
    )
    max_model_len: int | None = Field(
        None, gt=0, description="context length: prompt plus output (default: the model's)"
    )
    seed: int = Field(0, description="seed of the engine's default random generator")
    num_threads: int | None = Field(None, gt=0, description="CPU threads for torch (default: every core)")
    attention_backend: Literal["auto", "torch", "cpu", "torch_varlen", "flash_attn"] = Field(
        "auto",
        description="attention kernels: torch (the reference), cpu (AVX2 kernel for decodes, drafts and trees; "
        "float32), torch_varlen (the CUDA fallback), flash_attn (flash-attn 2.x, CUDA, KV blocks of 256 tokens); "
        "auto picks flash_attn on CUDA when it is installed, else torch_varlen on CUDA, cpu on a float32 CPU "
        "where the kernels build, else torch",
    )
    disable_frontend_multiprocessing: bool = Field(
        False, description="run the engine on a thread of the server's process, not in an engine-core process of its "
        "own (the default: the HTTP front end and the engine's Python then never wait on one interpreter lock)"
    )
    enforce_eager: bool = Field(
        False, description="run every step eagerly: no CUDA graphs (on CUDA, decodes and chain verification are "
        "otherwise replayed from graphs captured at start-up; never on the CPU); see docs/gpu.md"
    )
    speculative_config: dict | None = Field(
        None,
        description='speculative decoding, as JSON: {"method": ' + " | ".join(f'"{m}"' for m in DRAFTERS)
        + ', "num_speculative_tokens": k, "model": path (draft and head methods), ...}; see docs/speculation.md',
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="processes the model is split across (gloo on the CPU, NCCL on GPUs; see docs/parallelism.md)"
    )
    nnodes: int = Field(1, ge=1, description="machines the tensor-parallel group spans (torchrun's --nnodes)")
    node_rank: int = Field(0, ge=0, description="this machine's index, 0 .. nnodes - 1; node 0 runs the server")
    master_addr: str = Field("127.0.0.1", description="address of node 0, where the group meets")
    master_port: int = Field(
        0, ge=0, lt=65536, description="port node 0 listens on for the group (0: any free port, one machine only)"
    )
    headless: bool = Field(
        False, description="run this node's tensor-parallel workers only, no HTTP server (nodes 1 .. nnodes - 1)"
    )
    per_request_spec_decode_stats: Literal["none", "summary", "detailed"] = Field(
        "none", description="speculative_decoding_stats on each choice (the terminal chunk when streaming): summary "
        "(acceptance length and rate, histogram, counts) or detailed (also per step accepted and drafted)"
    )
    # -- KV cache and scheduler (engine) --
    block_size: int = Field(16, gt=0, description="tokens per KV-cache block")
    kv_cache_memory_bytes: int = Field(1 << 30, gt=0, description="KV-cache budget in bytes on the CPU")
    kv_cache_dtype: Literal["auto", "bfloat16"] = Field(
        "auto", description="KV-cache element type: auto (the model's dtype) or bfloat16 (half the bytes of a "
        "float32 cache, so twice the blocks for the same budget; keys and values rounded to bfloat16, attention "
        "still in float32; see docs/cpu.md)"
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="CUDA: fraction of the GPU's memory for weights, activations and the KV cache; "
        "the KV cache gets what a profiled largest step leaves"
    )
    num_gpu_blocks_override: int | None = Field(
        None, gt=0, description="KV-cache blocks to allocate, instead of what the memory profile leaves (as vLLM's "
        "flag; on the CPU instead of --kv-cache-memory-bytes)"
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV blocks of prompt prefixes already computed (shared system prompts, "
        "earlier conversation turns)"
    )
    max_num_seqs: int = Field(64, gt=0, description="requests running at once")
    max_num_batched_tokens: int = Field(512, gt=0, description="tokens computed per engine step")
    max_waiting: int = Field(1024, gt=0, description="queued requests beyond which new ones get a 503")
    max_concurrent_requests: int | None = Field(
        None, gt=0, description="HTTP generation requests in flight beyond which new ones get a 503 (default: no limit)"
    )
    max_request_seconds: float | None = Field(
        None,
        gt=0,
        description="a generation request still running after this many seconds is aborted and ends with a "
        "request_timeout error (default: no limit)",
    )
    # -- HTTP --
    host: str = Field("0.0.0.0", description="address to listen on")
    port: int = Field(8000, ge=0, lt=65536, description="port to listen on")
    api_key: SecretStr | None = Field(None, description="require 'Authorization: Bearer <key>' on /v1/*")
    protect_metrics: bool = Field(False, description="with --api-key, /metrics requires the key too")
    allowed_origins: Annotated[list[str] | None, NoDecode] = Field(
        None, description="CORS: origins browsers may call from, comma-separated or '*' (default: CORS off)"
    )
    max_request_body_bytes: int = Field(4 << 20, gt=0, description="larger request bodies get a 413")
    max_n: int = Field(16, gt=0, description="largest n (choices per prompt) a request may ask for")
    shutdown_timeout: float = Field(30.0, ge=0, description="seconds in-flight requests get to finish after SIGTERM")
    drain_delay: float = Field(
        0.0, ge=0, description="seconds after SIGTERM during which /health answers 503 (routers and readiness probes "
        "take the replica out) while requests are still served; then the listener closes and --shutdown-timeout starts",
    )
    # -- logging --
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["text", "json"] = Field("text", description="text (key=value) or one JSON object per line")
    disable_log_requests: bool = Field(False, description="do not log one line per request")

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _split_names(cls, v):
        if isinstance(v, str):
            return [name.strip() for name in v.split(",") if name.strip()]
        return v

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _split_origins(cls, v):
        """Comma-separated in the environment; on the command line either way."""
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            return [o.strip() for item in v for o in str(item).split(",") if o.strip()] or None
        return v

    @field_validator("speculative_config")
    @classmethod
    def _check_speculative(cls, v):
        """Unknown keys, bad values, an unknown method, a missing draft or head path: ValueError."""
        try:
            check_speculative(SpeculativeConfig.from_dict(v))
        except TypeError as e:  # a value of the wrong type, e.g. "num_speculative_tokens": "4"
            raise ValueError(f"a speculative-config value has the wrong type: {e}") from None
        return v

    @model_validator(mode="after")
    def _check_nodes(self):
        if self.headless != (self.node_rank > 0):
            raise ValueError("--headless is for the nodes other than node 0 (--node-rank 1 ..), and they need it")
        self.engine_config()  # raises ValueError for a group that does not split
        return self

    @model_validator(mode="after")
    def _check_protect_metrics(self):
        if self.protect_metrics and self.api_key is None:
            raise ValueError("protect_metrics needs an api_key")
        return self

    @property
    def model_names(self) -> list[str]:
        """The names clients may use; the first one is reported in responses."""
        return list(self.served_model_name or [self.model or DEFAULT_MODEL_NAME])

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                dtype=self.dtype,
                device=self.device,
                max_model_len=self.max_model_len,
                seed=self.seed,
                num_threads=self.num_threads,
                attention_backend=self.attention_backend,
                quantization=self.quantization,
                enforce_eager=self.enforce_eager,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                memory_bytes=self.kv_cache_memory_bytes,
                num_blocks=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
            ),
            speculative=SpeculativeConfig.from_dict(self.speculative_config),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size, nnodes=self.nnodes, node_rank=self.node_rank,
                master_addr=self.master_addr, master_port=self.master_port,
            ),
        )
