"""Overlong handling (issue 51): what algorithm.overlong_buffer / overlong_penalty and
algorithm.mask_truncated do to the reward, the Δ and the gradient of a row cut at the length bound,
by hand; and train/truncated_frac in a run's log."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from rlvr import advantages
from rlvr.learn import learn
from rlvr.rollout import OVERLONG, add_overlong_penalty, mask_truncated
from test_stages import make_batch, make_learner, sampled_grad
from test_train import ONE_STEP, USER_TASK, train_rows, train_run

# one group of G = 4 responses under a bound of 4 tokens: row 0 runs into it (cut), rows 1-3 end
LENGTHS, MAX_LEN = [4, 2, 3, 1], 4
REWARDS = [1.0, 0.0, 1.0, 0.0]


def overlong_batch(**algorithm):
    """The group's batch (tests/test_stages.make_batch: token 1, 0, 1, ... of V = 2) with row 0
    truncated, its rewards shaped by add_overlong_penalty under `algorithm` and Δ centred."""
    batch = make_batch(LENGTHS, [[0.0] * 4])
    batch.rollout.truncated[0] = True
    groups = dataclasses.replace(batch.groups, rewards=torch.tensor([REWARDS]))
    groups = add_overlong_penalty(groups, types.SimpleNamespace(**algorithm), MAX_LEN)
    delta = advantages.compute(groups.rewards, "centered")                                 # (1, 4)
    return dataclasses.replace(batch, groups=groups, parts=[groups], delta=delta)


def test_the_overlong_penalty_shapes_the_cut_rows_reward_and_delta_by_hand():
    # buffer 2, penalty 0.5: L <= 2 → 0, L = 3 → -0.25, L = 4 (the bound, row 0) → -0.5
    batch = overlong_batch(overlong_buffer=2, overlong_penalty=0.5)
    assert batch.groups.per_reward[OVERLONG] == [-0.5, 0.0, -0.25, 0.0]
    assert batch.groups.rewards.tolist() == [[0.5, 0.0, 0.75, 0.0]]
    # centred on the group's mean 1.25 / 4 = 0.3125: the cut row's Δ falls from +0.5 (no penalty) to +0.1875
    torch.testing.assert_close(batch.delta, torch.tensor([[0.1875, -0.3125, 0.4375, -0.3125]]))
    plain = advantages.compute(torch.tensor([REWARDS]), "centered")
    assert float(plain[0, 0]) == 0.5


def test_a_cut_row_trains_with_its_penalised_delta_unless_masked_by_hand():
    """token_mean over the 10 tokens: each sampled token's logit gets -Δ_b · (1 - 1/V) / 10 = -Δ_b / 20;
    with algorithm.mask_truncated the cut row's 4 tokens get nothing and leave the denominator (6
    tokens: -Δ_b / 12), while its Δ still came from the centring over the whole group."""
    batch = overlong_batch(overlong_buffer=2, overlong_penalty=0.5)
    delta = batch.delta.view(-1, 1)                                                         # (4, 1)
    mask = batch.rollout.mask                                                               # (4, 4)
    learner, policy = make_learner(batch, G=4)
    learn(learner, batch)
    torch.testing.assert_close(sampled_grad(policy, batch), -delta / 20 * mask)
    masked = mask_truncated(batch)
    assert masked.stats["masked_truncated_frac"] == 0.25
    learner, policy = make_learner(masked, G=4)
    learn(learner, masked)
    want = -delta / 12 * mask
    want[0] = 0.0
    torch.testing.assert_close(sampled_grad(policy, masked), want)


def test_truncated_frac_is_logged_with_the_penalty(tmp_path):
    path = tmp_path / "mytask.py"
    path.write_text(USER_TASK)
    rc, _, err = train_run(tmp_path / "run", *ONE_STEP, f"--task.path={path}:TASK", "--task.reward=exact",
                           "--task.options={}", "--algorithm.overlong_buffer=2", "--algorithm.overlong_penalty=0.5",
                           "--algorithm.mask_truncated=true")
    assert rc == 0, err
    (row,) = train_rows(tmp_path / "run")
    assert 0.0 <= row["train/truncated_frac"] <= 1.0
    assert row["train/masked_truncated_frac"] == pytest.approx(row["train/truncated_frac"])
    assert "train/reward_overlong_penalty" in row
