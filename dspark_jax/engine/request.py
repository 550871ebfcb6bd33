"""A request's life on the host: prompt, generated tokens, stop checks, timing."""

from __future__ import annotations

import dataclasses
import enum
import time

import numpy as np

from dspark_jax.logprobs import host_rows
from dspark_jax.sampling import SamplingParams
from dspark_jax.tokenizer import IncrementalDecoder, Tokenizer


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted: no slot or KV pages yet
    PREFILL = "prefill"  # admitted, prompt (partly) not yet in the cache
    DECODE = "decode"
    FINISHED = "finished"


@dataclasses.dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only (a final EOS / stop id included)
    text: str
    finish_reason: str  # "stop" (EOS, stop id or stop string), "length", "abort"
    stats: dict
    # With SamplingParams.logprobs: per generated token, its raw target logprob, and the top k
    # (token id, logprob) pairs, most likely first (dspark_jax/logprobs.py).
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        tokenizer: Tokenizer | None,
        eos_ids: frozenset[int],
        max_model_len: int,
        lookahead: int = 0,
    ):
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = seed
        self.status = Status.WAITING
        self.output_ids: list[int] = []
        self.num_cached = 0  # tokens whose K/V are in the cache
        self.finish_reason: str | None = None
        # A grammar (a compiled dspark_jax.grammar Grammar) is walked on the host too, to end the
        # request where only EOS may follow; its EOS always stops it.
        self.grammar = params.compiled_grammar
        self.grammar_state = 0  # the grammar's state after the committed tokens
        self.grammar_row = None  # its first row in the engine's grammar pool while admitted
        eos = eos_ids if self.grammar is not None or not params.ignore_eos else frozenset()
        self.stop_ids = frozenset(params.stop_token_ids) | eos
        self.processed = params.needs_processed_steps  # runs the engine's processed executables
        wants = params.logprobs is not None
        self.logprobs: list[float] | None = [] if wants else None  # per output token (GenerationResult)
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if wants else None
        # Never generate past the model's context: the last token needs a position < max_model_len.
        # `lookahead` positions past the last token are touched too (a speculative round writes
        # a whole draft block beyond it), so they must also fit and be reserved.
        self.lookahead = lookahead
        self.max_new = min(params.max_new_tokens, max_model_len - len(self.prompt_ids) - lookahead)
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self._text = ""
        # Committed ids not detokenized yet.  Without stop strings nothing on the commit path
        # needs the text, so it is decoded when read (a streaming server reads it every step; a
        # batch call once, at the end): at batch 64 the per-commit decoder calls were about half
        # of a speculative round's commit time on the GPU host.
        self._undecoded: list[int] = []
        self.spec_rounds: list[tuple[int, int, int]] = []  # (accept len, window, block accept len) per round
        self.page_row = None  # the engine's page-table row for this request (fixed once admitted)
        self.slot = -1  # the engine's slot index while it decodes (rows of per-slot device buffers)
        self.slot_generation = -1  # which occupant of that slot this is
        self.t_arrival = time.perf_counter()
        self.t_first_token: float | None = None
        self.t_finish: float | None = None

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def reserve_tokens(self) -> int:
        """KV slots this request can ever need: admission reserves them up front."""
        return len(self.prompt_ids) + self.max_new + self.lookahead

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def commit(self, ids, logprobs=None) -> list[int]:
        """Commit a decode step's or round's tokens: every one but the last is now in the cache
        (the last is the next step's input).  Returns the ids kept (cut at a stop condition)."""
        self.num_cached = self.total_len - 1 + len(ids)
        return self.append_tokens(ids, logprobs)

    def append_tokens(self, ids, logprobs=None) -> list[int]:
        """Commit generated tokens, stopping at the first stop condition; logprobs: theirs (host
        TokenLogprobs, a row per id), kept for the committed ones when the request asked.

        Returns the ids actually committed (a multi-token commit, as speculative decoding
        produces, is cut at an EOS or stop string inside it)."""
        if self.status is Status.FINISHED:
            return []
        committed = self._append(list(map(int, ids)))
        if self.logprobs is not None and committed:
            chosen, top = host_rows(logprobs, len(committed), self.params.logprobs)
            self.logprobs += chosen
            self.top_logprobs += top
        return committed

    def replay(self, ids, logprobs=None, top_logprobs=None, finish_reason: str | None = None) -> list[int]:
        """Commit what another process's engine committed for this request (a data-parallel
        replica on another host): the same ids, cut by the same stop rules, with that engine's
        logprobs (lists, as GenerationResult holds them) and its end, if it ended."""
        committed = self._append(list(map(int, ids))) if self.status is not Status.FINISHED else []
        if self.logprobs is not None and committed and logprobs is not None:
            self.logprobs += list(logprobs[:len(committed)])
            self.top_logprobs += [[tuple(p) for p in row] for row in top_logprobs[:len(committed)]]
        if finish_reason is not None:
            self.finish(finish_reason)
        return committed

    def _append(self, ids: list[int]) -> list[int]:
        if ids and self.t_first_token is None:
            self.t_first_token = time.perf_counter()
        if self.params.stop:  # stop strings: detokenize token by token to cut at the exact one
            committed = []
            for t in ids:
                if self.status is Status.FINISHED:
                    break
                self.output_ids.append(t)
                committed.append(t)
                self._check_stop(t)
                if self.grammar is not None and self.status is not Status.FINISHED and self._walk_grammar([t]) is not None:
                    self.finish("stop")
            return committed
        # No stop strings: find the cut from the ids alone, then detokenize the whole run in one
        # call (a speculative round commits up to gamma + 1 tokens per request).
        room = self.max_new - len(self.output_ids)
        committed, reason = ids[:room], None
        if self.stop_ids and not self.stop_ids.isdisjoint(committed):  # (one set test for the usual case)
            n = next(i for i, t in enumerate(committed) if t in self.stop_ids) + 1
            committed, reason = committed[:n], "stop"
        if self.grammar is not None:
            n = self._walk_grammar(committed)
            if n is not None:
                committed, reason = committed[:n], "stop"
        self.output_ids.extend(committed)
        if self.decoder is not None:
            self._undecoded.extend(committed)
        if reason is None and len(self.output_ids) >= self.max_new:
            reason = "length"
        if reason is not None:
            self.finish(reason)
        return committed

    def _walk_grammar(self, ids: list[int]) -> int | None:
        """Advance the grammar state over ids.  Where they reach a state after which only EOS
        may come, the request ends: how many of them to keep (up to that state, a token the
        grammar does not allow left out); None where it goes on."""
        g = self.grammar
        for i, t in enumerate(ids):
            nxt = g.next_state(self.grammar_state, t)
            if nxt < 0:
                return i
            self.grammar_state = nxt
            if g.terminal[nxt]:
                return i + 1
        return None

    def _decode_pending(self) -> None:
        if self._undecoded:
            pending, self._undecoded = self._undecoded, []
            self._text += self.decoder.push(pending)

    @property
    def text(self) -> str:
        """The generated text so far (whole characters; a stop string is cut off)."""
        self._decode_pending()
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._decode_pending()
        self._text = value

    def _check_stop(self, t: int) -> None:
        if self.decoder is not None:
            before = len(self.text)
            self.text += self.decoder.push([t])
            # Stop strings count once min_tokens are generated (as vLLM's stop checker).
            if self.params.stop and len(self.output_ids) >= self.params.min_tokens:
                longest = max(len(s) for s in self.params.stop)
                window_start = max(0, before - longest + 1)
                hits = [i for s in self.params.stop if (i := self.text.find(s, window_start)) >= 0]
                if hits:
                    self.text = self.text[: min(hits)]
                    return self.finish("stop")
        if t in self.stop_ids:
            return self.finish("stop")
        if len(self.output_ids) >= self.max_new:
            return self.finish("length")

    def finish(self, reason: str) -> None:
        if self.status is Status.FINISHED:
            return
        if self.decoder is not None and reason != "stop":
            self.text += self.decoder.flush()
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.t_finish = time.perf_counter()

    def result(self) -> GenerationResult:
        end = self.t_finish or time.perf_counter()
        ttft = (self.t_first_token - self.t_arrival) if self.t_first_token else None
        n = len(self.output_ids)
        decode_time = (end - self.t_first_token) if self.t_first_token else 0.0
        return GenerationResult(
            request_id=self.id,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            text=self.text,
            finish_reason=self.finish_reason or "abort",
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            top_logprobs=list(self.top_logprobs) if self.top_logprobs is not None else None,
            stats={
                "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": n,
                "ttft_s": ttft,
                "latency_s": end - self.t_arrival,
                "decode_tokens_per_s": (n - 1) / decode_time if n > 1 and decode_time > 0 else None,
                **({"spec": self.spec_stats()} if self.spec_rounds else {}),
            },
        )

    def spec_stats(self) -> dict:
        """Per-request speculative statistics (SGLang's meta_info spec_* fields, by meaning).

        accept length counts the bonus token; window counts the anchor; the block accept length
        is what verifying the whole block would have accepted (exact in static and cap-accept,
        a lower bound in compact, where drafts past the window are never scored)."""
        acc, win, blk = (np.asarray(x) for x in zip(*self.spec_rounds))
        return {
            "verify_ct": len(acc),
            "accept_length": float(acc.mean()),
            "accept_lens": acc.tolist(),
            "window": float(win.mean()),
            "window_histogram": np.bincount(win).tolist(),
            "block_accept_length": float(blk.mean()),
            "utilization": float(acc.sum() / blk.sum()) if blk.sum() else None,
        }
