"""The run's cost counters count the positions its forwards compute (rlvr.rollout.forward_tokens,
sampled_positions): finished rows that left the decode batch and the padding length buckets skip
are not counted; a batch whose every row runs to the mask's width gives the price's counts at the cap."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlvr import costs, scoring
from rlvr.rollout import forward_tokens, sampled_positions


def _rollout(extents: list[int], T: int, prompt_len: int, decode_rows: int = 0) -> SimpleNamespace:
    mask = torch.zeros(len(extents), T)
    for i, e in enumerate(extents):
        mask[i, :e] = 1
    return SimpleNamespace(mask=mask, prompt_len=prompt_len, decode_rows=decode_rows)


def test_a_forward_counts_each_part_to_its_longest_row_by_hand():
    """4 rows of responses 6, 2, 2 and 1 tokens, prompts of 3, groups of 2. One forward of every row:
    the prompts once a group (2 x 3) and 4 rows x 5 response positions (each row's last token feeds
    nothing) = 26, the price's count at the cap. Two parts of one group each: (3 + 2 x 6 - 2) +
    (3 + 2 x 2 - 2) = 18. Prompts not shared: 4 x 3 + 24 - 4 = 32."""
    r = _rollout([6, 2, 2, 1], T=6, prompt_len=3)
    assert forward_tokens(r, 2, True) == 26 == costs.logp_forward_tokens(4, 2, 3, 6, shared_prompt=True)
    assert forward_tokens(r, 2, True, parts=[torch.tensor([0, 1]), torch.tensor([2, 3])]) == 18
    assert forward_tokens(r, 2, False) == 32 == costs.logp_forward_tokens(4, 2, 3, 6, shared_prompt=False)


def test_length_buckets_count_each_bucket_to_its_own_longest():
    """Two rows of 200 tokens and six of 10 (prompts of 5, not shared): one forward computes 8 x 200
    response columns; in length buckets (two here: the cut saves 6 x 190 padded columns, far more than
    a call costs) 2 x 200 + 6 x 10 = 460. Positions: 8 x 5 + columns - 8 rows' last tokens."""
    r = _rollout([200, 200] + [10] * 6, T=200, prompt_len=5)
    ext = scoring.response_extent(r.mask)
    assert len(scoring.length_buckets(ext)) == 2
    assert forward_tokens(r, 2, False) == 40 + 1600 - 8
    assert forward_tokens(r, 2, False, buckets=True) == 40 + 460 - 8


def test_sampling_counts_the_rows_each_decode_step_computed():
    """2 prompts of 4 tokens, 8 rows, responses up to 5 tokens: the prefill (2 x 4) and the rows the
    decode steps computed (decode_rows 20, finished rows having left the batch) = 28; a rollout that
    does not say what it computed is counted at every row but its last token, 8 + 8 x 4 = 40."""
    assert sampled_positions(_rollout([5, 2, 1, 3, 5, 2, 2, 4], T=5, prompt_len=4, decode_rows=20), 2) == 28
    assert sampled_positions(_rollout([5] * 8, T=5, prompt_len=4), 2) == 40 == costs.sampling_forward_tokens(2, 4, 8, 5)
