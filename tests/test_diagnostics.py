"""Figures that show learning, and the rules that turn them into warnings naming a fix."""

import json
from pathlib import Path

import torch

from rlvr.diagnostics import (PASS_RATE_BINS, Watch, agreement_breakdown, exploration_levers, length_by_outcome,
                               missing_symbols, pass_rate_histogram, response_concentration)


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


def test_held_out_falling_while_the_training_goal_holds_is_not_called_gamed():
    """Reward and training goal rose, held-out fell (SmolLM2's chain of thought: sampled accuracy up,
    greedy held-out down): the warning says the samples still meet the goal and points at best/; with
    the training goal falling it is the gamed warning, with both goals' figures."""
    def run(goal_before, goal_after):
        w = Watch(window=2)
        for s in range(1, 3):
            w.after_step(s, {**row(reward=0.4), "train/goal": goal_before})
        w.after_eval(2, goal=0.17)
        for s in range(3, 5):
            w.after_step(s, {**row(reward=0.5), "train/goal": goal_after})
        return w.after_eval(4, goal=0.09)

    msgs = run(0.11, 0.14)
    assert len(msgs) == 1 and "0.110 -> 0.140" in msgs[0] and "0.170 -> 0.090" in msgs[0]
    assert "not what is gamed" in msgs[0] and "greedily" in msgs[0] and "best/" in msgs[0]
    assert "rlvr audit" not in msgs[0]
    msgs = run(0.30, 0.20)
    assert len(msgs) == 1 and "being gamed" in msgs[0] and "rlvr audit" in msgs[0]
    assert "training goal fell (0.300 -> 0.200)" in msgs[0]


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


# --- entropy collapse spread over many evaluations (2-digit addition from scratch) -------------


def addition_like(steps=300, every=25, h0=2.67, h_end=0.08, goal=0.006):
    """Entropy decaying geometrically from h0 to h_end over `steps` with a flat held-out goal:
    the shape of a from-scratch 2-digit addition run that collapsed onto a constant answer."""
    rate = (h_end / h0) ** (1 / (steps - 1))
    rows, evals = [], {}
    for s in range(1, steps + 1):
        rows.append({"step": s, "train/agreeing_groups_frac": 0.5, "train/reward": 0.0, "train/goal": 0.0,
                     "train/entropy": h0 * rate ** (s - 1)})
        if s % every == 0:
            evals[s] = goal
    return rows, evals


def replay(w, rows, evals, step0_goal=None):
    out = []
    if step0_goal is not None:
        out += [(0, m) for m in w.after_eval(0, step0_goal)]
    for r in rows:
        out += [(r["step"], m) for m in w.after_step(r["step"], r)]
        if r["step"] in evals:
            out += [(r["step"], m) for m in w.after_eval(r["step"], evals[r["step"]])]
    return out


def test_gradual_collapse_is_caught_against_the_start_of_the_run():
    rows, evals = addition_like()
    # why the old rule (previous evaluation only) never fired: between two evaluations 25 steps
    # apart the window-mean entropy never falls by half
    means = {s: sum(r["train/entropy"] for r in rows[s - 10:s]) / 10 for s in evals}
    steps = sorted(means)
    assert all(means[b] > 0.5 * means[a] for a, b in zip(steps, steps[1:]))
    msgs = [(s, m) for s, m in replay(Watch(), rows, evals) if "entropy" in m]
    assert msgs, "the collapse must be reported"
    step, msg = msgs[0]
    # per step the entropy is multiplied by (0.08/2.67)^(1/299) = 0.98834, so between evaluations by
    # 0.98834^25 = 0.746 (never by half); the mean of steps 1-10 is 2.534 and the mean of steps 66-75
    # is 2.534 * 0.98834^65 = 1.182 < 2.534 / 2: the first evaluation that sees it is step 75
    assert step == 75
    assert "from 2.534 (steps 1-10) to 1.182 (step 75)" in msg and "held-out goal stayed at 0.006" in msg
    assert "training goal 0.000 at steps 1-10" in msg and "train.lr" in msg and "kl_coef" in msg


def test_collapse_finished_before_the_first_evaluation_is_caught():
    rows, _ = addition_like(steps=60, h_end=0.08)
    rows += [{**rows[-1], "step": s} for s in range(61, 101)]  # flat at the bottom from step 60
    msgs = [m for _, m in replay(Watch(), rows, {100: 0.0}) if "entropy" in m]
    assert len(msgs) == 1 and "(step 100)" in msgs[0]


def test_a_step_0_evaluation_is_the_start_goal():
    rows, evals = addition_like()
    msgs = [m for _, m in replay(Watch(), rows, evals, step0_goal=0.004) if "entropy" in m]
    assert "held-out goal 0.004 at steps 1-10" in msgs[0]
    # the goal rose well beyond flat_goal since the start: a policy that learns while it sharpens
    rows, evals = addition_like()
    evals = {s: 0.3 + s / 1000 for s in evals}
    assert [m for _, m in replay(Watch(), rows, evals, step0_goal=0.0) if "entropy" in m] == []


def test_sort_like_run_whose_goal_rises_gives_no_collapse_warning():
    """README's sort run: H 2.61 -> 0.96 by step 100 while eval/goal rises 0 -> 0.067 -> 0.56 -> 0.99."""
    rows, _ = addition_like(steps=500, h0=2.61, h_end=0.05)
    for r in rows:
        r["train/goal"] = min(1.0, r["step"] / 500)
    evals = {100: 0.067, 200: 0.3, 300: 0.564, 400: 0.9, 500: 0.991}
    assert [m for _, m in replay(Watch(), rows, evals) if "entropy" in m] == []


# --- where the agreeing groups agree ------------------------------------------------------------


def test_agreement_breakdown_by_hand():
    rewards = torch.tensor([[0, 0, 0], [1, 1, 1], [0.05, 0.05, 0.05], [1, 0, 0], [0.5, 0.5, 0.5], [1, 1, 1]])
    hits = torch.tensor([[0, 0, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
    out = agreement_breakdown(rewards, hits)
    # zero: row 0; solved: row 1; partial: rows 2, 4 and 5 (reward 1 but one response misses the goal)
    assert out["train/agree_zero_frac"] == 1 / 6 and out["train/agree_solved_frac"] == 1 / 6
    assert out["train/agree_partial_frac"] == 3 / 6
    assert abs(out["train/agree_partial_reward"] - (0.05 + 0.5 + 1) / 3) < 1e-7  # 0.05 is a float32 reward
    none = agreement_breakdown(torch.tensor([[0.0, 1.0]]), torch.tensor([[0, 1]]))
    assert none == {"train/agree_zero_frac": 0.0, "train/agree_solved_frac": 0.0, "train/agree_partial_frac": 0.0}


def test_response_concentration():
    assert response_concentration(["111", "111", "12", "111"]) == {"train/top_response": "111",
                                                                   "train/top_response_frac": 0.75}
    assert response_concentration([]) == {}


def agreeing_row(zero=0.0, solved=0.0, partial=0.0, partial_reward=None, **extra):
    r = {**row(zero + solved + partial, reward=0.0 if zero == 1 else 0.3), "train/agree_zero_frac": zero,
         "train/agree_solved_frac": solved, "train/agree_partial_frac": partial, **extra}
    if partial_reward is not None:
        r["train/agree_partial_reward"] = partial_reward
    return r


def first_warning(w, r, n=2):
    msgs = []
    for s in range(1, n + 1):
        msgs += w.after_step(s, r)
    return msgs


def test_groups_agreeing_at_zero_full_and_partial_reward_get_different_warnings():
    zero = first_warning(Watch(window=2), agreeing_row(zero=0.9))
    assert len(zero) == 1 and "at reward 0 (every sample failed)" in zero[0]
    assert "samples_per_prompt" in zero[0] and "dynamic_sampling" in zero[0]
    solved = first_warning(Watch(window=2), agreeing_row(solved=0.85, zero=0.05))
    assert "fully solved" in solved[0] and "too easy" in solved[0] and "samples_per_prompt" not in solved[0]
    # mostly solved, but a third stuck at one partial reward (a digit the policy stopped writing): both said
    mixed = first_warning(Watch(window=2), agreeing_row(solved=0.55, partial=0.35, partial_reward=0.8))
    assert "fully solved" in mixed[0] and "35% of groups agree at the same partial reward 0.8" in mixed[0]
    assert "entropy_coef" in mixed[0] and "rollouts.jsonl" in mixed[0]
    assert "partial reward" not in solved[0]                 # 0 partial groups: the plain "too easy"
    partial = first_warning(Watch(window=2), agreeing_row(partial=0.9, partial_reward=0.05))
    assert "same partial reward 0.05 without solving the task" in partial[0]
    assert "more samples will not help" in partial[0] and "rollouts.jsonl" in partial[0] and "rlvr audit" in partial[0]
    assert "dynamic_sampling" not in partial[0]


def test_constant_answer_points_to_rollouts_and_audit():
    r = {**row(0.2), "train/goal": 0.0, "train/top_response": "111", "train/top_response_frac": 0.9}
    msgs = first_warning(Watch(window=2), r)
    assert len(msgs) == 1 and "'111'" in msgs[0] and "90%" in msgs[0]
    assert "rollouts.jsonl" in msgs[0] and "rlvr audit" in msgs[0] and "constant answer" in msgs[0]
    # a policy that solves the task may well give the same (right) answer: no warning then
    assert first_warning(Watch(window=2), {**r, "train/goal": 0.99}) == []
    # the collapse warning names the constant answer too
    rows, evals = addition_like()
    for x in rows:
        x.update({"train/top_response": "111", "train/top_response_frac": 0.2 + 0.7 * x["step"] / 300})
    msg = next(m for _, m in replay(Watch(), rows, evals) if "entropy" in m)
    assert "its most common response is '111' (36% of samples)" in msg  # step 75: 0.2 + 0.7 * (66..75) / 300
    for x in rows:
        x["train/top_response_frac"] = 0.8
    msg = next(m for _, m in replay(Watch(), rows, evals) if "entropy" in m)
    assert "it now answers '111' to 80% of its samples (a constant answer" in msg and "rlvr audit" in msg


# --------------------------------------------------------------------------- a token no sample writes

def test_missing_symbols_by_hand():
    # 3 groups of 2: the answers need 0,1,3 / 3,4 / 5,6; nobody writes "3" (the first two groups need
    # it); "5" is written once in its group; "6" is needed by 1 group of 3 and written nowhere
    answers = ["013", "34", "56"]
    responses = ["014", "01", "44", "4", "5", "55"]
    got = missing_symbols(answers, responses, G=2)
    assert got == {"train/missing_symbols": "36", "train/missing_need_frac": 1.0}
    # a symbol counts only when enough groups need it: 6 is needed by 1/3 of the groups
    assert missing_symbols(answers, responses, G=2, min_frac=0.5) == {"train/missing_symbols": "3",
                                                                      "train/missing_need_frac": 2 / 3}
    # written anywhere in the groups that need it: not missing
    assert missing_symbols(["13"], ["31", "1"], G=2) == {}
    assert missing_symbols(["1 3"], ["1", "13"], G=2) == {}        # whitespace is never counted
    assert missing_symbols([{"a": "3"}, "3"], ["", "", "3", "3"], G=2) == {}   # a non-string answer needs nothing
    assert missing_symbols([13], ["1", "11"], G=2) == {"train/missing_symbols": "3", "train/missing_need_frac": 1.0}
    # a stray sample does not bring a lost character back: 1 of 20 responses (the 5% allowed) is still
    # "missing", 2 of 20 is not
    assert missing_symbols(["3"] * 5, ["3"] + [""] * 19, G=4)["train/missing_symbols"] == "3"
    assert missing_symbols(["3"] * 5, ["3", "3"] + [""] * 18, G=4) == {}


def missing_row(step, goal, missing="3"):
    r = {**row(agree=0.3), "train/goal": goal}
    if missing:
        r.update({"train/missing_symbols": missing, "train/missing_need_frac": 0.41})
    return r


def test_the_missing_token_warning_names_it_says_since_when_and_recommends_what_the_run_lacks():
    """Steps 1-4 write every digit, "3" is missing from step 5 on while the goal sits at 0.59 from
    step 3: after `window` steps of absence the warning names "3", the step it went missing and the
    plateau's start, and recommends the next lever the run does not have."""
    def run(levers):
        w = Watch(window=3, cooldown=100, levers=levers)
        msgs = []
        for s in range(1, 9):
            msgs += w.after_step(s, missing_row(s, goal=0.3 if s < 3 else 0.59, missing="3" if s >= 5 else ""))
        return msgs

    off, on, strong = (run(exploration_levers(c, 8, 1.0)) for c in (0.0, 0.01, 0.03))
    for msgs in (off, on, strong):
        assert len(msgs) == 1
        assert msgs[0].startswith("(almost) no sample has written '3' since step 5, though 41% of the prompts need it")
        assert "the training goal has stayed near 0.59 since step 3" in msgs[0]
    assert "the run has no entropy bonus: set algorithm.entropy_coef = 0.03" in off[0] and "already" not in off[0]
    assert "algorithm.entropy_coef is 0.01 already: raise it to 0.03" in on[0] and "no entropy bonus" not in on[0]
    assert "algorithm.entropy_coef is 0.03 already" in strong[0] and "train.samples_per_prompt = 16" in strong[0]
    assert "raise it" not in strong[0]
    for msgs in (off, on, strong):                        # each lever named with the figure behind it
        assert "docs/benchmarks.md" in msgs[0] and ("0.605" in msgs[0] or "1 of 3 seeds" in msgs[0])


def test_a_token_missing_in_most_steps_is_lost_since_the_stretch_began():
    """Missing at steps 3-12 but for step 7 (4 of 5 steps in a window of 5: lost) while steps 1-2 wrote
    it: the warning dates the loss from step 3, across the one step that wrote it."""
    w = Watch(window=5, cooldown=100, levers=exploration_levers(0.01, 8, 1.0))
    msgs = []
    for s in range(1, 13):
        msgs += w.after_step(s, missing_row(s, 0.59, missing="3" if s >= 3 and s != 7 else ""))
    assert len(msgs) == 1 and "'3' since step 3," in msgs[0]


def test_a_token_that_comes_back_resets_its_count():
    w = Watch(window=3)
    seen = [w.after_step(s, missing_row(s, 0.5, missing="3" if s != 3 else "")) for s in range(1, 6)]
    assert not any(seen)                                    # missing at 1-2 and 4-5: never 3 steps in a row
    assert w.after_step(6, missing_row(6, 0.5))             # 4, 5, 6


def test_a_sort_run_whose_policy_never_writes_3_is_told_so(tmp_path, monkeypatch):
    """The real command on the sort task, with the built-in model's logit of "3" pushed down by 1e4
    (it is never sampled): the run warns that no sample writes '3', and, as it already has an entropy
    bonus, recommends a stronger one instead of the one it has."""
    from rlvr import cli
    from rlvr.models import tiny

    three = tiny_token_id("3")
    forward = tiny.TinyTransformer.forward

    def never_three(self, *a, **kw):
        logits = forward(self, *a, **kw)
        return logits.index_add(-1, torch.tensor([three]), torch.full((*logits.shape[:-1], 1), -1e4))

    monkeypatch.setattr(tiny.TinyTransformer, "forward", never_three)
    out = tmp_path / "run"
    assert cli.main(["train", str(SORT), "--out", str(out), "--model.n_embd=32", "--model.n_layer=1",
                     "--model.n_head=2", "--train.steps=12", "--train.prompts_per_step=16",
                     "--train.samples_per_prompt=4", "--eval.every=0", "--eval.pass_k=0", "--eval.prompts=10",
                     "--task.options={n = 5, heldout = 50}", "--algorithm.entropy_coef=0.01"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert all(r["train/missing_symbols"] == "3" for r in rows if "train/reward" in r)
    warnings = [r["warning"] for r in rows if "warning" in r and "no sample has written" in r["warning"]]
    assert len(warnings) == 1 and warnings[0].startswith("(almost) no sample has written '3' since step 1")
    assert "algorithm.entropy_coef is 0.01 already: raise it to 0.03" in warnings[0]


SORT = Path(__file__).resolve().parents[1] / "examples" / "sort.toml"


def tiny_token_id(char: str) -> int:
    from rlvr import build as build_mod, config as config_mod

    setup = build_mod.build(config_mod.load(SORT, ["--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2",
                                             "--task.options={n = 5, heldout = 50}"]), log=lambda *_: None)
    (tid,) = setup.tokenizer.encode(char)
    return tid
