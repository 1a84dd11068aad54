"""The runner's side of speculative decoding with the model's MTP head: verify, then draft.

One step (`MTPDrafter.execute`), for a plan whose `verifies` name the requests that check drafts::

    forward        the target over every segment (a verifying request: its k + 1 one-token segments,
                   each recurrent state kept in its own row, engine/speculative.py) -> hidden [T, H]
    sample         plain sampling segments as without speculation (runner/step_sampler.py)
    verify         per verifying request, its k + 1 logits rows: greedy -> the longest prefix of drafts
                   equal to the target's argmax, then the target's token; sampling -> rejection
                   sampling against the point-mass draft (accept d with probability p(d); on a
                   rejection draw from p without d; all accepted: draw the bonus from the last row),
                   which leaves every emitted token distributed exactly as plain sampling's
    MTP pass       the head over every row of the step: row at position i reads the target's normed
                   hidden at i and the token at i + 1 (the next prompt token, the sampled or accepted
                   token), writing its KV (the pools' last attention layer) for every position the
                   request now has; its output at each request's last position drafts token 1
    MTP chain      k - 1 one-token steps of the head on its own output (positions beyond the last
                   token; their KV is rewritten by the next step's MTP pass), while the request's
                   blocks cover the position

Rows of rejected drafts leave garbage KV past the request's length: nothing reads a position at or
past a request's length before it is written again (attention reads up to its own position).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from forkpoint.models.interface import CausalLM
from forkpoint.runner.model_runner import ModelRunner, build_forward_batch
from forkpoint.runner.sampler import sampling_probs, with_logprobs
from forkpoint.step.batch import ForwardBatch
from forkpoint.step.plan import Segment, SegmentKind, StepPlan, Verify
from forkpoint.step.result import StepResult, Verified


class FinishedStep:
    """A speculative step, already complete (speculative steps are never scheduled ahead)."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def result(self) -> StepResult:
        return self._result


@dataclass(frozen=True)
class _DraftStart:
    """Where a request's drafting starts: packed row `row` of the step, at position `position` (the head
    reads there the request's last token, at position + 1, and drafts the token after it), and the
    request's KV blocks."""

    request_id: str
    row: int
    position: int
    block_table: Sequence[int]


class MTPDrafter:
    """Runs speculative steps for a `ModelRunner` whose model has an MTP head (`model.mtp`).
    num_speculative_tokens: k, the most drafts per request and step."""

    def __init__(self, model: CausalLM, num_speculative_tokens: int) -> None:
        if model.mtp is None:
            raise ValueError("speculative decoding with method 'mtp' needs the model built with its MTP head")
        self.model = model
        self.k = num_speculative_tokens

    @torch.inference_mode()
    def execute(self, runner: ModelRunner, plan: StepPlan) -> FinishedStep:
        """The step of `plan` on `runner` (its storage, sampling state and batch builder): forward,
        sampling, verification, drafting. Returns the finished step."""
        model = self.model
        batch, sampled = runner.prepare(plan)
        hidden = runner.forward_hidden(batch)  # through the piecewise graphs when captured
        logits = model.compute_logits(hidden, batch.logits_indices)
        verifies = {v.request_id: v for v in plan.verifies}
        plain_rows = [row for row, s in enumerate(sampled) if s.request_id not in verifies]
        plain_logits = torch.cat([logits[plain_rows], logits[len(sampled):]])
        base = runner.sampling.launch(plan, [sampled[row] for row in plain_rows], plain_logits).result()
        verified = self._verify(plan, sampled, logits, runner)
        emitted = {request_id: token.token_id for request_id, token in zip(base.request_ids, base.tokens)}
        drafts = self._draft(runner, plan, batch, hidden, emitted, {v.request_id: v for v in verified}, verifies)
        return FinishedStep(StepResult(base.request_ids, base.tokens, base.prompt_scores, verified, drafts))

    # ------------------------------------------------------------------ verification
    def _verify(self, plan: StepPlan, sampled: Sequence[Segment], logits: torch.Tensor,
                runner: ModelRunner) -> tuple[Verified, ...]:
        """Every `Verify` of the plan against its m + 1 logits rows (positions start .. start + m) ->
        the emitted tokens (accepted drafts, then the target's own), each with its raw logprobs when
        asked for. Greedy rows: one argmax over all of them and one host copy; sampled rows: rejection
        sampling from the sequence's own generator."""
        rows_of: dict[str, list[int]] = {}
        for row, segment in enumerate(sampled):
            rows_of.setdefault(segment.request_id, []).append(row)
        specs = {spec.request_id: spec for spec in plan.sampling.rows}
        greedy = [v for v in plan.verifies if specs[v.request_id].params.greedy]
        targets: dict[str, list[int]] = {}
        if greedy:
            index = torch.tensor([row for v in greedy for row in rows_of[v.request_id]], device=logits.device)
            flat = logits.index_select(0, index).argmax(dim=-1).tolist()
            offset = 0
            for v in greedy:
                targets[v.request_id] = flat[offset: offset + len(v.draft_token_ids) + 1]
                offset += len(v.draft_token_ids) + 1
        chosen: dict[str, list[int]] = {}
        for verify in plan.verifies:
            drafts, spec = verify.draft_token_ids, specs[verify.request_id]
            if spec.params.greedy:
                target, accepted = targets[verify.request_id], 0
                while accepted < len(drafts) and target[accepted] == drafts[accepted]:
                    accepted += 1
                chosen[verify.request_id] = target[: accepted + 1]
            else:
                probs = sampling_probs(logits[rows_of[verify.request_id]], [spec.params] * (len(drafts) + 1))
                chosen[verify.request_id] = self._rejection_sample(probs, drafts, runner.sampling.generator(spec))
        rows = [row for v in plan.verifies for row in rows_of[v.request_id][: len(chosen[v.request_id])]]
        params = [specs[v.request_id].params for v in plan.verifies for _ in chosen[v.request_id]]
        tokens = with_logprobs(logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device)),
                               torch.tensor([t for v in plan.verifies for t in chosen[v.request_id]],
                                            dtype=torch.long, device=logits.device), params) if rows else []
        verified, offset = [], 0
        for verify in plan.verifies:
            count = len(chosen[verify.request_id])
            verified.append(Verified(verify.request_id, tuple(tokens[offset: offset + count]),
                                     len(verify.draft_token_ids)))
            offset += count
        return tuple(verified)

    @staticmethod
    def _rejection_sample(probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None) -> list[int]:
        """probs: [m + 1, V] the target's sampling distributions at the m + 1 positions; drafts: m
        tokens from a point-mass (greedy) drafter -> the emitted tokens: each draft is accepted with
        probability probs[i, d]; the first rejection draws from probs[i] with d removed (renormalised;
        max(p - q, 0) for a point mass q); all accepted: one more draw from probs[m]."""
        chosen: list[int] = []
        for i, draft in enumerate(drafts):
            u = torch.rand((), generator=generator, device=probs.device)
            if bool(u < probs[i, draft]):
                chosen.append(draft)
                continue
            residual = probs[i].clone()
            residual[draft] = 0.0
            chosen.append(_draw(residual, generator))
            return chosen
        chosen.append(_draw(probs[len(drafts)].clone(), generator))
        return chosen

    # ------------------------------------------------------------------ drafting
    def _draft(self, runner: ModelRunner, plan: StepPlan, batch: ForwardBatch, hidden: torch.Tensor,
               emitted: dict[str, int], verified: dict[str, Verified],
               verifies: dict[str, Verify]) -> dict[str, tuple[int, ...]]:
        """The MTP pass over the step's rows, then the chain: request id -> its drafts (1 .. k tokens)."""
        model = self.model
        segments = plan.ordered()
        inputs, starts = self._shifted_inputs(segments, emitted, verified, verifies)
        device = hidden.device
        ids = torch.from_numpy(inputs).to(device)
        positions = batch.positions if batch.mrope_positions is None else batch.mrope_positions
        embeds, cos_sin = model.embed(ids, positions)
        caches = runner.caches
        out = model.mtp(embeds, model.norm_hidden(hidden), cos_sin, batch, caches.k[-1], caches.v[-1])
        if not starts:
            return {}
        rows = torch.tensor([start.row for start in starts], dtype=torch.long, device=device)
        previous = out.index_select(0, rows)
        tokens = model.lm_head(previous).float().argmax(dim=-1)
        drafts = {start.request_id: [token] for start, token in zip(starts, tokens.tolist())}
        active = list(range(len(starts)))
        block_size = runner.block_size
        for step in range(1, self.k):
            # the head's next input: its last draft, at the position after the one it just read
            active = [i for i in active
                      if starts[i].position + step < min(len(starts[i].block_table) * block_size,
                                                         model.config.max_position_embeddings)]
            if not active:
                break
            chain = StepPlan(tuple(Segment(
                request_id=starts[i].request_id, start=starts[i].position + step, end=starts[i].position + step + 1,
                token_ids=(drafts[starts[i].request_id][-1],), block_table=starts[i].block_table,
                initial_slot=runner.scratch_slot, dest_slots=(), kind=SegmentKind.DECODE, phase=0, samples=True)
                for i in active))
            chain_batch, _ = build_forward_batch(chain, block_size, device)
            index = torch.tensor(active, dtype=torch.long, device=device) if len(active) < len(starts) else None
            last = previous if index is None else previous.index_select(0, index)
            embeds, cos_sin = model.embed(chain_batch.input_ids, chain_batch.positions)
            step_out = model.mtp(embeds, last, cos_sin, chain_batch, caches.k[-1], caches.v[-1])
            step_tokens = model.lm_head(step_out).float().argmax(dim=-1).tolist()
            for i, token in zip(active, step_tokens):
                drafts[starts[i].request_id].append(token)
            previous = step_out if index is None else previous.index_copy(0, index, step_out)
        return {request_id: tuple(tokens) for request_id, tokens in drafts.items()}

    @staticmethod
    def _shifted_inputs(segments: Sequence[Segment], emitted: dict[str, int], verified: dict[str, Verified],
                        verifies: dict[str, Verify]) -> tuple[np.ndarray, list[_DraftStart]]:
        """The MTP pass's input ids [T] (packed order): at each row the request's token one position
        later; and where each sampling request's drafting starts (its last emitted token's row)."""
        following: dict[tuple[str, int], int] = {(s.request_id, s.start): s.token_ids[0]
                                                  for s in segments if s.token_ids}
        parts, starts, offset = [], [], 0
        for segment in segments:
            request_id, end = segment.request_id, segment.end
            verify = verifies.get(request_id)
            if verify is not None:
                result = verified[request_id].tokens
                i = segment.start - verify.start  # this row's place in the verify run
                if i < len(result):
                    follow = result[i].token_id
                    if i == len(result) - 1:
                        starts.append(_DraftStart(request_id, offset, segment.start, segment.block_table))
                else:  # a rejected draft's row: its KV is rewritten later, any token will do
                    follow = verify.draft_token_ids[i - 1]
            elif (request_id, end) in following:
                follow = following[(request_id, end)]
            elif segment.samples:
                follow = emitted[request_id]
                starts.append(_DraftStart(request_id, offset + segment.num_tokens - 1, end - 1, segment.block_table))
            elif segment.next_token is not None:
                follow = segment.next_token
            else:
                raise ValueError(f"segment of {request_id} at {segment.start}..{end} neither samples nor names its "
                                 "next token (Segment.next_token): the MTP head has no input for its last position")
            parts.append(np.asarray(list(segment.token_ids[1:]) + [follow], dtype=np.int64))
            offset += segment.num_tokens
        return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), starts


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the (unnormalised) distribution probs [V], by the exponential race the sampler uses."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / race).argmax())
