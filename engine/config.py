"""Engine configuration: one dataclass, validated in the user process, shipped to the children as JSON."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import msgspec

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu_native")
SCHEDULE_POLICIES = ("lpm", "fcfs")
# engine/quantization: the modes and what each needs
QUANTIZATIONS = (
    "none",
    "int8",
    "gguf",
    "gguf-q8",
)
# computed from a GGUF file's blocks (gguf-q8: activations rounded to int8)
GGUF_MODES = (
    "gguf",
    "gguf-q8",
)


@dataclass
class EngineConfig:
    """Everything the three processes need to agree on. Defaults suit the embedded model on a small CPU."""

    # None: the embedded SmolLM2-135M-Instruct; a HF directory or a .gguf file
    model_path: str | None = None
    # auto: float32 on the CPU (exact), bfloat16 on CUDA; bfloat16 on the CPU is a choice
    dtype: str = "auto"
    # none: exact weights (token parity with transformers); int8: per-channel int8 weights (CPU);
    # gguf: the GGUF file's own Q4_0/Q4_1/Q8_0 blocks (CPU, a model loaded from a .gguf);
    # gguf-q8: the same blocks against activations rounded to int8, as llama.cpp does
    quantization: str = "none"
    device: str = "auto"  # auto: CUDA when torch sees one, else the CPU (the CPU under int8)
    attention_backend: str = "auto"
    max_total_tokens: int | None = None  # KV pool size in tokens; None: derived from mem_fraction
    # share of free memory (RAM or GPU) the KV pool may take when max_total_tokens is None
    mem_fraction: float = 0.10
    max_running_requests: int = 256  # rows of the req_to_token table
    max_prefill_tokens: int = 8192  # prompt tokens in one prefill step when chunked prefill is off
    # prompt tokens per prefill step; longer prompts go in chunks; 0: off
    chunked_prefill_size: int = 2048
    enable_prefix_cache: bool = True  # RadixAttention: reuse the K/V of prompts seen before
    schedule_policy: str = "lpm"  # lpm (longest cached prefix first) or fcfs
    # share of max_new_tokens admission reserves at first (it decays)
    init_new_token_ratio: float = 0.7
    # None: the model's max_position_embeddings (more: refused at start)
    context_length: int | None = None
    num_threads: int | None = None  # torch threads in the scheduler; None: all cores
    startup_timeout: float = 600.0  # seconds to wait for the children to report ready
    show_progress: bool = False  # progress bar while the model loads
    # load transformers' tokenizer (chat templates, engine.tokenizer) while the children start, not
    # on first use (it imports torch: seconds); engine serve turns it on
    preload_tokenizer: bool = False
    # like ENGINE_PLUGINS ("a,b,pkg.module:obj"); None: read ENGINE_PLUGINS
    plugins: str | None = None
    # sequences one generate or beam_search call may create (prompts x n; a beam search's beams):
    # a few KB of input must not queue a hundred thousand requests
    max_sequences_per_call: int = 4096
    # the most bytes of hidden states one request may ask for (return_hidden_states, engine/taps)
    max_hidden_state_bytes: int = 64 * 2**20
    # A/B runs of the kernels: {row of engine/linear/choose.py's table: "off", or "on" for an opt-in row},
    # e.g. {"f32-blocks": "off"}; `engine info` prints the rows. Empty: the table's own choice.
    kernel_overrides: dict[str, str] = field(default_factory=dict)
    # tensor parallelism (docs/tensor-parallel.md): scheduler ranks over torch.distributed (gloo);
    # 1: one scheduler, no distributed start at all
    tp_size: int = 1
    nnodes: int = 1  # machines the ranks span (tp_size ranks in all, as many on each)
    node_rank: int = 0  # this machine's place among them
    # host:port of rank 0's rendezvous; None on one machine: a free loopback port
    dist_init_addr: str | None = None
    # N > 1: sum the row-parallel layers over the column shards of N ranks, in rank order, so that
    # tp_size 1 and N give bitwise the same outputs (docs/tensor-parallel.md); 0 or 1: off
    reduce_like_tp: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.kernel_overrides, dict):
            raise ValueError(f"kernel_overrides must be a dict, got {self.kernel_overrides!r}")
        from engine.linear.choose import check_overrides  # no torch: the row names alone

        check_overrides(self.kernel_overrides)
        if self.model_path is not None and not isinstance(self.model_path, (str, os.PathLike)):
            raise ValueError(
                f"model_path must be a path string, got {type(self.model_path).__name__}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.quantization != "none" and self.dtype == "bfloat16":
            raise ValueError(
                f"quantization={self.quantization!r} computes in float32; use dtype='float32' or 'auto'"
            )
        if self.quantization != "none" and self.device == "cuda":
            raise ValueError(
                f"quantization={self.quantization!r} runs on the CPU only; use device='cpu' or 'auto'"
            )
        if (
            self.quantization in GGUF_MODES
            and self.model_path is not None
            and not str(self.model_path).endswith(".gguf")
        ):
            raise ValueError(
                f"quantization={self.quantization!r} computes from a GGUF file's blocks; "
                f"model_path {str(self.model_path)!r} "
                "is not a .gguf file (leave it unset for the embedded model)"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        for name in ("max_total_tokens", "context_length", "num_threads"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in (
            "max_running_requests",
            "max_prefill_tokens",
            "max_sequences_per_call",
            "max_hidden_state_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        chunk = self.chunked_prefill_size
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
            raise ValueError(
                f"chunked_prefill_size must be a non-negative integer (0: off), got {chunk!r}"
            )
        for name in ("enable_prefix_cache", "show_progress", "preload_tokenizer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        ratio = self.init_new_token_ratio
        if not _is_number(ratio) or not 0.0 < ratio <= 1.0:
            raise ValueError(f"init_new_token_ratio must be in (0, 1], got {ratio!r}")
        if not _is_number(self.mem_fraction) or not 0.0 < self.mem_fraction < 1.0:
            raise ValueError(f"mem_fraction must be a number in (0, 1), got {self.mem_fraction!r}")
        if self.plugins is not None and not isinstance(self.plugins, str):
            raise ValueError(
                f"plugins must be a comma-separated string like ENGINE_PLUGINS, got {self.plugins!r}"
            )
        if not _is_number(self.startup_timeout) or not 0 < self.startup_timeout < math.inf:
            raise ValueError(
                f"startup_timeout must be a positive number of seconds, got {self.startup_timeout!r}"
            )

        self._validate_parallel()

    def _validate_parallel(self) -> None:
        for name in ("tp_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        rank = self.node_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {rank!r}")
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size={self.tp_size} must be a multiple of nnodes={self.nnodes} "
                "(as many ranks on each machine)"
            )
        addr = self.dist_init_addr
        if addr is not None and (
            not isinstance(addr, str) or not addr.rpartition(":")[2].isdigit()
        ):
            raise ValueError(f"dist_init_addr must be 'host:port', got {addr!r}")
        if self.nnodes > 1 and addr is None:
            raise ValueError("nnodes > 1 needs dist_init_addr (rank 0's host:port)")
        like = self.reduce_like_tp
        if not isinstance(like, int) or isinstance(like, bool) or like < 0:
            raise ValueError(f"reduce_like_tp must be 0 or a number of ranks, got {like!r}")
        if like > 1 and self.tp_size > 1 and like != self.tp_size:
            raise ValueError(
                f"reduce_like_tp={like} under tp_size={self.tp_size}: only 0, 1 or tp_size "
                "(a tp_size=1 engine sums like N ranks)"
            )
        self.check_parallel_device(self.device)

    def check_parallel_device(self, device: str) -> None:
        """Tensor parallelism and reduce_like_tp run on the CPU (gloo) only: the resolved device, again
        in the scheduler (device='auto' may resolve to CUDA)."""
        if device != "cuda":
            return
        if self.tp_size > 1:
            raise ValueError("tensor parallelism runs on the CPU (gloo) only; use device='cpu'")
        if self.reduce_like_tp > 1:
            raise ValueError("reduce_like_tp runs on the CPU only; use device='cpu'")

    def to_json(self) -> bytes:
        return msgspec.json.encode(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> "EngineConfig":
        return cls(**msgspec.json.decode(data))

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        config = cls(**kwargs)
        if config.model_path is not None:
            config.model_path = os.fspath(config.model_path)
        config.validate()
        return config


def _is_number(value) -> bool:
    """An int or float, not a bool or a string that looks like one (a string passed float() here and
    then multiplied in the scheduler)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
