"""The price's decode and learn stage at an expected response length (rlvr.costs.price with
RunShape.expected_response_tokens below the cap): the length model of rlvr.lengths applied to the
run's shape and what was measured on its policy (rlvr.costs.Measured)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlvr.lengths import (decode_row_columns, decode_split, expected_buckets, expected_decode_seconds,
                          learn_part_widths, length_survival)

if TYPE_CHECKING:
    from rlvr.costs import Measured, RunShape, ScaleOut


@dataclass(frozen=True)
class Expected:
    """A batch's decode and learn stage at an expected response length (`expected_lengths`)."""

    decode_s: float                 # the first sampling round's decode, seconds
    decode_steps: float             # its expected decode steps
    decode_rows: float              # mean rows a step computes
    fixed_s: float                  # a step's cost whatever its rows (`decode_split`)
    per_row_s: float                # and per row
    parts: float                    # a gradient step's parts in full-length parts (`learn_part_widths`)
    part_tokens: float              # the mean response columns of a part
    buckets: float                  # the mean length buckets of a part (0: one call)


def expected_lengths(run: RunShape, m: Measured, so: ScaleOut, parts: int) -> Expected:
    """The decode and the learn parts of `run` at its expected response length: decode over the rows
    the probe measured (all P x G, or a rollout worker's share), E[longest] - 1 steps at the fixed
    part plus the rows each step computes at the part per row, plus `decode_cell_s` a row for each
    column it has cached (`decode_row_columns`); each learn part at its rows' expected columns
    (`learn_part_widths`; with length buckets the mean of `expected_buckets`' cuts, their padding
    counted), as a fraction of the measured part at T: the part measured at the expected lengths
    (`learn_expected_part_s`) where it was, else the part at T in proportion to the positions a row
    computes (its prompt's share included)."""
    G, T, Lp = run.samples_per_prompt, run.max_new_tokens, run.prompt_tokens
    survival = length_survival(run.priced_response_tokens, T)
    rows = (so.decode_share[0] if so.decode_share else run.prompts_per_step) * G
    fixed, per_row = decode_split(m.decode_step_s, rows, m.decode_small_step_s, m.decode_small_prompts * G)
    decode_s, steps, computed = expected_decode_seconds(survival, rows, fixed, per_row, run.compact_finished)
    decode_s += m.decode_cell_s * decode_row_columns(survival, rows, run.compact_finished)
    groups = -(-run.prompts_per_step // run.minibatches) if so.learn_share is None else so.learn_share[0]
    widths = learn_part_widths(survival, max(1, groups), G, parts, run.length_buckets)
    buckets = 0.0
    if run.length_buckets:
        part_rows = -(-max(1, groups) // parts) * G
        buckets, positions = expected_buckets(survival, part_rows)
        widths = [positions / part_rows] * parts
    prompt = Lp / G if run.shared_prompt else Lp          # a row's prompt positions (once a group where shared)
    share = [(prompt + w - 1) / (prompt + T - 1) for w in widths]
    if m.learn_expected_part_s > 0 and m.learn_part_s > 0:
        share = [m.learn_expected_part_s / m.learn_part_s] * parts
    return Expected(decode_s=decode_s, decode_steps=steps, decode_rows=computed / max(steps, 1e-9),
                     fixed_s=fixed, per_row_s=per_row, parts=sum(share),
                     part_tokens=sum(widths) / len(widths), buckets=buckets)


def expected_fields(e: Expected, m: Measured) -> dict:
    """The `Price` fields of an expected-length decode and learn stage."""
    return dict(decode_steps_per_batch=e.decode_steps, decode_rows_per_step=e.decode_rows,
                decode_fixed_s=e.fixed_s, decode_row_s=e.per_row_s, decode_small_step_s=m.decode_small_step_s,
                decode_small_prompts=m.decode_small_prompts if m.decode_small_step_s else 0,
                learn_part_tokens=e.part_tokens, learn_part_fraction=e.parts, learn_buckets_per_part=e.buckets)
