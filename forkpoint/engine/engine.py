"""The step loop: admit requests, schedule, have the runner execute the plan (forward, sampling,
prompt scores: one `StepResult`), commit, finish, report. The parts come from engine/builder.py;
the engine touches no tensor.

`LLMEngine` is single-threaded: one caller (the offline `LLM`, or the server's engine thread)
drives `add_request` / `step` / `abort_request`.

Asynchronous scheduling (`async_scheduling`, vLLM's `--async-scheduling`): in steady decoding the
host plans and enqueues step t+1 while the device still runs step t, then waits for step t's
tokens and does its output work (commit, stop rules, outputs) while step t+1 runs::

    step() call k:   [schedule t+1 ahead | enqueue t+1, fed t's ids on the device] [wait t | outputs of t]
    device:          ...... step t ............................|....... step t+1 ...............

so each `step()` returns the outputs of the step before the one it leaves running. A step runs ahead
only after a pure decode step whose sequences all sample without their output tokens on the host
(no grammar, no bad words); anything else (a prefill, a checkpoint, a waiting request while fewer
than max_num_seqs run, a sequence needing a KV block that is not free) first completes the step in flight and
schedules normally. A sequence that ends with step t (stop token or string, abort) has its token of
step t+1 dropped; its slot and blocks are freed when step t+1 completes. Outputs are the same as
without: each token is sampled from the same logits with the same generator, penalty counts and
masks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forkpoint.cache.checkpoint_types import CacheMissReason
from forkpoint.config import SCAN_CHUNK_TOKENS, EngineConfig
from forkpoint.engine.builder import EngineBuilder, EngineParts
from forkpoint.engine.holdings import check_holdings
from forkpoint.engine.memory_retry import MemoryBackoff, is_out_of_memory
from forkpoint.engine.metrics import checkpoint_metrics, pool_metrics
from forkpoint.engine.request import Request
from forkpoint.engine.scheduler import SchedulingFailed
from forkpoint.engine.step_io import plan_with_sampling, record_prompt_scores
from forkpoint.engine.step_planning import ScheduledStep
from forkpoint.inputs.processor import ProcessedPrompt
from forkpoint.outputs import RequestOutput
from forkpoint.runner.host_copies import ArenaHostCopies
from forkpoint.runner.logits_processors import build_request_processors
from forkpoint.sampling_params import SamplingParams
from forkpoint.step.plan import SegmentKind
from forkpoint.step.result import StepResult

if TYPE_CHECKING:
    from forkpoint.runner.step_sampler import PendingStep

logger = logging.getLogger("forkpoint")


class StepFailed(RuntimeError):
    """A step's forward or sampling raised. `cause` is the exception; `request_ids` the prompts that
    ended because they were in the step; `outputs` those of other prompts that finished in it.
    Everything the step took has been released."""

    def __init__(self, cause: Exception, request_ids: list[str], outputs: list[RequestOutput]) -> None:
        super().__init__(f"step failed ({type(cause).__name__}: {cause}); ended {len(request_ids)} request(s)")
        self.cause = cause
        self.request_ids = request_ids
        self.outputs = outputs


@dataclass
class _Launched:
    """A step whose forward and sampling are enqueued: `pending.feed` holds its sampled ids on the
    device, `pending.result()` waits for its `StepResult`."""

    step: ScheduledStep
    pending: PendingStep


@dataclass
class _PromptGroup:
    """The n sequences of one prompt, reported as one RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    checkpoint_positions: list[int]
    sequences: list[Request]
    stream: bool = True  # report every step's progress, not only the finished output
    # without stream: also report the step that samples the first token (once), then only the finished output
    report_first_token: bool = False
    # with stream: each report before the finished one carries only what is new (make_delta_output)
    deltas: bool = False

    def reports(self) -> bool:
        """Whether the step that just progressed this prompt reports it (the engine calls this once per
        step that touched it; a first-token report is made once)."""
        if self.stream or all(s.is_finished for s in self.sequences):
            return True
        if self.report_first_token and any(s.output_token_ids for s in self.sequences):
            self.report_first_token = False
            return True
        return False


class LLMEngine:
    """The step loop over parts built from `config` (engine/builder.py), or over `parts` given (built
    from the same config)."""

    def __init__(self, config: EngineConfig, parts: EngineParts | None = None) -> None:
        parts = parts or EngineBuilder(config).build()
        self.parts = parts
        self.config, self.device, self.dtype = parts.config, parts.device, parts.dtype
        self.model_path, self.model_config = parts.model_path, parts.model_config
        self.generation_defaults, self.max_model_len = parts.generation_defaults, parts.max_model_len
        self.tokenizer, self.checkpoint_token_id = parts.tokenizer, parts.checkpoint_token_id
        self.eos_token_ids, self.grammars, self.images = parts.eos_token_ids, parts.grammars, parts.images
        self.inputs, self.output_processor = parts.inputs, parts.output_processor
        self.block_pool, self.state_pool, self.registry = parts.block_pool, parts.state_pool, parts.registry
        self.scheduler, self.runner = parts.scheduler, parts.runner
        self.graphs_off_reason = parts.graphs_off_reason
        self.startup, self.memory = parts.startup, parts.memory
        # a plain attribute: benchmarks may switch it between steps (EngineConfig rejects it under TP)
        self.async_scheduling = self.config.async_scheduling
        self._launched: list[_Launched] = []  # enqueued steps whose tokens are not processed; oldest first
        # caps on step size after a step ran out of memory (engine/memory_retry.py)
        self._backoff = MemoryBackoff(SCAN_CHUNK_TOKENS if self.config.checkpoint_exact else 1,
                                      self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._groups: dict[str, _PromptGroup] = {}
        self._seed_counter = self.config.seed
        self._counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_finished": 0,
                          "requests_aborted": 0, "requests_failed": 0, "steps": 0,
                          "steps_retried_for_memory": 0, "requests_failed_for_memory": 0}
        logger.info("%s", self.startup.summary())

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None, *,
                    stream: bool = True, deltas: bool = False, report_first_token: bool = False,
                    tenant: str = "") -> None:
        """Validate and queue one prompt. Raises ValueError naming the problem; nothing is left behind.

        With `stream=False`, `step()` reports this prompt only once it has finished (no per-step
        detokenisation: the offline API's mode); with `report_first_token` as well, also once in the step
        that samples its first token (the server's requests that do not stream: its admission and
        time-to-first-token metrics read that output). A cumulative `RequestOutput` copies every token id
        so far, so a prompt reported every step costs host time in proportion to its output so far
        (bench/output_path_cost.py); with `stream` and `deltas`, each report before the finished one
        carries only what is new since the previous one (vLLM's `RequestOutputKind.DELTA`; its text held
        back where it may still change, `OutputProcessor.make_delta_output`), and the finished one is
        cumulative, as always (the server's streamed responses). `tenant`: the client it comes from
        (the server's `user`); the checkpoints it registers count against that client's fair share of
        the pool."""
        params = sampling_params or self.default_sampling_params()
        if params.max_tokens is None and self.generation_defaults.max_new_tokens is not None:
            params = dataclasses.replace(params, max_tokens=self.generation_defaults.max_new_tokens)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = prompt if isinstance(prompt, ProcessedPrompt) else self.inputs.process(prompt)
        token_ids = processed.token_ids
        positions = list(processed.checkpoint_positions) if self.registry is not None else []
        seq_positions = list(positions)
        if params.n > 1 and self.registry is not None and len(token_ids) > 1 and (len(token_ids) - 1) not in positions:
            seq_positions.append(len(token_ids) - 1)  # siblings share the prompt through one checkpoint
        processors = [build_request_processors(params, tokenizer=self.tokenizer,
                                               vocab_size=self.model_config.vocab_size,
                                               eos_token_ids=self.eos_token_ids, grammars=self.grammars)
                      for _ in range(params.n)]
        now = time.monotonic()
        sequences = []
        for index in range(params.n):
            sequences.append(Request(
                request_id=f"{request_id}#{index}" if params.n > 1 else request_id,
                parent_id=request_id,
                index=index,
                prompt_token_ids=token_ids,
                checkpoint_positions=tuple(sorted(seq_positions)),
                params=params,
                arrival_time=now,
                hasher=processed.hasher,
                seed=self._seed(params, index),
                multimodal=processed.multimodal,
                processors=processors[index],
                turn_positions=processed.turn_positions if self.registry is not None else (),
                turn_end_reusable=processed.turn_end_reusable,
                tenant=tenant,
            ))
        self._groups[request_id] = _PromptGroup(request_id, processed.text, token_ids, positions, sequences, stream,
                                                report_first_token and not stream, deltas and stream)
        for sequence in sequences:
            self.scheduler.add(sequence, now)
            self._counters["prompt_tokens_total"] += len(token_ids)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json max_new_tokens as max_tokens."""
        max_new = self.generation_defaults.max_new_tokens
        return SamplingParams() if max_new is None else SamplingParams(max_tokens=max_new)

    def _seed(self, params: SamplingParams, index: int) -> int | None:
        """The seed of sequence `index`'s sampling generator (None: greedy, none needed)."""
        if params.greedy:
            return None
        if params.seed is not None:
            return params.seed + index
        self._seed_counter += 1
        return self._seed_counter * 1_000_003 + index

    def abort_request(self, request_id: str) -> None:
        """Abort a prompt (all its sequences); unknown or finished ids are ignored."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for sequence in group.sequences:
            if not sequence.is_finished:
                self.scheduler.finish(sequence, "abort")
        self._release(group)
        self._counters["requests_aborted"] += 1
        self._complete_idle_steps()

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def sequences(self, request_id: str) -> list[Request]:
        """The sequences of an unfinished prompt ([] once it has finished or for an unknown id), for
        progress reports (benchmarks, tests); callers read them, never write them."""
        group = self._groups.get(request_id)
        return list(group.sequences) if group is not None else []

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """One scheduling step and forward. Returns outputs of prompts that progressed (with
        asynchronous scheduling, those of the step completed in this call; see the module doc).

        If the forward or sampling raises, every prompt with a sequence in the step ends (its other
        sequences are aborted), everything the step took is released, and `StepFailed` is raised with
        the cause and the outputs of the other prompts that finished in the step; the engine stays
        usable for the requests that were not in the step. A raise for lack of memory is retried in
        smaller steps instead, and fails only a prompt that runs out of memory alone
        (engine/memory_retry.py)."""
        if self._launched:
            return self._advance()
        try:
            step = self.scheduler.schedule(limits=self._backoff.limits())
        except SchedulingFailed as failure:  # the scheduler released the half-planned step
            raise self._scheduling_failed(failure) from failure.cause
        if step.empty:
            if step.finished:
                return self._collect({r.parent_id: self._groups[r.parent_id] for r in step.finished})
            if self.scheduler.has_unfinished():
                time.sleep(0.001)  # everything is deferred or waiting for memory
            return []
        self._counters["steps"] += 1
        if self.async_scheduling and self._steady_decode(step):
            try:
                self._launched.append(self._launch(step))
            except Exception as error:
                return self._step_raised([step], error)
            return self._advance()
        try:
            launched = time.perf_counter()
            result = self.runner.execute(plan_with_sampling(step)).result()
            self._observe(step, time.perf_counter() - launched)
            record_prompt_scores(step, result, self.registry)
        except Exception as error:
            return self._step_raised([step], error)
        try:
            self.scheduler.commit(step)
            outputs = self._record(step, result)
        except Exception as error:  # commit or output work raised: the step's prompts end, the engine serves on
            raise self._fail_steps([step], error) from error
        self._persist_when_idle()
        return outputs

    def _observe(self, step: ScheduledStep, seconds: float) -> None:
        """A step ran from its launch to its result in `seconds`: the rates the restore-or-recompute rule
        weighs learn from it (cache/reuse_rates.py)."""
        if self.registry is None:
            return
        host = self.registry.host
        slot_bytes, block_bytes = (host.slot_bytes, host.block_bytes) if host is not None else (0, 0)
        self.registry.rates.observe_plan(step.plan, seconds, slot_bytes, block_bytes)

    def _record(self, step: ScheduledStep, result: StepResult) -> list[RequestOutput]:
        """A committed step's sampled tokens onto its sequences (a sequence that has ended since it
        was scheduled drops its token); the outputs of the prompts it touched."""
        by_id = {request.request_id: request for request in step.requests}
        requests = [by_id[request_id] for request_id in result.request_ids]
        tokens = result.tokens
        touched: dict[str, _PromptGroup] = {}
        for request in step.requests + step.finished:
            group = self._groups.get(request.parent_id)
            if group is not None:
                touched[request.parent_id] = group
        now = time.monotonic()
        for request, token in zip(requests, tokens):
            if not request.is_finished:
                self._append_token(request, token.token_id, token.logprobs, now)
        speculation = self.scheduler.speculation
        if speculation is not None:
            for verified in result.verified:
                request = by_id[verified.request_id]
                speculation.record(verified)
                for kept, token in enumerate(verified.tokens, start=1):
                    if request.is_finished:
                        break
                    speculation.settle(request, kept)  # state and count just before this token
                    self._append_token(request, token.token_id, token.logprobs, now)
                speculation.finalize(request)
            for request in dict.fromkeys(step.requests):
                request.draft_token_ids = speculation.drafts_for(
                    request, result.drafts.get(request.request_id, ()), self.max_model_len)
        return self._collect(touched)

    # ------------------------------------------------------------------ asynchronous scheduling
    def _steady_decode(self, step: ScheduledStep) -> bool:
        """A step after which one may run ahead: single-token decodes that all sample, no prompt
        scores, no copy-on-write, sequences that sample without their tokens on the host; never with
        speculative decoding (its steps read their drafts on the host)."""
        return (self.scheduler.speculation is None and not step.plan.kv_copies
                and self._decodes_on_device(step.requests) and all(
                    s.kind is SegmentKind.DECODE and s.samples and not s.prompt_logit_rows for s in step.plan.segments))

    def _decodes_on_device(self, requests: list[Request]) -> bool:
        """Whether these sequences can be sampled while their last token is still on the device."""
        return not any(r.processors is not None and r.processors.needs_output_tokens for r in requests)

    def _launch(self, step: ScheduledStep, ahead_of: _Launched | None = None) -> _Launched:
        """Enqueue a decode step's forward and sampling; `ahead_of`: the step in flight whose sampled
        ids (on the device) are this step's inputs."""
        if ahead_of is None:
            return _Launched(step, self.runner.execute(plan_with_sampling(step)))
        return _Launched(step, self.runner.execute(plan_with_sampling(step, num_unseen=1),
                                                   feed=ahead_of.pending.feed))

    def _advance(self) -> list[RequestOutput]:
        """Schedule and enqueue the next decode step ahead if steady decoding allows, then complete
        the oldest enqueued step (wait for its tokens, commit, outputs)."""
        current = self._launched[0]
        ahead = None
        if (self.async_scheduling and self._backoff.limits() is None
                and self._decodes_on_device(self.scheduler.running)):  # running ahead would bypass the caps
            ahead = self.scheduler.schedule_ahead(lambda r: self.output_processor.ends_by_length(r, 1))
        launch_error = None
        if ahead is not None:
            self._counters["steps"] += 1
            try:
                self._launched.append(self._launch(ahead, current))
            except Exception as error:
                launch_error = error
        try:
            result = current.pending.result()
        except Exception as error:
            failed = [launched.step for launched in self._launched]
            self._launched.clear()
            return self._step_raised(failed + ([ahead] if launch_error is not None else []), error)
        self._launched.pop(0)
        try:
            self.scheduler.commit(current.step)
            outputs = self._record(current.step, result)
        except Exception as error:
            failed = [current.step] + [launched.step for launched in self._launched]
            self._launched.clear()
            raise self._fail_steps(failed + ([ahead] if launch_error is not None else []), error) from error
        if launch_error is not None:
            return self._step_raised([ahead], launch_error, outputs)
        self._complete_idle_steps()
        self._persist_when_idle()
        return outputs

    def _persist_when_idle(self) -> None:
        """With the disk tier, an engine that goes idle applies the device writes its last commits
        recorded (the last checkpoints' `DiskSave`s): no plan would carry them before the next request,
        and a process stopped meanwhile would lose them. A failure is logged and the writes go to the
        next plan (a storage applies each once)."""
        registry = self.registry
        if (registry is None or registry.disk is None or self._launched or self.scheduler.in_flight
                or self.scheduler.has_unfinished()):
            return
        first, writes = registry.take_writes()
        if not writes:
            return
        try:
            self.runner.apply_writes(writes, first)
        except Exception:
            logger.exception("applying the idle engine's device writes failed; the next step applies them")
            registry.give_back_writes(first, writes)

    def _complete_idle_steps(self) -> None:
        """Complete (wait for, commit) the enqueued steps once every sequence in them has ended:
        nothing would call `step()` for them, and their slots and blocks must come back. A failure
        here ends no live request: it is logged, and the steps are released."""
        while self._launched and all(r.is_finished for launched in self._launched for r in launched.step.requests):
            launched = self._launched[0]
            try:
                launched.pending.result()
                self._launched.pop(0)
                self.scheduler.commit(launched.step)
            except Exception as error:
                failed = ([] if self._launched and self._launched[0] is launched else [launched.step])
                failed += [item.step for item in self._launched]
                self._launched.clear()
                self._fail_steps(failed, error)
                return

    def _step_raised(self, steps: list[ScheduledStep], error: Exception,
                     outputs: list[RequestOutput] | None = None) -> list[RequestOutput]:
        """The forward or sampling of `steps` (every step in flight, oldest first, none committed)
        raised. For lack of memory: requeue their sequences under smaller caps and return `outputs`
        with those of prompts that ended while scheduling them, or, when one sequence ran out of
        memory alone in the smallest step, fail its prompt. Anything else fails the steps. Raises
        `StepFailed` for a failure."""
        if not is_out_of_memory(error):
            raise self._fail_steps(steps, error, outputs) from error
        culprit = self._backoff.culprit(steps)
        if culprit is not None:
            self._counters["requests_failed_for_memory"] += 1
            raise self._fail_steps(steps, self._backoff.describe(culprit, error), outputs) from error
        limits = self._backoff.shrink(steps)
        requeued = self.scheduler.requeue(steps)
        self._counters["steps_retried_for_memory"] += 1
        logger.warning("a step ran out of memory (%s: %s): %d sequence(s) requeued; steps now take at most %d "
                       "token(s) of one sequence, %d in all and %d sequence(s) until they leave", type(error).__name__,
                       error, len(requeued), limits.max_chunk, limits.max_tokens, limits.max_seqs)
        ended = {r.parent_id: self._groups[r.parent_id] for step in steps for r in step.finished
                 if r.parent_id in self._groups}
        return (outputs or []) + self._collect(ended)

    def _fail_steps(self, steps: list[ScheduledStep], error: Exception,
                    outputs: list[RequestOutput] | None = None) -> StepFailed:
        """Fail `steps` (the oldest in flight first): end every prompt with a sequence in them.
        `outputs`: those already collected in this call, reported with the failure."""
        failed_ids: list[str] = []
        finished: dict[str, _PromptGroup] = {}
        for step in steps:
            in_flight = any(step is s for s in self.scheduler.in_flight)
            ended = self.scheduler.fail(step) if in_flight else self._end_committed(step)
            if not in_flight:  # prompts of the step that left during the failed output work lost their output
                failed_ids += [i for i in dict.fromkeys(r.parent_id for r in step.requests) if i not in self._groups]
            for request_id in dict.fromkeys(r.parent_id for r in ended):
                group = self._groups.pop(request_id)
                for sequence in group.sequences:
                    if not sequence.is_finished:
                        self.scheduler.finish(sequence, "error")
                self._release(group)
                failed_ids.append(request_id)
            reported = step.finished if in_flight else step.requests + step.finished  # + those done before the raise
            finished.update({r.parent_id: self._groups[r.parent_id] for r in reported if r.parent_id in self._groups})
        self._counters["requests_failed"] += len(failed_ids)
        logger.error("step failed (%s: %s): ended %d request(s): %s", type(error).__name__, error,
                     len(failed_ids), ", ".join(failed_ids))
        return StepFailed(error, failed_ids, (outputs or []) + self._collect(finished))

    def _scheduling_failed(self, failure: SchedulingFailed) -> Exception:
        """Planning a step raised: end the prompts of the sequences it had taken (`StepFailed`, with the
        outputs of those that finished meanwhile), or, when it had taken none, the cause itself (the
        server's engine thread then ends every request in flight, the offline `LLM` its own)."""
        ended = list(dict.fromkeys(r.parent_id for r in failure.ended if r.parent_id in self._groups))
        finished = {r.parent_id: self._groups[r.parent_id] for r in failure.finished
                    if r.parent_id in self._groups and r.parent_id not in ended}
        if not ended and not finished:
            return failure.cause
        for request_id in ended:
            group = self._groups.pop(request_id)
            for sequence in group.sequences:
                if not sequence.is_finished:
                    self.scheduler.finish(sequence, "error")
            self._release(group)
        self._counters["requests_failed"] += len(ended)
        logger.error("scheduling failed (%s: %s): ended %d request(s): %s", type(failure.cause).__name__,
                     failure.cause, len(ended), ", ".join(ended))
        return StepFailed(failure.cause, ended, self._collect(finished))

    def _end_committed(self, step: ScheduledStep) -> list[Request]:
        """End, with reason "error", the sequences of a step that the scheduler has already committed
        (the output work after the commit raised); returns those it ended."""
        ended = [r for r in dict.fromkeys(step.requests) if not r.is_finished]
        for request in ended:
            self.scheduler.finish(request, "error")
        return ended

    def _collect(self, touched: dict[str, _PromptGroup]) -> list[RequestOutput]:
        """Outputs of the prompts that progressed; finished prompts leave the engine."""
        outputs = []
        for group in touched.values():
            finished = all(s.is_finished for s in group.sequences)
            if group.reports():
                outputs.append(self._make_output(group))
            if finished:
                del self._groups[group.request_id]
                self._release(group)
                self._counters["requests_finished"] += 1
        return outputs

    def _release(self, group: _PromptGroup) -> None:
        """Drop the per-sequence state of a prompt that has left the engine: penalty counts, text
        and grammar matchers (every path out: finished, aborted, failed)."""
        self.runner.release(s.request_id for s in group.sequences)
        for sequence in group.sequences:
            self.output_processor.free(sequence.request_id)
            sequence.processors = None

    def _append_token(self, request: Request, token_id: int, logprobs: dict[int, float] | None, now: float) -> None:
        self._counters["generation_tokens_total"] += 1
        reason = self.output_processor.append_token(request, token_id, logprobs, now)
        if reason is not None:
            self.scheduler.finish(request, reason, keep_turn_end=True, now=now)

    def _make_output(self, group: _PromptGroup) -> RequestOutput:
        make = self.output_processor.make_output
        if group.deltas and not all(s.is_finished for s in group.sequences):
            make = self.output_processor.make_delta_output
        return make(group.request_id, group.prompt, group.prompt_token_ids, group.checkpoint_positions,
                    group.sequences)

    # ------------------------------------------------------------------ introspection
    def metrics(self) -> dict[str, int | float]:
        """The engine's counters merged with those of the parts that own theirs."""
        values: dict[str, int | float] = dict(self._counters)
        values.update(checkpoint_metrics(self.registry))
        values.update(self.scheduler.metrics())
        values["prompt_tokens_cached"] = self._counters["prompt_tokens_total"] - values["prompt_tokens_computed"]
        values.update(pool_metrics(self.block_pool, self.state_pool))
        values.update(self.runner.metrics())
        if self.scheduler.speculation is not None:
            values.update(self.scheduler.speculation.metrics())
        misses = self.scheduler.auto.misses if self.scheduler.auto is not None else {}
        for reason in CacheMissReason:  # prompts whose reuse stopped short, by why (auto_checkpoints.py)
            values[f"cache_misses_{reason.value}"] = misses.get(reason, 0)
        return values

    def reset_prefix_cache(self) -> bool:
        """Forget every checkpoint (device, host and disk tier: its files are deleted) and every prompt
        the automatic checkpoints indexed, so the next prompts compute from scratch (vLLM's
        `reset_prefix_cache`: benchmarks, tests that compare two runs on one engine). False, and
        nothing changed, while requests are unfinished."""
        if self._groups or self._launched:
            return False
        if self.registry is None:
            return True
        if not self.registry.reset():
            return False
        if self.scheduler.auto is not None:
            self.scheduler.auto.forget()
        self._persist_when_idle()  # the disk tier's deletions
        return True

    def checkpoint_keys(self) -> frozenset[bytes]:
        """Keys (chained prefix hashes, cache/hashing.py) of the checkpoints this engine holds ready."""
        if self.registry is None:
            return frozenset()
        return frozenset(c.key for c in self.registry if c.ready)

    def wait_for_host_tier(self) -> None:
        """Return once the host tier's memory is allocated. A tier pinned ahead (runner/host_arena.py) is
        still being pinned on its background thread after start-up, and pinning beside the steps stalls
        them (issue 32); the server waits here before it serves."""
        host = self.runner.storage.host
        if isinstance(host, ArenaHostCopies):
            host.arena.settle()

    def check_integrity(self) -> None:
        """Cross-check pools, registry and requests; raises AssertionError on any inconsistency."""
        live = {s.request_id for group in self._groups.values() for s in group.sequences}
        self.runner.check_integrity(live)
        self.output_processor.check_integrity(live)
        self.state_pool.check_integrity()
        self.runner.storage.check_integrity()
        self.scheduler.check_integrity()
        check_holdings(self.scheduler)
        live = {r.parent_id for r in list(self.scheduler.waiting) + self.scheduler.running}
        if not live <= set(self._groups):
            raise AssertionError("a queued sequence belongs to no prompt")
        if not self._groups and self.registry is not None:
            # idle: nothing may hold a checkpoint, so every one must be evictable
            stuck = [c for c in self.registry if not c.ready or c.pins]
            if stuck:
                raise AssertionError(f"idle engine holds {len(stuck)} checkpoint(s) that can never be evicted")
