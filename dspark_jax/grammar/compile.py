"""A request's grammar compiled into a dense token DFA, through outlines-core's Index.

A regex constrains the output as it is; a JSON schema becomes a regex through outlines-core's
``build_regex_from_schema``; a JSON object is the schema ``{"type": "object"}``, whose regex
outlines writes with a bounded nesting of objects and arrays (deeper values do not parse).
outlines-core builds the regex's token-level automaton over the tokenizer's vocabulary (token
bytes as text decodes them), exported as ``table[state, token]`` -> next state, -1 where the
token is not allowed, state 0 the initial one.  EOS ids are allowed, keeping the state, in final
states and in any state that allows nothing else, so every state allows some token; a state
that allows only EOS is terminal: the request ends there.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading

import numpy as np

from dspark_jax.errors import InvalidRequestError

KINDS = ("regex", "json_schema", "json_object")
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(InvalidRequestError):
    """A grammar that cannot be compiled: an invalid regex or schema, or one too large."""


@dataclasses.dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar: table [states, V] int32 (-1: not allowed) and terminal [states] bool."""

    kind: str
    text: str
    table: np.ndarray
    terminal: np.ndarray

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.text

    @property
    def num_states(self) -> int:
        return self.table.shape[0]

    def next_state(self, state: int, token: int) -> int:
        """The state after ``token`` (-1: not allowed there)."""
        return int(self.table[state, token]) if 0 <= token < self.table.shape[1] else -1


def grammar_regex(kind: str, text: str) -> str:
    """The regex a grammar of this kind stands for."""
    from outlines_core.json_schema import build_regex_from_schema

    if kind == "regex":
        return text
    if kind == "json_object":
        text = JSON_OBJECT_SCHEMA
    elif kind != "json_schema":
        raise GrammarError(f"grammar kind must be one of {KINDS}, got {kind!r}")
    try:
        json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise GrammarError(f"the JSON schema is not valid JSON ({e})") from None
    try:
        return build_regex_from_schema(text)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def export_table(index, vocab: int, eos_ids) -> tuple[np.ndarray, np.ndarray]:
    """(table [states, vocab] int32, terminal [states] bool) of an outlines-core Index, its
    initial state renumbered 0 and the others in ascending order."""
    transitions = index.get_transitions()
    initial = index.get_initial_state()
    states = set(transitions) | {t for moves in transitions.values() for t in moves.values()}
    order = [initial] + sorted(states - {initial})
    number = {s: i for i, s in enumerate(order)}
    eos = np.asarray(sorted(eos_ids), np.int64)
    table = np.full((len(order), vocab), -1, np.int32)
    for s, moves in transitions.items():
        if moves:
            tokens = np.fromiter(moves.keys(), np.int64, len(moves))
            nxt = np.fromiter((number[t] for t in moves.values()), np.int32, len(moves))
            keep = tokens < vocab
            table[number[s], tokens[keep]] = nxt[keep]
    final = np.array([index.is_final_state(s) for s in order])
    table[:, eos] = -1
    others = (table >= 0).any(axis=1)
    ends = final | ~others
    table[np.ix_(ends, eos)] = np.flatnonzero(ends)[:, None]
    return table, ends & ~others


class GrammarCompiler:
    """Compiles grammars for one tokenizer and model vocabulary, with an LRU cache by (kind,
    text) of at most cache_bytes of tables (the newest always kept).  Thread-safe: the server
    compiles on its tokenize pool, never on the engine thread."""

    def __init__(self, tokenizer, eos_ids, vocab: int, max_states: int, cache_bytes: int = 2**30):
        self.tokenizer, self.vocab, self.max_states = tokenizer, vocab, max_states
        self.eos_ids = tuple(sorted(eos_ids))
        self.cache_bytes = cache_bytes
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._vocabulary = None

    def _outlines_vocabulary(self):
        from outlines_core import Vocabulary

        with self._lock:
            if self._vocabulary is None:
                words: dict[bytes, list[int]] = {}
                for i, b in self.tokenizer.token_bytes().items():
                    if b and i < self.vocab and i not in self.eos_ids:
                        words.setdefault(b, []).append(i)
                self._vocabulary = Vocabulary(self.eos_ids[0], words)
            return self._vocabulary

    def compile(self, kind: str, text: str) -> Grammar:
        """The grammar of (kind, text), from the cache or compiled now; GrammarError if it is
        invalid or needs more than max_states states."""
        from outlines_core import Index

        if not isinstance(text, str):
            raise GrammarError(f"a {kind} grammar must be a string, got {type(text).__name__}")
        if self.tokenizer is None or not self.eos_ids:
            raise GrammarError("structured output needs an engine with a tokenizer and an EOS token")
        key = (kind, text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        regex = grammar_regex(kind, text)
        try:
            index = Index(regex, self._outlines_vocabulary())
        except ValueError as e:
            raise GrammarError(f"cannot compile the {kind.replace('_', ' ')}: {e}") from None
        transitions = index.get_transitions()
        states = len(set(transitions) | {t for moves in transitions.values() for t in moves.values()})
        if states > self.max_states:
            raise GrammarError(f"the {kind.replace('_', ' ')} needs {states} DFA states; this engine holds at most "
                               f"{self.max_states} (EngineConfig.grammar_states)")
        grammar = Grammar(kind, text, *export_table(index, self.vocab, self.eos_ids))
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > 1 and sum(g.table.nbytes for g in self._cache.values()) > self.cache_bytes:
                self._cache.popitem(last=False)
        return grammar
