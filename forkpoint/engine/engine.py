"""The step loop: admit requests, schedule, run the model, sample, finish, report.

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
from pathlib import Path

import torch

from forkpoint.cache.checkpoints import CheckpointKind, CheckpointRegistry
from forkpoint.cache.host_tier import HostTier
from forkpoint.cache.sizing import pools_of_sizes
from forkpoint.config import EngineConfig, ModelConfig, VisionConfig
from forkpoint.distributed.runner import TensorParallelRunner
from forkpoint.engine.output_processor import OutputProcessor
from forkpoint.engine.request import Request, RequestStatus
from forkpoint.engine.scheduler import ScheduledStep, Scheduler
from forkpoint.inputs.default_model import DEFAULT_MODEL_NOTICE, ensure_default_model
from forkpoint.inputs.generation_config import GenerationDefaults
from forkpoint.inputs.multimodal import image_prompt_processor
from forkpoint.inputs.processor import InputProcessor, PromptLimits
from forkpoint.inputs.tokenizer import load_tokenizer
from forkpoint.models.loader import build_model
from forkpoint.outputs import RequestOutput
from forkpoint.runner.logits_processors import build_request_processors
from forkpoint.runner.model_runner import ModelRunner
from forkpoint.runner.multimodal import MultimodalInputs
from forkpoint.runner.piecewise import PiecewiseForward, default_cuda_graph_sizes, graph_blocker
from forkpoint.runner.prompt_logprobs import PromptScores, score_tokens, truncate
from forkpoint.runner.sampler import PendingSample, Sampler, SamplingRow
from forkpoint.runner.storage import DeviceStorage, plan_storage
from forkpoint.sampling_params import SamplingParams
from forkpoint.step.plan import SegmentKind
from forkpoint.structured import GrammarCompiler

logger = logging.getLogger("forkpoint")


def _tokenizer_spells_images(tokenizer, vision: VisionConfig) -> bool:
    """Whether the tokenizer spells the image placeholder with the ids config.json gives the model."""
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    ids = tokenizer.encode(placeholder, add_special_tokens=False)
    return ids == [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]


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
    """A step whose forward and sampling are enqueued: `requests[i]` owns sampled row i."""

    step: ScheduledStep
    requests: list[Request]
    sampled: PendingSample


@dataclass
class _PromptGroup:
    """The n sequences of one prompt, reported as one RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    checkpoint_positions: list[int]
    sequences: list[Request]
    stream: bool = True  # report every step's progress, not only the finished output


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        model_path = Path(config.model) if config.model else None
        if model_path is None:
            model_path = ensure_default_model()
            logger.warning(DEFAULT_MODEL_NOTICE)
        self.model_path = model_path
        self.model_config = ModelConfig.from_hf_dir(model_path)
        self.generation_defaults = GenerationDefaults.from_model_dir(model_path)
        marker = config.checkpoint_token if config.enable_checkpoints else None
        loaded = load_tokenizer(Path(config.tokenizer) if config.tokenizer else model_path, checkpoint_token=marker)
        if loaded.base_vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"tokenizer has {loaded.base_vocab_size} tokens but the model's embedding only "
                f"{self.model_config.vocab_size}: tokenizer and model do not belong together"
            )
        self.tokenizer = loaded.tokenizer
        self.checkpoint_token_id = loaded.checkpoint_token_id
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)

        vision = self.model_config.vision
        max_images = config.max_images_per_prompt
        if vision is not None and max_images > 0 and not _tokenizer_spells_images(self.tokenizer, vision):
            logger.warning("the tokenizer does not encode <|vision_start|><|image_pad|><|vision_end|> as the ids in "
                           "config.json: serving this multimodal checkpoint text-only (images are rejected)")
            max_images = 0
        self.images = image_prompt_processor(vision, model_path, max_images=max_images,
                                             min_pixels=config.image_min_pixels, max_pixels=config.image_max_pixels)

        torch.manual_seed(config.seed)
        parallel = None  # ranks > 0 in worker processes (forkpoint/distributed/runner.py)
        self.graphs_off_reason: str | None = None  # why no CUDA graphs run, when none do
        if config.tensor_parallel_size > 1:
            self.graphs_off_reason = "tensor parallelism runs eagerly"
            parallel = TensorParallelRunner.start(config, self.model_config, model_path, self.device, self.dtype,
                                                  with_vision=self.images.processor is not None)
            model, piecewise = parallel.model, None
            self.block_pool, self.state_pool = parallel.make_pools(config, self.max_model_len)
        else:
            model = build_model(self.model_config, model_path, config.load_format, self.device, self.dtype,
                                config.seed, with_vision=self.images.processor is not None)
            # graphs before the pools: their pieces never touch the pools, and the pools' sizing then
            # sees the graphs' buffers and memory pool as used
            piecewise = self._capture_graphs(model)
            storage = self._make_storage(model)
        # bookkeeping only: the host tier's directory (its copies are the step plans' device writes)
        host = None
        if config.enable_checkpoints and config.checkpoint_host_bytes > 0:
            shapes = model.pool_shapes(self.dtype)
            host = HostTier(config.checkpoint_host_bytes, shapes.slot_bytes, shapes.block_bytes(config.block_size))
        self.registry = (CheckpointRegistry(self.state_pool.checkpoints, self.block_pool, host)
                         if config.enable_checkpoints else None)
        self.scheduler = Scheduler(config, self.block_pool, self.state_pool, self.registry)
        self.inputs = InputProcessor(self.tokenizer, self.checkpoint_token_id, self.images, PromptLimits(
            vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len, block_size=config.block_size,
            max_kv_blocks=self.block_pool.num_blocks, max_checkpoints=config.max_checkpoints_per_request))
        multimodal = None if model.visual is None else MultimodalInputs(
            model.visual, self.images.processor, config.image_embedding_cache_bytes, self.device)
        if parallel is not None:
            parallel.serve_images(multimodal)
        self.runner = parallel or ModelRunner(model, storage, self.device, multimodal, piecewise)
        self.sampler = Sampler(self.model_config.vocab_size, self.device)  # penalty counts across steps
        # a plain attribute: benchmarks may switch it between steps (EngineConfig rejects it under TP)
        self.async_scheduling = config.async_scheduling
        self._launched: list[_Launched] = []  # enqueued steps whose tokens are not processed; oldest first
        self._groups: dict[str, _PromptGroup] = {}
        self._seed_counter = config.seed
        self._counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_finished": 0,
                          "requests_aborted": 0, "requests_failed": 0, "steps": 0}

    # ------------------------------------------------------------------ set-up
    def _capture_graphs(self, model) -> PiecewiseForward | None:
        """CUDA graphs of the forward's token-wise pieces (CUDA only, unless `enforce_eager`)."""
        cfg = self.config
        if self.device.type != "cuda" or cfg.enforce_eager:
            self.graphs_off_reason = "enforce_eager" if cfg.enforce_eager else f"no CUDA device ({self.device})"
            return None
        reason = graph_blocker(self.model_config, self.dtype)
        if reason is not None:
            logger.warning("CUDA graphs off, every step runs eagerly: %s", reason)
            self.graphs_off_reason = reason
            return None
        sizes = cfg.cuda_graph_sizes or default_cuda_graph_sizes(cfg.max_num_batched_tokens)
        return PiecewiseForward(model, sizes, self.device, capture=True)

    def _make_storage(self, model) -> DeviceStorage:
        """The pools' bookkeeping (`block_pool`, `state_pool`) and the runner's storage, sized from the
        model's declarations (cache/sizing.py)."""
        # the image embedding cache fills later on this device (runner/multimodal.py): set it aside
        reserved = self.config.image_embedding_cache_bytes if self.images.processor is not None else 0
        shapes = model.pool_shapes(self.dtype)
        sizes = plan_storage(self.config, shapes, self.max_model_len, self.device, reserved)
        self.block_pool, self.state_pool = pools_of_sizes(sizes, self.config.block_size)
        return DeviceStorage(sizes, self.config.block_size, shapes, self.device)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None, *,
                    stream: bool = True) -> None:
        """Validate and queue one prompt. Raises ValueError naming the problem; nothing is left behind.

        With `stream=False`, `step()` reports this prompt only once it has finished (no per-step
        detokenisation: the offline API's mode)."""
        params = sampling_params or self.default_sampling_params()
        if params.max_tokens is None and self.generation_defaults.max_new_tokens is not None:
            params = dataclasses.replace(params, max_tokens=self.generation_defaults.max_new_tokens)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.inputs.process(prompt)
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
                generator=self._generator(params, index),
                multimodal=processed.multimodal,
                processors=processors[index],
            ))
        self._groups[request_id] = _PromptGroup(request_id, processed.text, token_ids, positions, sequences, stream)
        for sequence in sequences:
            self.scheduler.add(sequence, now)
            self._counters["prompt_tokens_total"] += len(token_ids)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json max_new_tokens as max_tokens."""
        max_new = self.generation_defaults.max_new_tokens
        return SamplingParams() if max_new is None else SamplingParams(max_tokens=max_new)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed + index)
        else:
            self._seed_counter += 1
            generator.manual_seed(self._seed_counter * 1_000_003 + index)
        return generator

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
        usable for the requests that were not in the step."""
        if self._launched:
            return self._advance()
        step = self.scheduler.schedule()
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
                raise self._fail_steps([step], error) from error
            return self._advance()
        try:
            logits, sampled = self.runner.execute(step.plan)
            by_id = {request.request_id: request for request in step.requests}
            requests = [by_id[segment.request_id] for segment in sampled]
            tokens = self.sampler.sample(logits[: len(sampled)], [
                SamplingRow(r.request_id, r.params, r.generator, r.prompt_token_ids, r.output_token_ids, r.processors)
                for r in requests])
            self._score_prompts(step, logits[len(sampled):], by_id)
        except Exception as error:
            raise self._fail_steps([step], error) from error
        self.scheduler.commit(step)
        return self._record(step, requests, tokens)

    def _record(self, step: ScheduledStep, requests: list[Request], tokens: list) -> list[RequestOutput]:
        """A committed step's sampled tokens onto its sequences (a sequence that has ended since it
        was scheduled drops its token); the outputs of the prompts it touched."""
        touched: dict[str, _PromptGroup] = {}
        for request in step.requests + step.finished:
            group = self._groups.get(request.parent_id)
            if group is not None:
                touched[request.parent_id] = group
        now = time.monotonic()
        for request, token in zip(requests, tokens):
            if not request.is_finished:
                self._append_token(request, token.token_id, token.logprobs, now)
        return self._collect(touched)

    # ------------------------------------------------------------------ asynchronous scheduling
    def _steady_decode(self, step: ScheduledStep) -> bool:
        """A step after which one may run ahead: single-token decodes that all sample, no prompt
        scores, no copy-on-write, sequences that sample without their tokens on the host."""
        return (not step.plan.kv_copies and self._decodes_on_device(step.requests) and all(
            s.kind is SegmentKind.DECODE and s.samples and not s.prompt_logit_rows for s in step.plan.segments))

    def _decodes_on_device(self, requests: list[Request]) -> bool:
        """Whether these sequences can be sampled while their last token is still on the device."""
        return not any(r.processors is not None and r.processors.needs_output_tokens for r in requests)

    def _launch(self, step: ScheduledStep, feed: torch.Tensor | None = None) -> _Launched:
        """Enqueue a decode step's forward and sampling; `feed`: the token ids the step before sampled
        (on the device), the inputs of a step scheduled ahead."""
        logits, sampled = (self.runner.execute(step.plan) if feed is None
                           else self.runner.execute(step.plan, feed=feed))
        by_id = {request.request_id: request for request in step.requests}
        requests = [by_id[segment.request_id] for segment in sampled]
        unseen = 0 if feed is None else 1
        pending = self.sampler.sample_async(logits[: len(sampled)], [
            SamplingRow(r.request_id, r.params, r.generator, r.prompt_token_ids, r.output_token_ids, r.processors,
                        unseen) for r in requests])
        return _Launched(step, requests, pending)

    def _advance(self) -> list[RequestOutput]:
        """Schedule and enqueue the next decode step ahead if steady decoding allows, then complete
        the oldest enqueued step (wait for its tokens, commit, outputs)."""
        current = self._launched[0]
        ahead = None
        if self.async_scheduling and self._decodes_on_device(self.scheduler.running):
            ahead = self.scheduler.schedule_ahead(lambda r: self.output_processor.ends_by_length(r, 1))
        launch_error = None
        if ahead is not None:
            self._counters["steps"] += 1
            try:
                self._launched.append(self._launch(ahead, current.sampled.token_ids))
            except Exception as error:
                launch_error = error
        try:
            tokens = current.sampled.result()
        except Exception as error:
            failed = [launched.step for launched in self._launched]
            self._launched.clear()
            raise self._fail_steps(failed + ([ahead] if launch_error is not None else []), error) from error
        self._launched.pop(0)
        self.scheduler.commit(current.step)
        outputs = self._record(current.step, current.requests, tokens)
        if launch_error is not None:
            raise self._fail_steps([ahead], launch_error, outputs) from launch_error
        self._complete_idle_steps()
        return outputs

    def _complete_idle_steps(self) -> None:
        """Complete (wait for, commit) the enqueued steps once every sequence in them has ended:
        nothing would call `step()` for them, and their slots and blocks must come back. A failure
        here ends no live request: it is logged, and the steps are released."""
        while self._launched and all(r.is_finished for launched in self._launched for r in launched.step.requests):
            launched = self._launched[0]
            try:
                launched.sampled.result()
            except Exception as error:
                failed = [item.step for item in self._launched]
                self._launched.clear()
                self._fail_steps(failed, error)
                return
            self._launched.pop(0)
            self.scheduler.commit(launched.step)

    def _score_prompts(self, step: ScheduledStep, rows: torch.Tensor, by_id: dict[str, Request]) -> None:
        """Prompt logprobs of the step's segments, in packed order: each scored segment's logits rows
        (after the sampled rows) score its tokens; a segment that starts at a checkpoint first takes
        the prefix's scores the checkpoint carries; a segment that ends where a checkpoint it writes
        keeps its state leaves the prefix's scores with that checkpoint."""
        writes = {(id(producer), c.state_tokens): c for c, producer in step.written}
        offset = 0
        for segment in step.plan.ordered():
            request = by_id[segment.request_id]
            k = request.params.prompt_logprobs
            if k is None:
                continue
            source = request.checkpointing.read_from
            if source is not None and segment.start == source.state_tokens and source.prompt_scores is not None:
                self._take_prefix_scores(request, source.prompt_scores, segment.start, k)
            count = segment.prompt_logit_rows
            if count:
                first = segment.start + 1  # row i scores the prompt token at start + 1 + i
                targets = torch.tensor(request.prompt_token_ids[first: first + count], device=rows.device)
                request.prompt_logprobs.update(zip(range(first, first + count),
                                                   score_tokens(rows[offset: offset + count], targets, k)))
            written = writes.get((id(request), segment.end))
            if written is not None and written.prompt_scores_k is not None and count:
                entries = {p: request.prompt_logprobs.get(p) for p in range(1, segment.end)}
                if None not in entries.values():  # complete (always, unless a fault interrupted a chain)
                    self.registry.attach_prompt_scores(written, PromptScores(k, entries,
                                                                             rows[offset + count - 1].clone()))
            offset += count

    @staticmethod
    def _take_prefix_scores(request: Request, scores: PromptScores, start: int, k: int) -> None:
        """Scores of prompt tokens 1 .. start from a checkpoint ending at `start` (top-k cut to `k`)."""
        tokens = request.prompt_token_ids
        request.prompt_logprobs.update({p: truncate(e, tokens[p], k) for p, e in scores.entries.items()})
        if start < len(tokens):
            target = torch.tensor([tokens[start]], device=scores.boundary_logits.device)
            request.prompt_logprobs[start] = score_tokens(scores.boundary_logits[None], target, k)[0]

    def _fail_steps(self, steps: list[ScheduledStep], error: Exception,
                    outputs: list[RequestOutput] | None = None) -> StepFailed:
        """Fail `steps` (the oldest in flight first): end every prompt with a sequence in them.
        `outputs`: those already collected in this call, reported with the failure."""
        failed_ids: list[str] = []
        finished: dict[str, _PromptGroup] = {}
        for step in steps:
            ended = self.scheduler.fail(step)
            for request_id in dict.fromkeys(r.parent_id for r in ended):
                group = self._groups.pop(request_id)
                for sequence in group.sequences:
                    if not sequence.is_finished:
                        self.scheduler.finish(sequence, "error")
                self._release(group)
                failed_ids.append(request_id)
            finished.update({r.parent_id: self._groups[r.parent_id] for r in step.finished
                             if r.parent_id in self._groups})
        self._counters["requests_failed"] += len(failed_ids)
        logger.error("step failed (%s: %s): ended %d request(s): %s", type(error).__name__, error,
                     len(failed_ids), ", ".join(failed_ids))
        return StepFailed(error, failed_ids, (outputs or []) + self._collect(finished))

    def _collect(self, touched: dict[str, _PromptGroup]) -> list[RequestOutput]:
        """Outputs of the prompts that progressed; finished prompts leave the engine."""
        outputs = []
        for group in touched.values():
            finished = all(s.is_finished for s in group.sequences)
            if finished or group.stream:
                outputs.append(self._make_output(group))
            if finished:
                del self._groups[group.request_id]
                self._release(group)
                self._counters["requests_finished"] += 1
        return outputs

    def _release(self, group: _PromptGroup) -> None:
        """Drop the per-sequence state of a prompt that has left the engine: penalty counts, text
        and grammar matchers (every path out: finished, aborted, failed)."""
        for sequence in group.sequences:
            self.sampler.free(sequence.request_id)
            self.output_processor.free(sequence.request_id)
            sequence.processors = None

    def _append_token(self, request: Request, token_id: int, logprobs: dict[int, float] | None, now: float) -> None:
        self._counters["generation_tokens_total"] += 1
        reason = self.output_processor.append_token(request, token_id, logprobs, now)
        if reason is not None:
            self.scheduler.finish(request, reason, keep_turn_end=True, now=now)

    def _make_output(self, group: _PromptGroup) -> RequestOutput:
        return self.output_processor.make_output(group.request_id, group.prompt, group.prompt_token_ids,
                                                 group.checkpoint_positions, group.sequences)

    # ------------------------------------------------------------------ introspection
    def metrics(self) -> dict[str, int | float]:
        stats = self.scheduler.stats
        registry = self.registry
        values: dict[str, int | float] = dict(self._counters)
        values.update(
            checkpoints_created=registry.num_created if registry is not None else 0,
            checkpoints_evicted=registry.num_evicted if registry is not None else 0,
            checkpoints_pending=registry.num_pending if registry is not None else 0,
            checkpoints_live=len(registry) if registry is not None else 0,
            checkpoint_hits=stats.checkpoint_hits,
            requests_deferred=stats.requests_deferred,
            producer_promotions=stats.producer_promotions,
            checkpoint_wait_timeouts=stats.checkpoint_wait_timeouts,
            deferral_wait_s_total=stats.deferral_wait_s_total,
            preemptions=stats.preemptions,
            prompt_tokens_computed=stats.prompt_tokens_computed,
            prompt_tokens_cached=self._counters["prompt_tokens_total"] - stats.prompt_tokens_computed,
            failed_steps=stats.failed_steps,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_blocks_used=self.block_pool.num_used,
            kv_blocks_total=self.block_pool.num_blocks,
            state_slots_used=self.state_pool.requests.num_used,
            state_slots_total=self.state_pool.requests.count,
            checkpoint_slots_used=self.state_pool.checkpoints.num_used,
            checkpoint_slots_total=self.state_pool.checkpoints.count,
        )
        if registry is not None:
            counters = registry.counters
            for kind in CheckpointKind:
                values[f"checkpoints_created_{kind.value}"] = counters.created[kind]
                values[f"checkpoint_hits_{kind.value}"] = counters.hits[kind]
                values[f"checkpoint_tokens_saved_{kind.value}"] = counters.tokens_saved[kind]
                values[f"checkpoints_evicted_{kind.value}"] = counters.evicted[kind]
            if registry.host is not None:
                tier = registry.host.counters
                values.update(checkpoints_spilled=tier.spilled, checkpoints_restored=tier.restored,
                              checkpoints_dropped_from_host=tier.dropped, host_tier_checkpoints=len(registry.host),
                              host_tier_bytes=registry.host.num_bytes)
        piecewise = self.runner.piecewise
        if piecewise is not None:
            values.update(cuda_graph_core_capture_failures=piecewise.core_capture_failures,
                          cuda_graph_core_replay_steps=piecewise.core_graph_steps)
        vision = self.runner.multimodal
        if vision is not None:
            values.update(vision_encoder_calls=vision.stats.encoder_calls,
                          images_encoded=vision.stats.images_encoded,
                          image_cache_hits=vision.stats.image_cache_hits,
                          image_cache_bytes=vision.cache.num_bytes)
        return values

    def checkpoint_keys(self) -> frozenset[bytes]:
        """Keys (chained prefix hashes, cache/hashing.py) of the checkpoints this engine holds ready."""
        if self.registry is None:
            return frozenset()
        return frozenset(c.key for c in self.registry if c.ready)

    def check_integrity(self) -> None:
        """Cross-check pools, registry and requests; raises AssertionError on any inconsistency."""
        live = {s.request_id for group in self._groups.values() for s in group.sequences}
        self.sampler.check_integrity(live)
        self.output_processor.check_integrity(live)
        self.state_pool.check_integrity()
        self.runner.storage.check_integrity()
        self.scheduler.check_integrity()
        expected: dict[int, int] = {}
        holders = self.scheduler.running + [r for r, _, _ in self.scheduler.releasing]
        for request in holders:
            for block in request.blocks:
                expected[block] = expected.get(block, 0) + 1
            if request.slot is None:
                raise AssertionError(f"running request {request.request_id} has no state slot")
        if self.registry is not None:
            if self.registry.host is not None:
                self.registry.host.check_integrity()
            for block, count in self.registry.block_refs().items():
                expected[block] = expected.get(block, 0) + count
        self.block_pool.check_integrity(expected)
        slots = [r.slot for r in holders]
        if self.state_pool.requests.num_used != len(slots) or len(set(slots)) != len(slots):
            raise AssertionError("request state slots leaked or shared")
        for request in self.scheduler.waiting:
            if request.slot is not None or request.blocks:
                raise AssertionError(f"waiting request {request.request_id} holds resources")
        if any(r.status is not RequestStatus.RUNNING for r in self.scheduler.running):
            raise AssertionError("non-running request in the running list")
        live = {r.parent_id for r in list(self.scheduler.waiting) + self.scheduler.running}
        if not live <= set(self._groups):
            raise AssertionError("a queued sequence belongs to no prompt")
        if not self._groups and self.registry is not None:
            # idle: nothing may hold a checkpoint, so every one must be evictable
            stuck = [c for c in self.registry if not c.ready or c.pins]
            if stuck:
                raise AssertionError(f"idle engine holds {len(stuck)} checkpoint(s) that can never be evicted")
