"""The two-phase recurrent driver (models/recurrent.py) with a toy recurrence plugged in: one step
with a decode group and two phases (a producer's prefix writes a checkpoint row that its own tail
and a consumer read in the next phase of the same forward) equals running every sequence token by
token, and the stacked form (`row_offset`) equals the per-layer form on its layer's rows only."""

from __future__ import annotations

import inspect
from typing import NamedTuple

import pytest
import torch

from forkpoint.models.mamba2 import Mamba2Mixer
from forkpoint.models.qwen3_5 import GatedDeltaNet
from forkpoint.models.recurrent import RecurrentKernels, two_phase_core
from forkpoint.step.batch import AttentionMetadata, DecodeGroup, ForwardBatch, RecurrentPhase

C, S = 3, 8  # channels, state rows per layer (row 0: the zero row)


class ToyProjection(NamedTuple):
    x: torch.Tensor  # [T, C]


def toy_token(x: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, decay: float):
    """One token of the toy recurrence: conv state = the previous token, ssm = decayed running sum
    of (token + previous token). x: [C]; conv: [C, 1]; ssm: [C] -> (out [C], conv, ssm)."""
    ssm = decay * ssm + (x + conv[:, 0])
    return ssm.clone(), x[:, None].clone(), ssm


class ToyKernels:
    """`RecurrentKernels` of the toy recurrence; args = the decay."""

    def decode_step(self, p, decay, conv_state, ssm_state, rows, out):
        ssm = decay * ssm_state[rows] + (p.x + conv_state[rows, :, 0])
        conv_state[rows] = p.x[:, :, None]
        ssm_state[rows] = ssm
        out.copy_(ssm)

    def phase_scan(self, p, decay, conv_initial, ssm_initial, cu_seqlens, cu_seqlens_host, out):
        finals_conv, finals_ssm = [], []
        for i, (lo, hi) in enumerate(zip(cu_seqlens_host, cu_seqlens_host[1:])):
            conv, ssm = conv_initial[i], ssm_initial[i]
            for t in range(lo, hi):
                out[t], conv, ssm = toy_token(p.x[t], conv, ssm, decay)
            finals_conv.append(conv)
            finals_ssm.append(ssm)
        return torch.stack(finals_conv), torch.stack(finals_ssm)


def long(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def phase(start: int, lengths: list[int], initial: list[int], dest_rows: list[int], dest_slots: list[int]):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return RecurrentPhase(start, start + offsets[-1], long(*offsets), tuple(offsets), long(*initial),
                          long(*dest_rows), long(*dest_slots))


# packed tokens: [A, B decodes | P prefix (5), Q continuation (3) | P tail (2), consumer (3)]
DECODE_SLOTS = (3, 4)
PHASE0 = phase(2, [5, 3], initial=[0, 2], dest_rows=[0, 1], dest_slots=[6, 2])  # P's prefix -> checkpoint row 6
PHASE1 = phase(10, [2, 3], initial=[6, 6], dest_rows=[0, 1], dest_slots=[5, 7])  # both read row 6
T = 15


def batch() -> ForwardBatch:
    empty = torch.zeros(0, dtype=torch.long)
    attention = AttentionMetadata(empty, torch.zeros(0, 1, dtype=torch.int32), empty, (0,), empty, (), empty, empty)
    return ForwardBatch(torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long),
                        DecodeGroup(2, long(*DECODE_SLOTS)), (PHASE0, PHASE1), attention, long(T - 1))


def reference(x: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, decay: float):
    """Every sequence token by token from its rows -> (out [T, C], conv, ssm) after the step."""
    conv, ssm, out = conv.clone(), ssm.clone(), torch.empty(T, C)

    def run(tokens: range, row: int, dest: int) -> None:
        c, s = conv[row], ssm[row]
        for t in tokens:
            out[t], c, s = toy_token(x[t], c, s, decay)
        conv[dest], ssm[dest] = c, s

    run(range(0, 1), 3, 3)  # decode A
    run(range(1, 2), 4, 4)  # decode B
    run(range(2, 7), 0, 6)  # P's prefix from the zero row -> checkpoint row 6
    run(range(7, 10), 2, 2)  # Q continues from its own slot
    run(range(10, 12), 6, 5)  # P's tail from the checkpoint -> its private slot
    run(range(12, 15), 6, 7)  # the consumer from the checkpoint
    return out, conv, ssm


def states(layers: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    conv = torch.randn(layers, S, C, 1, generator=generator)
    ssm = torch.randn(layers, S, C, generator=generator)
    conv[:, 0] = 0
    ssm[:, 0] = 0
    return conv, ssm


def test_two_phases_equal_token_by_token_and_checkpoint_rows_are_read_in_the_same_forward():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(T, C, generator=generator)
    conv, ssm = states(1, generator)
    conv, ssm = conv[0], ssm[0]
    expected_out, expected_conv, expected_ssm = reference(x, conv, ssm, 0.9)
    out = torch.full((T, C), float("nan"))
    two_phase_core(ToyKernels(), ToyProjection(x), batch(), conv, ssm, out, 0.9)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(conv, expected_conv)
    torch.testing.assert_close(ssm, expected_ssm)
    assert not conv[0].any() and not ssm[0].any()  # the zero row is only read


def test_stacked_rows_select_the_layer_by_row_offset():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(T, C, generator=generator)
    conv, ssm = states(3, generator)
    per_layer_conv, per_layer_ssm = conv[1].clone(), ssm[1].clone()
    expected_out = torch.empty(T, C)
    two_phase_core(ToyKernels(), ToyProjection(x), batch(), per_layer_conv, per_layer_ssm, expected_out, 0.5)
    before = conv.clone(), ssm.clone()
    out = torch.full((T, C), float("nan"))
    two_phase_core(ToyKernels(), ToyProjection(x), batch(), conv.flatten(0, 1), ssm.flatten(0, 1), out, 0.5,
                   row_offset=torch.tensor(1 * S))
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    torch.testing.assert_close(conv[1], per_layer_conv, rtol=0, atol=0)
    torch.testing.assert_close(ssm[1], per_layer_ssm, rtol=0, atol=0)
    for j in (0, 2):  # other layers' rows untouched
        assert torch.equal(conv[j], before[0][j]) and torch.equal(ssm[j], before[1][j])


@pytest.mark.parametrize("mixer", [GatedDeltaNet, Mamba2Mixer, ToyKernels], ids=lambda cls: cls.__name__)
def test_mixers_plug_in_both_kernels_with_the_drivers_arguments(mixer):
    for name in ("decode_step", "phase_scan"):
        expected = len(inspect.signature(getattr(RecurrentKernels, name)).parameters)
        assert len(inspect.signature(getattr(mixer, name)).parameters) == expected, f"{mixer.__name__}.{name}"


def test_single_token_phases_keep_the_state_after_every_verified_token():
    """Speculative verification (`single_tokens` phases): a decode, then a chain of one-token phases,
    each from the row the phase before wrote into its own row, leaves the state after every position
    in its own row (through the single-token kernels), as token by token; the start row is kept."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4, C, generator=generator)
    conv, ssm = states(1, generator)
    conv, ssm = conv[0], ssm[0]
    chain = [3, 5, 6, 7]  # the request's own row, then one spare row per draft
    phases = tuple(RecurrentPhase(i, i + 1, long(0, 1), (0, 1), long(chain[i - 1]), long(0), long(chain[i]),
                                  single_tokens=True) for i in range(1, 4))
    empty = torch.zeros(0, dtype=torch.long)
    attention = AttentionMetadata(empty, torch.zeros(0, 1, dtype=torch.int32), empty, (0,), empty, (), empty, empty)
    step = ForwardBatch(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                        DecodeGroup(1, long(chain[0])), phases, attention, long(3))
    expected = []
    c, s = conv[chain[0]].clone(), ssm[chain[0]].clone()
    for t in range(4):
        out_t, c, s = toy_token(x[t], c, s, 0.7)
        expected.append((out_t, c, s))
    untouched = conv[1].clone(), ssm[1].clone()
    out = torch.full((4, C), float("nan"))
    two_phase_core(ToyKernels(), ToyProjection(x), step, conv, ssm, out, 0.7)
    for t, (out_t, c, s) in enumerate(expected):
        torch.testing.assert_close(out[t], out_t)
        torch.testing.assert_close(conv[chain[t]], c)
        torch.testing.assert_close(ssm[chain[t]], s)
    assert torch.equal(conv[1], untouched[0]) and torch.equal(ssm[1], untouched[1])
