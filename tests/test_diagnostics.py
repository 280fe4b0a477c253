"""Figures that show learning, and the rules that turn them into warnings naming a fix."""

import torch

from rlvr.diagnostics import PASS_RATE_BINS, Watch, length_by_outcome, pass_rate_histogram


def test_pass_rate_histogram_by_hand():
    hits = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    assert len(PASS_RATE_BINS) == 6
    # 0 | (0,.25] | (.25,.5] | (.5,.75] | (.75,1) | 1
    assert pass_rate_histogram(hits) == [1, 1, 1, 1, 0, 2]
    assert pass_rate_histogram(torch.tensor([[1] * 7 + [0]])) == [0, 0, 0, 0, 1, 0]


def test_length_by_outcome():
    lengths = torch.tensor([2, 4, 6, 8])
    hits = torch.tensor([True, False, True, False])
    trunc = torch.tensor([False, False, False, True])
    assert length_by_outcome(lengths, hits, trunc) == {"solved": 4.0, "unsolved": 6.0, "truncated": 8.0}
    assert "truncated" not in length_by_outcome(lengths, hits, torch.zeros(4, dtype=torch.bool))


def row(agree=0.0, entropy=1.0, reward=0.5):
    return {"train/agreeing_groups_frac": agree, "train/entropy": entropy, "train/reward": reward}


def test_agreeing_groups_rule_names_the_fix_and_cools_down():
    w = Watch(window=3, cooldown=5)
    assert w.after_step(1, row(0.9)) == [] and w.after_step(2, row(0.9)) == []
    msgs = w.after_step(3, row(0.9))
    assert len(msgs) == 1 and "dynamic_sampling" in msgs[0] and "samples_per_prompt" in msgs[0]
    assert w.after_step(4, row(0.9)) == []                 # cooling down
    assert w.after_step(8, row(0.9)) != []                 # due again
    w2 = Watch(window=3)
    assert all(w2.after_step(s, row(0.7)) == [] for s in range(1, 10))   # 70% is below the 80% rule


def test_entropy_collapse_with_flat_goal():
    w = Watch(window=2)
    for s in range(1, 3):
        w.after_step(s, row(entropy=2.0))
    assert w.after_eval(2, goal=0.30) == []                # first evaluation: nothing to compare
    for s in range(3, 5):
        w.after_step(s, row(entropy=0.5))
    msgs = w.after_eval(4, goal=0.305)
    assert len(msgs) == 1 and "train.lr" in msgs[0] and "kl_coef" in msgs[0]


def test_entropy_falling_while_goal_rises_is_fine():
    w = Watch(window=2)
    for s in range(1, 3):
        w.after_step(s, row(entropy=2.0))
    w.after_eval(2, goal=0.3)
    for s in range(3, 5):
        w.after_step(s, row(entropy=0.5))
    assert w.after_eval(4, goal=0.6) == []


def test_reward_up_goal_down_means_gamed():
    w = Watch(window=2)
    for s in range(1, 3):
        w.after_step(s, row(reward=0.4))
    w.after_eval(2, goal=0.5)
    for s in range(3, 5):
        w.after_step(s, row(reward=0.8))
    msgs = w.after_eval(4, goal=0.3)
    assert len(msgs) == 1 and "rlvr audit" in msgs[0] and "gamed" in msgs[0]


def test_agreeing_because_solved_says_so():
    w = Watch(window=2)
    solved = {**row(0.9), "train/pass_rate_hist": [0, 0, 0, 0, 1, 9]}
    w.after_step(1, solved)
    msgs = w.after_step(2, solved)
    assert len(msgs) == 1 and "fully solved" in msgs[0] and "too easy" in msgs[0]
    w2 = Watch(window=2)
    failed = {**row(0.9), "train/pass_rate_hist": [9, 1, 0, 0, 0, 0]}
    w2.after_step(1, failed)
    assert "dynamic_sampling" in w2.after_step(2, failed)[0]


def test_no_entropy_warning_once_the_goal_is_reached():
    w = Watch(window=2)
    for s in range(1, 3):
        w.after_step(s, row(entropy=0.05))
    w.after_eval(2, goal=0.994)
    for s in range(3, 5):
        w.after_step(s, row(entropy=0.02))
    assert w.after_eval(4, goal=0.994) == []
