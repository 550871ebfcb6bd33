"""EngineConfig: how an engine sizes its cache, batches and compiled steps (docs/decisions.md
holds the evidence behind each default)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.backend import BACKENDS

LOGIT_PROCESSORS = ("lazy", "precompile", "off")


@dataclasses.dataclass
class EngineConfig:
    max_running_requests: int = 16  # decode slots (continuous batching)
    max_model_len: int | None = None  # default: min(max_position_embeddings, 4096)
    page_size: int = 16
    num_pages: int | None = None  # default: every slot can hold max_model_len, within memory
    kv_memory_fraction: float = 0.85  # of free device memory, when the device reports it
    max_prefill_tokens: int = 512  # prefill chunk budget per step
    max_prefill_seqs: int = 8
    # Pallas kernels (attention, fused add + RMSNorm, K/V write): auto = on the GPU, else plain jnp.
    kernels: str = "auto"
    # Unrolled layer / drafting loops (auto: on the GPU, where an XLA while loop is driven from the
    # host), over layer weights split into one array per layer (layers/layer_split.py).
    unroll_decode: bool | None = None
    dtype: str | None = None  # default: float32 on CPU, else the checkpoint's
    # Context buckets: page tables double from this many tokens up to max_model_len (0: one
    # bucket), so a short context runs a step shaped for it.
    min_context_bucket: int = 8192
    compile_cache_dir: str | None = None  # the persistent XLA cache (default ~/.cache/dspark_jax/xla)
    precompile: bool = True  # False: compile each executable on first use
    # Start-up compiles the widest executable of every kind, serves, and compiles the rest in the
    # background, each step running padded on a wider one until its own is ready
    # (engine/background_compile.py).  None: on the GPU of a single-process engine.
    widest_first: bool | None = None
    overlap: bool = True  # dispatch step t+1, fed on the device, before reading step t
    seed: int = 0  # draws seeds for requests that do not bring one
    # Penalties, logit bias, min_tokens and logprobs (dspark_jax/logit_processors.py) run in
    # "processed" executables, used only by batches that hold such a request: "lazy" compiles
    # each on first use in the background (engine/background_compile.py: the batch goes on
    # without the requests that need it until it is ready), "precompile" with the
    # others (at start-up unless precompile is off; twice a speculative engine's round
    # executables), "off" refuses such requests and keeps no processor state.
    logit_processors: str = "lazy"
    # Structured output (dspark_jax/grammar): device rows of the grammar tables of admitted
    # requests (one int32 row per DFA state and vocabulary id), which also bounds one grammar's
    # states; 0: what 256 MB holds, within [256, 4096].
    grammar_states: int = 0
    # Tensor parallelism: the devices one engine's model and caches are split over (Megatron
    # style, dspark_jax/parallel); 1 keeps the single-device path exactly.
    tp_size: int = 1
    # Data parallelism: engine replicas (each on its own tp_size devices) behind the server,
    # which routes each request to the least-loaded one.  An Engine itself is one replica.
    dp_size: int = 1

    def validate(self) -> None:
        if self.max_running_requests < 1 or self.max_prefill_tokens < 1 or self.max_prefill_seqs < 1:
            raise ValueError("max_running_requests, max_prefill_tokens and max_prefill_seqs must be >= 1")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.min_context_bucket < 0:
            raise ValueError(f"min_context_bucket must be >= 0, got {self.min_context_bucket}")
        if self.kernels not in BACKENDS:
            raise ValueError(f"kernels must be one of {BACKENDS}, got {self.kernels!r}")
        if self.logit_processors not in LOGIT_PROCESSORS:
            raise ValueError(f"logit_processors must be one of {LOGIT_PROCESSORS}, got {self.logit_processors!r}")
        if not isinstance(self.grammar_states, int) or self.grammar_states < 0:
            raise ValueError(f"grammar_states must be an integer >= 0, got {self.grammar_states!r}")
        for name in ("tp_size", "dp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
