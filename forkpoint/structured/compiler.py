"""Compiling `StructuredOutputsParams` into llguidance grammars, cached, and making matchers.

One `GrammarCompiler` per engine. The llguidance tokenizer (a byte-level view of the HF
tokenizer; about 6 s and ~450 MB for the 248k-token Qwen3.5 vocabulary on 2 cores) is built by
`prepare()` (the server calls it at start-up, so no request stalls the engine thread on it), else on
the first constrained request. Each distinct constraint is compiled once (validated and
parsed into an initial `LLMatcher`) and kept in an LRU cache; each sequence gets a deep copy.

Two threads may use one compiler: the server compiles a request's constraint in a thread of its own
(`ensure_compiled`) before the engine thread's `matcher` only copies it from the cache. llguidance
releases the GIL while it compiles (a 4,096-string `choice` takes ~70 ms on 2 cores, a big JSON schema
can take seconds), so the other threads run meanwhile.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from forkpoint.sampling_params import StructuredOutputsParams
from forkpoint.structured.json_schema import forbid_additional_properties
from forkpoint.structured.matcher import GrammarMatcher
from forkpoint.structured_outputs_config import StructuredOutputsConfig

DEFAULT_CACHE_SIZE = 128


class GrammarCompiler:
    """tokenizer: the engine's HF tokenizer (fast); vocab_size: the model's logits width (ids
    past the tokenizer's vocabulary are never allowed); eos_token_ids: the ids that end a sequence
    (allowed once a grammar is complete); options: how JSON schemas read (`StructuredOutputsConfig`:
    by default no properties beyond those listed unless the schema allows them, compact JSON).

    Thread safety: `_lock` guards the cache, the in-flight compiles and the counters, and is never held
    while llguidance compiles; `_build_lock` guards the one-time build of the llguidance tokenizer.
    Invariants: a key is in `_compiling` only while one thread compiles it (removed when that ends,
    also on an error), so concurrent requests for one new constraint compile it once; `num_compiled`
    counts the compiles that succeeded."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Iterable[int], *,
                 options: StructuredOutputsConfig | None = None, cache_size: int = DEFAULT_CACHE_SIZE,
                 num_threads: int | None = None) -> None:
        self.options = options or StructuredOutputsConfig()
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._cache_size = cache_size
        self._num_threads = num_threads
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[tuple[str, str], Future[llguidance.LLMatcher]] = {}
        self._live: weakref.WeakSet[GrammarMatcher] = weakref.WeakSet()
        self.num_compiled = 0  # cache misses (compilations), for tests and metrics

    @property
    def num_live_matchers(self) -> int:
        """Matchers still referenced somewhere (0 once every constrained request has left)."""
        return len(self._live)

    @property
    def num_compiling(self) -> int:
        """Constraints some thread is compiling now (a compile that ended, failed or not, is not counted)."""
        with self._lock:
            return len(self._compiling)

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one sequence: a copy of the cached grammar, compiled here on a miss
        (waiting for it instead when another thread is compiling it). Raises ValueError naming the
        problem when the schema, regex, choice or grammar does not compile."""
        initial = self._initial(spec)
        matcher = GrammarMatcher(initial.deep_copy(), self._executor, self.eos_token_ids)
        with self._lock:
            self._live.add(matcher)
        return matcher

    def ensure_compiled(self, spec: StructuredOutputsParams) -> None:
        """Compile `spec` into the cache unless it is there, so that a later `matcher(spec)` only copies
        it (the server calls this off the engine thread). Raises the ValueError `matcher` would."""
        self._initial(spec)

    def _initial(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The cached initial matcher of `spec`: from the cache, from another thread's compile of the same
        constraint, or compiled here."""
        key = spec.cache_key()
        with self._lock:
            initial = self._compiled.get(key)
            if initial is not None:
                self._compiled.move_to_end(key)
                return initial
            pending = self._compiling.get(key)
            owner = pending is None
            if owner:
                pending = self._compiling[key] = Future()
        if not owner:
            return pending.result()  # the compiling thread's matcher, or its ValueError
        try:
            initial = self._compile(spec)
        except BaseException as exc:
            with self._lock:
                del self._compiling[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._compiling[key]
            self._compiled[key] = initial
            self.num_compiled += 1
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        pending.set_result(initial)
        return initial

    @property
    def prepared(self) -> bool:
        """Whether the llguidance tokenizer is built."""
        return self._lltokenizer is not None

    def prepare(self) -> None:
        """Build the llguidance tokenizer now (idempotent; the server calls it before serving, since the
        first compile would build it otherwise). Raises ValueError for a tokenizer that structured outputs
        cannot use."""
        self._llguidance_tokenizer()

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        tokenizer = self._llguidance_tokenizer()
        try:
            grammar = _grammar_text(spec, self.options)
        except RecursionError:  # the schema rewrite and the GBNF converter recurse per level, in Python
            raise ValueError(f"structured_outputs.{spec.kind} nests too deeply to convert (a few hundred levels "
                             "at most)") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs.{spec.kind} does not compile: "
                             f"{_without_backtrace(messages[0]) if messages else '?'}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            error = _without_backtrace(matcher.get_error())
            raise ValueError(f"structured_outputs.{spec.kind} does not compile: {error}")
        return matcher

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        with self._build_lock:  # two first compiles build it once
            if self._lltokenizer is None:
                if not isinstance(self._tokenizer, PreTrainedTokenizerFast):
                    raise ValueError("structured outputs need a fast (tokenizer.json) tokenizer; this model's "
                                     f"tokenizer is a {type(self._tokenizer).__name__}")
                self._executor = llguidance.LLExecutor(self._num_threads)
                self._lltokenizer = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size,
                                                                 eos_token=self.eos_token_ids)
            return self._lltokenizer


def _without_backtrace(message: str) -> str:
    """llguidance's error without the Rust backtrace it appends to a panic's message (its internals are
    nothing a client can act on)."""
    return message.split("\n<backtrace>", 1)[0].strip()


def _grammar_text(spec: StructuredOutputsParams, options: StructuredOutputsConfig) -> str:
    """The llguidance grammar (its JSON form) of a constraint."""
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        if options.disable_additional_properties:
            schema = forbid_additional_properties(schema)
        # compact JSON (disable_any_whitespace): a model that keeps choosing whitespace can never stall
        # a structure, and the output is still valid JSON
        defaults = {"whitespace_flexible": not options.disable_any_whitespace}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        except ValueError as err:
            raise ValueError(f"structured_outputs.json is not a usable JSON schema: {err}") from None
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # a Lark alternation of string literals; json.dumps quotes and escapes each as Lark expects
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:
        lark = any_to_lark(spec.grammar)  # Lark passes through; GBNF (llama.cpp, vLLM's examples) is converted
    except GbnfToLarkError as err:
        raise ValueError(f"structured_outputs.grammar is neither Lark nor GBNF: {err}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)
