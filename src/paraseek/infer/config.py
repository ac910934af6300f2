"""The engine's settings: pure Python, so that the CLI's --help and argument checks do not import torch."""

from __future__ import annotations

from dataclasses import dataclass

from paraseek.errors import UserError

# Offline runs (`generate`, `bench-infer`) default to vLLM's offline batch settings by GPU memory
# (vllm/engine/arg_utils.py, get_batch_defaults, LLM class): on GPUs of 70 GiB or more other than the A100 (where vLLM
# measured larger steps slower) up to 1,024 sequences and 16,384 tokens a step, else 256 and 8,192. A server keeps
# EngineConfig's 256 sequences: they bound each step's latency, which streaming clients feel.
OFFLINE_LARGE_GPU_GIB = 70
OFFLINE_LARGE = (1024, 16384)
OFFLINE_SMALL = (256, 8192)
# What the caching allocator loses to rounding and fragmentation over a long run, as a share of the GPU's memory: the
# KV pool leaves it free (the planner prices the same share, planner.memory.ALLOCATOR_FRACTION).
ALLOCATOR_FRACTION = 0.02

SPEC_METHODS = ("mtp", "ngram")
# Drafts per step when --num-speculative-tokens is not given: V3's MTP module is trained to predict one token
# ahead (the V3 report measured 85-90% of its drafts accepted: of that token, sec. 5.4.3); prompt lookup's drafts cost only their
# verification, so it proposes more.
SPEC_DEFAULT_TOKENS = {"mtp": 1, "ngram": 3}
SPEC_NGRAM_MIN, SPEC_NGRAM_MAX = 2, 4
# Speculate while at most this many requests run; above it steps are plain decode steps. Measured on one H100
# (benchmarks/2026-12-05/speculative-v3cut-mtp-ngram-b1-c32-c128-h100.txt): at 32 concurrent requests both
# drafters already cost output throughput (plain 27,589 tok/s, mtp K=1 17,630, ngram K=3 6,246).
SPEC_MAX_BATCH = 16


def offline_defaults(gpu_memory_gib: float | None, gpu_name: str = "") -> tuple[int, int, str]:
    """(max_num_seqs, max_batched_tokens, why) for an offline run on this GPU (None: no GPU)."""
    if gpu_memory_gib is not None and gpu_memory_gib >= OFFLINE_LARGE_GPU_GIB and "a100" not in gpu_name.lower():
        return (*OFFLINE_LARGE, f"offline defaults for a GPU of {gpu_memory_gib:.0f} GiB")
    where = "the CPU" if gpu_memory_gib is None else f"a GPU of {gpu_memory_gib:.0f} GiB"
    if gpu_memory_gib is not None and "a100" in gpu_name.lower():
        where = "an A100"
    return (*OFFLINE_SMALL, f"offline defaults for {where}")


@dataclass
class EngineConfig:
    """The engine's knobs (flags of `paraseek generate`/`serve`); defaults are what a single-GPU server wants."""

    block_size: int = 16  # tokens per KV block: the paging and prefix-sharing granularity
    max_num_seqs: int = 256  # running sequences at most (the largest decode batch)
    max_batched_tokens: int = 8192  # tokens per step: bounds the prefill workspace; chunks long prompts
    max_model_len: int | None = None  # prompt + output tokens per sequence; default min(model's, 32768)
    gpu_memory_utilization: float = 0.9  # of the GPU's memory, for weights + workspace + graphs + KV cache
    num_kv_blocks: int | None = None  # exact pool size (tests, reproducible capacity); overrides the memory rule
    kv_cache_gib: float = 1.0  # CPU only: memory for the KV cache (the CPU has no free-memory measurement)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: e4m3 rows with fp32 scales (infer/kv_fp8.py)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    seed: int = 0
    # LoRA adapters served by name (infer/lora.py): slots allocated once, so the CUDA graphs stay valid as adapters
    # come and go. Each slot costs max_lora_rank x (in + out) weights per adapted projection, read by every step.
    max_loras: int = 0  # adapters loaded at once; 0: no adapters (vLLM's --enable-lora off)
    max_lora_rank: int = 16  # vLLM's default: rank 16 adds ~5% to the bytes a decode step reads at 8 slots (8B)
    # Speculative decoding (infer/spec.py): None, "mtp" (DeepSeek-V3's multi-token-prediction module drafts) or
    # "ngram" (prompt lookup: the tokens that followed an earlier occurrence of the sequence's suffix).
    speculative: str | None = None
    num_speculative_tokens: int | None = None  # drafts verified per step and request (K); None: SPEC_DEFAULT_TOKENS
    ngram_min: int | None = None  # the shortest suffix prompt lookup matches (None: SPEC_NGRAM_MIN)
    ngram_max: int | None = None  # the longest; the longest that matches wins (None: SPEC_NGRAM_MAX)
    speculative_max_batch: int | None = None  # speculate while at most this many requests run (None: SPEC_MAX_BATCH)

    @property
    def spec_tokens(self) -> int:
        """K: --num-speculative-tokens, or the method's default; 0 without speculative decoding."""
        if self.speculative is None:
            return 0
        return self.num_speculative_tokens or SPEC_DEFAULT_TOKENS[self.speculative]

    @property
    def spec_max_batch(self) -> int:
        return SPEC_MAX_BATCH if self.speculative_max_batch is None else self.speculative_max_batch

    @property
    def ngram_range(self) -> tuple[int, int]:
        return (SPEC_NGRAM_MIN if self.ngram_min is None else self.ngram_min,
                SPEC_NGRAM_MAX if self.ngram_max is None else self.ngram_max)

    def validate(self) -> None:
        checks = [
            (self.block_size in (8, 16, 32, 64, 128, 256), f"--block-size must be a power of two in 8..256, got {self.block_size}"),
            (self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_batched_tokens >= 1, f"--max-batched-tokens must be >= 1, got {self.max_batched_tokens}"),
            (self.max_model_len is None or self.max_model_len >= 2, f"--max-model-len must be >= 2, got {self.max_model_len}"),
            (0 < self.gpu_memory_utilization <= 1,
             f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 2, f"--num-kv-blocks must be >= 2, got {self.num_kv_blocks}"),
            (self.kv_cache_gib > 0, f"--kv-cache-gib must be positive, got {self.kv_cache_gib}"),
            (self.kv_cache_dtype in ("auto", "fp8"),
             f"--kv-cache-dtype must be auto or fp8, got {self.kv_cache_dtype!r}"),
            (self.max_loras >= 0, f"--max-loras must be >= 1, got {self.max_loras}"),
            (self.max_lora_rank >= 1, f"--max-lora-rank must be >= 1, got {self.max_lora_rank}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(msg)
        self.validate_speculative()

    def validate_speculative(self) -> None:
        """The speculative flags: one line for a value out of range or a flag that would not apply."""
        ngram = [f for f, v in (("--ngram-min", self.ngram_min), ("--ngram-max", self.ngram_max)) if v is not None]
        if self.speculative is None:
            given = (["--num-speculative-tokens"] if self.num_speculative_tokens is not None else []) + ngram + (
                ["--speculative-max-batch"] if self.speculative_max_batch is not None else [])
            if given:
                raise UserError(f"{given[0]} applies to speculative decoding: add --speculative mtp|ngram, or leave "
                                "it out")
            return
        if self.speculative not in SPEC_METHODS:
            raise UserError(f"--speculative must be one of {', '.join(SPEC_METHODS)}, got {self.speculative!r}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise UserError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 1:
            raise UserError(f"--speculative-max-batch must be >= 1, got {self.speculative_max_batch}")
        if self.spec_tokens + 1 > self.max_batched_tokens:
            raise UserError(f"--num-speculative-tokens {self.spec_tokens}: a request's step verifies its last token "
                            f"and {self.spec_tokens} drafts, more than --max-batched-tokens {self.max_batched_tokens}")
        if self.speculative != "ngram" and ngram:
            raise UserError(f"{ngram[0]} sets the prompt lookup of --speculative ngram, not of --speculative "
                            f"{self.speculative}: leave it out")
        lo, hi = self.ngram_range
        if self.speculative == "ngram" and not 1 <= lo <= hi:
            raise UserError(f"--ngram-min and --ngram-max must satisfy 1 <= min <= max, got {lo} and {hi}")

    def context_length(self, args) -> int:
        """Prompt + output tokens per sequence for the model `args`: --max-model-len, which may not exceed the
        model's positions (max_position_embeddings), else the model's, at most 32768."""
        if self.max_model_len and self.max_model_len > args.max_seq_len:
            raise UserError(f"--max-model-len {self.max_model_len} exceeds the model's max_position_embeddings "
                            f"{args.max_seq_len}")
        return self.max_model_len or min(args.max_seq_len, 32768)
