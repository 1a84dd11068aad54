"""From sampled tokens to `RequestOutput`s: per-sequence incremental text, finish rules (stop
tokens, stop strings, max_tokens, max_model_len) and the output objects.

Host work per token is linear in the new text: each sequence's `IncrementalDetokenizer` decodes a
small window, and stop strings are searched only in the text that could hold a new match (the new
text plus the longest stop string's length minus one before it).

State per sequence lives here, keyed by the sequence's request id: created by its first token,
dropped when its prompt's finished output is built (`make_output`) or when it is aborted
(`free`). `check_integrity` tells leaks.

The text follows vLLM's (vllm/v1/engine/detokenizer.py, `BaseIncrementalDetokenizer.update`, and
`check_stop_strings`), per request (`SamplingParams`):

- `skip_special_tokens` / `spaces_between_special_tokens` go to the sequence's detokenizer
  (inputs/detokenizer.py says what the second one does for a fast tokenizer).
- A sequence that ends on an EOS token (not ignored) or one of `stop_token_ids` leaves that token's
  text out, even when special tokens are kept; with `include_stop_str_in_output` its text is in (an
  EOS is then seen only with `skip_special_tokens=False`: skipped, a special token has no text).
  vLLM's `update(new_token_ids, stop_terminated)` decodes all but the last token in that case.
- A stop string cuts the text right before it, or with `include_stop_str_in_output` right after it.
  The earliest match wins (vLLM takes the first of `stop` that matches; they differ only when two
  match in one step).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from forkpoint.engine.request import Request
from forkpoint.inputs.detokenizer import REPLACEMENT, IncrementalDetokenizer
from forkpoint.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

# stop strings longer than this in all are held back whole by a delta output, not checked exactly (`stop_prefix_len`)
EXACT_STOP_CHARS = 2048


@dataclass
class _SequenceText:
    owner: Request  # a reused request id starts over
    detokenizer: IncrementalDetokenizer
    searched: int = 0  # text[:searched] holds no stop string (nor the start of one that is complete)
    stop_at: int | None = None  # the text is cut here: where a stop string starts (or ends, when it is kept)
    max_stop_len: int = 0
    stops: list[str] = field(default_factory=list)
    held_out: int = 0  # trailing output tokens not in the text: 1 once a stop token ended the sequence
    sent_tokens: int = 0  # delta reports (`make_delta_output`): output tokens reported so far
    sent_chars: int = 0  # and characters of the text reported so far
    sent_all: bool = False  # the sequence has finished and its delta outputs have sent its whole text


class OutputProcessor:
    """tokenizer: decodes the outputs (as each request's params say); eos_token_ids: ids that end a
    sequence unless ``ignore_eos``; max_model_len: prompt plus output never exceeds it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Collection[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._texts: dict[str, _SequenceText] = {}

    def __len__(self) -> int:
        return len(self._texts)

    def append_token(self, request: Request, token_id: int, logprobs: dict[int, Logprob] | None,
                     now: float) -> str | None:
        """Record a sampled token on `request`; returns the finish reason ("stop", "length") or None.
        The caller finishes the request when a reason comes back."""
        request.output_token_ids.append(token_id)
        if request.processors is not None:
            request.processors.accept(token_id)  # advance the grammar (runner/logits_processors.py)
        params = request.params
        if params.logprobs is not None:
            request.output_logprobs.append(logprobs)
        if request.first_token_time is None:
            request.first_token_time = now
        if len(request.output_token_ids) < params.min_tokens:  # vLLM: no stop id or string counts before it
            return "length" if request.num_tokens >= self.max_model_len else None
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            if not params.include_stop_str_in_output:
                self._state(request, hold_out_last=True)
            elif params.stop:
                self._stop_string_found(request)  # vLLM: the kept token's text may hold a stop string
            return "stop"
        if params.stop and self._stop_string_found(request):
            return "stop"
        if params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def ends_by_length(self, request: Request, num_new: int) -> bool:
        """Whether `request` certainly ends ("length") once `num_new` more tokens are appended,
        whatever they are (the rules of `append_token`)."""
        num_output = len(request.output_token_ids) + num_new
        if request.num_tokens + num_new >= self.max_model_len:
            return True
        max_tokens = request.params.max_tokens
        return num_output >= request.params.min_tokens and max_tokens is not None and num_output >= max_tokens

    def make_output(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    checkpoint_positions: Sequence[int], sequences: Sequence[Request]) -> RequestOutput:
        """The cumulative output of one prompt's sequences (prompt logprobs from the first sequence,
        which scores the prompt for all); once all have finished, their text state is dropped (this
        is their last output)."""
        finished = all(s.is_finished for s in sequences)
        completions = [CompletionOutput(
            index=sequence.index,
            text=self._text(sequence),
            token_ids=list(sequence.output_token_ids),
            finish_reason=sequence.finish_reason,
            logprobs=list(sequence.output_logprobs) if sequence.params.logprobs is not None else None,
        ) for sequence in sequences]
        if finished:
            for sequence in sequences:
                self._texts.pop(sequence.request_id, None)
        return _request_output(request_id, prompt, prompt_token_ids, checkpoint_positions, sequences, completions,
                               finished)

    def make_delta_output(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                          checkpoint_positions: Sequence[int], sequences: Sequence[Request]) -> RequestOutput:
        """The output of one prompt's sequences, not all finished, that is new since its previous delta
        output (vLLM's `RequestOutputKind.DELTA`): each completion's token ids and logprobs since then, and
        the text since then up to where it may still change: an unfinished sequence holds back a trailing
        incomplete character and a tail that may start a stop string (`stop_prefix_len`; nothing with
        `include_stop_str_in_output`), which later outputs send or the stop cuts. A finished sibling sends
        the rest of its final text once. The concatenated texts are always a prefix of `make_output`'s
        text, which the prompt's last, finished output carries whole. Work per call is in proportion to
        what is new, not to the output so far."""
        if all(s.is_finished for s in sequences):
            raise ValueError("make_delta_output is for prompts still running: the finished output is make_output's")
        return _request_output(request_id, prompt, prompt_token_ids, checkpoint_positions, sequences,
                               [self._delta(sequence) for sequence in sequences], finished=False)

    def _delta(self, sequence: Request) -> CompletionOutput:
        logprobs = [] if sequence.params.logprobs is not None else None
        if not sequence.output_token_ids:
            return CompletionOutput(sequence.index, "", [], sequence.finish_reason, logprobs)
        state = self._state(sequence)
        if sequence.is_finished:  # the rest of the final text, once
            new_text = "" if state.sent_all else self._text(sequence)[state.sent_chars:]
            state.sent_all = True
        else:  # the text past what was sent, and before it as far back as a stop string may have started
            back = min(state.sent_chars, max(state.max_stop_len - 1, 0))
            text = state.detokenizer.tail(state.sent_chars - back)
            end = len(text)
            while end > back and text[end - 1] == REPLACEMENT:
                end -= 1
            if state.stops and not sequence.params.include_stop_str_in_output:
                end -= stop_prefix_len(text[max(0, end - state.max_stop_len + 1):end], state.stops)
            new_text = text[back:end] if end > back else ""
        state.sent_chars += len(new_text)
        start, state.sent_tokens = state.sent_tokens, len(sequence.output_token_ids)
        if logprobs is not None:
            logprobs = sequence.output_logprobs[start:]
        return CompletionOutput(sequence.index, new_text, sequence.output_token_ids[start:], sequence.finish_reason,
                                logprobs)

    def free(self, request_id: str) -> None:
        """Drop the text state of an aborted sequence (unknown ids are ignored)."""
        self._texts.pop(request_id, None)

    def check_integrity(self, live_ids: set[str]) -> None:
        """Text state is held only for live sequences; raises AssertionError."""
        leaked = set(self._texts) - live_ids
        if leaked:
            raise AssertionError(f"output text kept for sequences that have ended: {sorted(leaked)[:5]}")

    # ---------------------------------------------------------------------------------------------

    def _state(self, request: Request, *, hold_out_last: bool = False) -> _SequenceText:
        """The sequence's text state, caught up with its output tokens (all but the last from the
        call with `hold_out_last` on: the stop token that ended the sequence)."""
        state = self._texts.get(request.request_id)
        if state is None or state.owner is not request:
            params = request.params
            stops = list(params.stop)
            detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                                 spaces_between_special_tokens=params.spaces_between_special_tokens)
            state = _SequenceText(request, detokenizer, stops=stops, max_stop_len=max(map(len, stops), default=0))
            self._texts[request.request_id] = state
        if hold_out_last:
            state.held_out = 1
        seen, end = state.detokenizer.num_tokens, len(request.output_token_ids) - state.held_out
        if seen < end:
            state.detokenizer.add(request.output_token_ids[seen:end])
        return state

    def _stop_string_found(self, request: Request) -> bool:
        state = self._state(request)
        start = max(0, state.searched - state.max_stop_len + 1)
        window = state.detokenizer.tail(start)  # text[start:]: a match ending in the new text starts here
        hits = [(index, stop) for index, stop in ((window.find(stop), stop) for stop in state.stops) if index >= 0]
        state.searched = start + len(window)
        if not hits:
            return False
        index, stop = min(hits, key=lambda hit: hit[0])
        index += start
        state.stop_at = index + len(stop) if request.params.include_stop_str_in_output else index
        return True

    def _text(self, sequence: Request) -> str:
        if not sequence.output_token_ids:
            return ""
        state = self._state(sequence)
        if state.stop_at is not None:
            return state.detokenizer.final_text[: state.stop_at]
        return state.detokenizer.final_text if sequence.is_finished else state.detokenizer.text


def _request_output(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    checkpoint_positions: Sequence[int], sequences: Sequence[Request],
                    completions: list[CompletionOutput], finished: bool) -> RequestOutput:
    first = sequences[0]
    prompt_logprobs = None
    if first.params.prompt_logprobs is not None:  # the first sequence scores the prompt for all
        entries = first.prompt_logprobs
        prompt_logprobs = [None] + [entries.get(t) for t in range(1, len(prompt_token_ids))]
    return RequestOutput(
        prompt_logprobs=prompt_logprobs,
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,  # the prompt's one list: not copied per step (256 streams of
        # 3,700-token prompts copied ~1M ids a step: 0.8 s of a 30-s GIL profile of the 256-session run)
        outputs=completions,
        num_cached_tokens=max(s.num_cached_tokens for s in sequences),
        cache_miss_reason=first.cache_miss_reason.value if first.cache_miss_reason is not None else None,
        metrics=request_metrics(sequences),
        checkpoint_positions=list(checkpoint_positions),
        finished=finished,
    )


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the tail of `text` held back because a stop string may begin there. Stop strings of at
    most EXACT_STOP_CHARS characters in all: exactly the longest tail that is a proper prefix of one (a
    Python step per candidate length and string). Longer ones: the longest stop string's length - 1
    (vLLM's rule: O(1), the text comes that much later), since the exact check grows as their number
    times their length squared (128 strings of 1,024 characters: ~61 ms per chunk, issue 27). Only the
    last (longest stop - 1) characters of `text` matter."""
    if sum(map(len, stops)) > EXACT_STOP_CHARS:
        return min(len(text), max(map(len, stops)) - 1)
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def request_metrics(sequences: Sequence[Request]) -> RequestMetrics:
    """When one prompt's sequences (which arrive together) were first scheduled and first sampled:
    the earliest of them (the steps to a first token: those of the sequence first scheduled)."""
    scheduled = [s for s in sequences if s.first_scheduled_time is not None]
    sampled = [s.first_token_time for s in sequences if s.first_token_time is not None]
    first = min(scheduled, key=lambda s: s.first_scheduled_time, default=None)
    prefill_steps = (None if first is None or first.first_token_step is None
                     else first.first_token_step - first.first_scheduled_step + 1)
    return RequestMetrics(arrival_time=sequences[0].arrival_time,
                          first_scheduled_time=first.first_scheduled_time if first is not None else None,
                          first_token_time=min(sampled, default=None),
                          queued_steps=first.first_scheduled_step - first.arrival_step if first is not None else 0,
                          prefill_steps=prefill_steps)
