"""Sampling parameters (host) and the batched, per-request-seeded sampler (device).

Each row's random key is ``fold_in(PRNGKey(seed), position)``, where position is the absolute
position of the token being sampled, so a request's output depends only on its own seed and
tokens, never on which other requests share the batch or on the step count.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.errors import InvalidRequestError


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None  # None: drawn by the engine
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; excluded from the returned text
    ignore_eos: bool = False
    # Log-probabilities (dspark_jax/logprobs.py) and logit processors (dspark_jax/logit_processors.py):
    logprobs: int | None = None  # None: none; k: the chosen token's raw target logprob and the top k (k <= 20)
    presence_penalty: float = 0.0  # OpenAI: minus this from every token generated at least once, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI: minus this times a token's generated count, in [-2, 2]
    repetition_penalty: float = 1.0  # HF/vLLM: a prompt or generated token's logit divided (> 0) or times (< 0) this
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)  # added to those ids' logits, in [-100, 100]
    # Structured output (dspark_jax/grammar): (kind, text), kind "regex", "json_schema" (text: the
    # schema as JSON) or "json_object" (text ignored).  The output then matches it, and ends (as
    # at EOS, whatever ignore_eos says) where it is complete and nothing may follow.
    grammar: tuple[str, str] | None = None
    compiled_grammar: object = dataclasses.field(default=None, repr=False, compare=False)  # set by the engine

    @property
    def processes_logits(self) -> bool:
        """Whether a penalty, logit bias, min_tokens or a grammar changes the target's distribution."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.grammar is not None)

    @property
    def needs_processed_steps(self) -> bool:
        """Whether the request needs the engine's processed executables (processors or logprobs)."""
        return self.logprobs is not None or self.processes_logits

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field (normalizing some in place); vocab_size: the real vocabulary, which
        logit_bias ids must fall in (None: checked by the engine)."""

        def bad(msg):
            raise InvalidRequestError(msg)

        if not isinstance(self.max_new_tokens, (int, np.integer)) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature < float("inf")):
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**32):
            bad(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self._validate_processors(bad, vocab_size)

    def _validate_processors(self, bad, vocab_size: int | None) -> None:
        from dspark_jax.logit_processors import MAX_LOGIT_BIAS
        from dspark_jax.logprobs import MAX_LOGPROBS

        def is_int(v):
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        def number(name, lo, hi, why=""):
            v = getattr(self, name)
            if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, bool) or not np.isfinite(v) \
                    or not lo <= v <= hi:
                bad(f"{name} must be a number in [{lo:g}, {hi:g}]{why}, got {v!r}")
            setattr(self, name, float(v))

        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 1e-6, 1e6, " (> 0, and bounded so float32 logits divided or multiplied by it "
                                                "stay finite)")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            bad(f"min_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.logit_bias, dict):
            bad(f"logit_bias must be a mapping of token id to bias, got {type(self.logit_bias).__name__}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad(f"logit_bias holds {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are accepted")
        bias = {}
        for key, value in self.logit_bias.items():
            tid = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
            if not is_int(tid):
                bad(f"logit_bias keys must be integer token ids, got {key!r}")
            if not 0 <= tid < (vocab_size if vocab_size is not None else 2**31):
                bad(f"logit_bias token id {tid} is outside the vocabulary [0, {vocab_size if vocab_size is not None else 2**31})")
            if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool) \
                    or not -100.0 <= value <= 100.0:
                bad(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {tid}")
            if int(tid) in bias:
                bad(f"logit_bias names token {tid} twice")
            bias[int(tid)] = float(value)
        self.logit_bias = bias
        if self.grammar is not None:
            from dspark_jax.grammar.compile import KINDS

            g = self.grammar
            if not (isinstance(g, (tuple, list)) and len(g) == 2 and g[0] in KINDS and isinstance(g[1], str)):
                bad(f"grammar must be (kind, text) with kind one of {KINDS} and text a string, got {g!r}")
            self.grammar = (g[0], "" if g[0] == "json_object" else g[1])


def sampling_arrays(params: list[SamplingParams], seeds: list[int], positions: list[int], rows: int):
    """Host numpy arrays for `sample`, padded to `rows` (padding rows are greedy)."""
    n = len(params)

    def column(values, dtype, fill):
        # One array from a list (not element-wise numpy assignment: a 64-row decode round
        # would spend a third of a millisecond on it), padded to `rows`.
        out = np.full(rows, fill, dtype)
        out[:n] = np.asarray(values, dtype) if n else []
        return out

    return (column([p.temperature for p in params], np.float32, 0.0),
            column([p.top_k for p in params], np.int32, 0),
            column([p.top_p for p in params], np.float32, 1.0),
            column(list(seeds), np.uint32, 0),
            column(list(positions), np.int32, 0))


def sampling_struct(rows: int) -> tuple:
    """Abstract sampling arrays (temperature, top_k, top_p, seed, position) of ``rows`` rows."""
    s = jax.ShapeDtypeStruct
    return tuple(s((rows,), d) for d in (np.float32, np.int32, np.float32, np.uint32, np.int32))


def _filtered_logits(logits, temperature, top_k, top_p):
    """Temperature-scaled logits with everything outside top-k / nucleus top-p set to -inf.

    The cut sorts every row's vocabulary, the costliest work of a sampling round (335 of ~1030 us
    of kernel time in a batch-64 speculative round on the H200 at tier 512,
    benchmarks/results/round_profile_gpu_bs64_1973ceb.md), so it runs only when some row asks for
    top-k or top-p, chosen on the device (on the H200 a ``lax.cond`` on a device value does not
    block the host: benchmarks/results/probe_host_sync_gpu_446209e.md).  A row without filters
    keeps every token either way, so its distribution does not depend on its batch."""
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    filtered = (top_k > 0) | (top_p < 1.0)
    return jax.lax.cond(jnp.any(filtered), _top_k_top_p_cut, lambda s, *_: s, scaled, top_k, top_p)


def _top_k_top_p_cut(scaled, top_k, top_p):
    V = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive cumulative mass
    # top_p 1 keeps everything, even a tail whose rounded cumulative mass reaches 1.
    keep_sorted = (mass_before < top_p[:, None]) | (top_p >= 1.0)[:, None]
    # The smallest logit still inside the nucleus; ties with it stay in.
    n_keep = jnp.maximum(keep_sorted.sum(-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


SAMPLING_VARIANTS = ("any", "greedy", "stochastic")


def sample(logits, temperature, top_k, top_p, seed, position, *, variant: str = "any"):
    """logits [R, V] fp32 -> token ids [R] int32.  Rows with temperature 0 take the argmax.

    ``variant`` says which rows a compiled step is built for:

    * "any": the sampling path runs only when some row samples, chosen on the device by
      ``lax.cond``;
    * "greedy": every row has temperature 0: the argmax alone, no sort;
    * "stochastic": the sampling path for every row, without that conditional (rows with
      temperature 0 still take the argmax), the same tokens as "any".

    An engine that knows its batch on the host (EngineConfig.sampling_variants) runs "greedy" or
    "stochastic" executables.  (The conditional was once thought to sync the host on the GPU; on
    the H200 it does not, benchmarks/results/probe_host_sync_gpu_446209e.md.)  In both sampling
    paths the top-k / top-p sort is itself behind a device-side conditional (_filtered_logits)."""
    if variant not in SAMPLING_VARIANTS:
        raise ValueError(f"variant must be one of {SAMPLING_VARIANTS}, got {variant!r}")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if variant == "greedy":
        return greedy

    def stochastic(_):
        filt = _filtered_logits(logits, temperature, top_k, top_p)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seed, position)
        drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filt).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    if variant == "stochastic":
        return stochastic(None)
    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda _: greedy, None)
