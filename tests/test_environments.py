"""Environments (rlvr.environments): an episode's layout by hand on a scripted model, replayed steps and
their statuses, per-turn rewards reaching the per-token Δ, a hanging or crashing environment in the reward
workers, the guessing game and the calculator on the protocol, the tool-use card, and episodes through
`rlvr train` on the built-in model."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import pytest
import torch

from rlvr import rollout as rollout_mod, tools
from rlvr.environments import Episode, Step, check_step, episode_of, step_episode, turn_rewards
from rlvr.reward_pool import RewardPool
from rlvr.rewards import steps_of
from rlvr.sampling import StopStrings, generate
from rlvr.tasks import Task, TaskError, load_task, validate_task
from rlvr.tasks.arith import Calculator, arith_task, tool_use
from rlvr.tasks.guess import GuessGame
from test_sampling import BOS, EOS, PAD, MarkovMock
from test_tools import PieceTokenizer, table


class Counter:
    """Answers every action with "<r>9</r>" and reward k / 4 at its k-th step; counts its resets."""

    resets = 0

    def reset(self, prompt, answer):
        Counter.resets += 1
        self.k = 0

    def step(self, action):
        self.k += 1
        return Step("<r>9</r>", self.k / 4, False)


def respond(env, *, max_calls=1, max_new_tokens=12, on_end=False):
    model, tok = MarkovMock(table({3: 4, 4: 5, 8: 3})), PieceTokenizer()   # "7</c>", then "<c>7</c>" after "</r>"
    first = generate(model, [[BOS, 3]], samples_per_prompt=1, max_new_tokens=max_new_tokens, eos_id=EOS, pad_id=PAD,
                     generator=None, stop=StopStrings(["</c>"], tok.decode))
    return tools.respond_in_environment(model, tok, first, [SimpleNamespace(prompt="p", answer=1)], env,
                                        max_new_tokens=max_new_tokens, eos_id=EOS, stop=("</c>",),
                                        max_calls=max_calls, base_seed=None, first_row=0,
                                        sample_kw=dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0),
                                        autocast=contextlib.nullcontext, on_end=on_end)


def test_an_episode_inserts_observations_and_the_closing_step_scores_the_last_action():
    Counter.resets = 0
    r, stats, turns = respond(Counter, max_calls=1)
    # "7</c>" | inserted "<r>9</r>" | "<c>7</c>": the second action is stepped (closing step), nothing inserted
    assert r.response_ids.tolist() == [[4, 5, 6, 7, 8, 3, 4, 5]]
    assert r.mask.tolist() == [[1, 1, 0, 0, 0, 1, 1, 1]] and not r.truncated.any()
    assert turns == [dict(actions=["7</c>", "<c>7</c>"], observations=["<r>9</r>", None], turn_rewards=[0.25, 0.5],
                          spans=[(0, 2), (5, 8)], done=False)]
    assert (stats.calls, stats.errors) == (1, 0)                 # the closing step is no call
    assert Counter.resets == 2                                   # each step rebuilt the episode: reset, replay


def test_done_ends_the_episode_and_a_cut_last_action_is_not_stepped():
    class Win(Counter):
        def step(self, action):
            return Step(None, 1.0, True)

    r, stats, turns = respond(Win, max_calls=3)
    assert r.response_ids.tolist() == [[4, 5]] and turns[0]["done"] and turns[0]["turn_rewards"] == [1.0]
    r, stats, turns = respond(Counter, max_calls=3, max_new_tokens=7)     # the second action is cut at 7 tokens
    assert r.truncated.all() and turns[0]["spans"] == [(0, 2), (5, 7)]
    assert turns[0]["turn_rewards"] == [0.25, None] and turns[0]["observations"] == ["<r>9</r>", None]


@pytest.mark.parametrize("out, status", [(Step("x", 1, False), "ok"), (("x", None, True), "ok"), (["x", 0.5, False], "ok"),
                                         ("x", "bad_type"), ((1, 0.0, False), "bad_type"), (("x", "1", False), "bad_type"),
                                         (("x", 0.0, 1), "bad_type"), (("x", float("nan"), False), "nan")])
def test_what_a_step_returns_is_checked(out, status):
    assert check_step(out).status == status


def test_a_failing_step_has_a_status_and_ends_its_row():
    class Boom(Counter):
        def step(self, action):
            raise RuntimeError("no environment today")

    got = step_episode(Boom, "p", Episode("a", ["a"]), 1)
    assert (got.value, got.status, got.detail) == (None, "error", "RuntimeError: no environment today")
    r, stats, turns = respond(Boom)
    assert r.response_ids.tolist() == [[4, 5]] and stats.errors == 1 and "no environment today" in stats.first_error


def test_an_episode_is_text_that_keeps_its_turns():
    ep = Episode("7</c><r>9</r>", ["7</c>"], ["<r>9</r>"], [0.5], [(0, 2)], True)
    assert ep == "7</c><r>9</r>" and isinstance(ep, str) and json.dumps(ep) == '"7</c><r>9</r>"'
    back = pickle.loads(pickle.dumps(ep))
    assert (back.actions, back.observations, back.turn_rewards, back.spans, back.done) == (
        ("7</c>",), ("<r>9</r>",), (0.5,), ((0, 2),), True)
    assert episode_of(ep) is ep and episode_of("plain") is None
    assert steps_of(turn_rewards("", Episode("ab", ["a", "b"], [None, None], [None, 1.0]), 0)) == (0.0, 1.0)
    assert turn_rewards("", "plain", 0) == 0.0


def test_per_turn_rewards_reach_the_per_token_delta():
    """Two samples of one prompt: row 0 takes two actions (tokens 0-1 and 3-4) rewarded 0 then 1, row 1
    one action (tokens 0-1) rewarded 0. Return to go: row 0's first action 1, row 1's 0, centred: +-0.5;
    row 0's second action has no other sample at that turn: 0. Inserted tokens and padding: 0."""
    eps = [Episode("x", ["a", "b"], ["o", None], [0.0, 1.0], [(0, 2), (3, 5)]), Episode("y", ["a"], [None], [0.0], [(0, 2)])]
    per = [turn_rewards("", e, 0) for e in eps]
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    groups = SimpleNamespace(responses=eps, per_reward={"turns": per}, rollout=SimpleNamespace(mask=mask),
                             rewards=torch.tensor([[float(per[0]), float(per[1])]]))
    setup = SimpleNamespace(reward_weights={"turns": 1.0}, task=SimpleNamespace(environment=Counter),
                            cfg=SimpleNamespace(train=SimpleNamespace(samples_per_prompt=2),
                                                algorithm=SimpleNamespace(process_delta="return_to_go")))
    stats = {}
    process, plain = rollout_mod.process_token_delta(setup, groups, stats)
    assert process.tolist() == [[0.5, 0.5, 0, 0, 0, 0], [-0.5, -0.5, 0, 0, 0, 0]]
    assert plain.tolist() == [[0.0, 0.0]] and stats["step_mismatch_frac"] == 0.0


def test_the_guessing_game_and_the_calculator_step_as_environments():
    game = GuessGame("compact")
    game.reset("4821?", 7)
    assert game.step("5") == (">", 0.0, False) and game.step("?") == ("?", 0.0, False)
    assert game.step("9") == ("<", 0.0, False) and game.step("7") == (None, 1.0, True)
    calc = Calculator()
    calc.reset("What is 23 * 45?", 1035)
    assert calc.step("<calc>23 * 45</calc>") == ("<result>1035</result>", None, False)
    assert calc.step("It is 1035") == (None, 1.0, True)
    calc.reset("What is 23 * 45?", 1035)
    calc.step("<calc>23 * 45</calc>")
    assert calc.step("") == (None, 1.0, True)                    # ended right after the result: the result counts
    assert calc.step("1036") == (None, 0.0, True)


def test_the_tool_use_card_names_how_tool_use_is_gamed():
    task = arith_task(ops="*", digits=1, heldout=5, calculator=True)
    reward = task.rewards["tool_use"]
    card = reward.card
    assert "copied" in card.exploit and "forever" in card.exploit and "max_tool_calls" in card.exploit
    ex = task.train[0]
    hack = card.exploit_example(ex)                               # a wrong answer sent through the calculator
    assert reward(ex.prompt, hack, ex.answer) == 1.0 and not task.goal(ex.prompt, hack, ex.answer)
    forged = Episode(f"<result>{ex.answer}</result>{ex.answer}", [f"<result>{ex.answer}</result>{ex.answer}"], [None],
                     [1.0], [(0, 1)], True)                       # the policy wrote the "result" itself
    assert tool_use(ex.prompt, forged, ex.answer) == 0.0 and tool_use(ex.prompt, str(forged), ex.answer) == 0.0


def test_a_task_has_a_tool_or_an_environment_and_a_mixture_takes_none():
    task = arith_task(digits=1, heldout=5, calculator=True)
    with pytest.raises(TaskError, match="not both"):
        validate_task(Task(**{**task.__dict__, "tool": lambda p, r, a: ""}))
    with pytest.raises(TaskError, match="environment"):
        load_task("rlvr.tasks.mix:mix_task", tasks=[
            {"path": "rlvr.tasks.arith:arith_task", "options": {"digits": 1, "heldout": 5, "calculator": True},
             "reward": "correct"},
            {"path": "rlvr.tasks.arith:arith_task", "options": {"digits": 1, "heldout": 5}, "reward": "correct"}])


ENV_FILE = """
import dataclasses, os, time
from rlvr.tasks.guess import guess_task

class Broken:
    def __init__(self, kind):
        self.kind = kind

    def reset(self, prompt, answer):
        pass

    def step(self, action):
        if self.kind == "hang":
            time.sleep(60)
        os._exit(3)

def make(kind="crash"):
    return dataclasses.replace(guess_task(low=0, high=9, style="compact", heldout=5, train=20),
                               environment=lambda: Broken(kind))
"""


def test_a_hanging_or_crashing_environment_gets_a_status_in_the_workers(tmp_path):
    (tmp_path / "broken.py").write_text(ENV_FILE)
    for kind, status in (("hang", "timeout"), ("crash", "crashed")):
        with RewardPool(f"{tmp_path / 'broken.py'}:make", {"kind": kind}, workers=1, timeout_s=1.0) as pool:
            got = pool.env_steps(["1?", "2?"], [Episode("5", ["5"]), Episode("6", ["6"])], [3, 4])
            assert [s.status for s in got] == [status, status] and pool.restarts == 2


def run_train(tmp_path, task_lines: str, *extra: str) -> tuple[list[dict], str]:
    from rlvr.cli import main

    config = tmp_path / "env.toml"
    config.write_text(task_lines + '[sampling]\nmax_tool_calls = 3\ntool_on_end = true\n'
                      '[model]\nn_layer = 1\nn_embd = 32\nn_head = 2\n'
                      '[train]\nsteps = 2\nprompts_per_step = 4\nsamples_per_prompt = 4\nthreads = 1\n'
                      '[eval]\nevery = 0\nat_start = false\npass_k = 0\n[log]\nrollouts_per_step = 4\n')
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["train", str(config), "--out", str(tmp_path / "run"), *extra])
    assert rc == 0, err.getvalue()
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()], err.getvalue()


def test_episodes_through_rlvr_train_with_per_turn_rewards_in_a_worker(tmp_path):
    rows, _ = run_train(tmp_path, '[task]\npath = "rlvr.tasks.guess:guess_task"\nreward_workers = 1\n'
                                  'reward_weights = { guessed = 1.0, turns = 1.0 }\n'
                                  'options = { low = 0, high = 9, style = "compact", heldout = 20, train = 200 }\n')
    train = [r for r in rows if "train/reward" in r]
    assert len(train) == 2 and sum(r["train/tool_calls_per_response"] for r in train) > 0
    assert all(r["train/tool_errors"] == 0 and r["train/step_mismatch_frac"] == 0.0 for r in train)
    assert any(r["train/nonzero_delta_frac"] > 0 for r in train)       # the turn rewards reached the token Δ
    responses = [x for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
                 for x in json.loads(line)["responses"]]
    assert any("<" in x or ">" in x for x in responses)                # the environment's turns are there


def test_a_crashing_environment_is_counted_and_the_run_goes_on(tmp_path):
    (tmp_path / "broken.py").write_text(ENV_FILE)
    rows, _ = run_train(tmp_path, f'[task]\npath = "{tmp_path / "broken.py"}:make"\nreward = "guessed"\n'
                                  'reward_workers = 1\n', "--train.steps=1", "--train.prompts_per_step=2",
                        "--train.samples_per_prompt=2")
    step = next(r for r in rows if "train/reward" in r)
    assert step["train/tool_errors"] > 0
    warning = next(r["warning"] for r in rows if "warning" in r and "tool calls failed" in r["warning"])
    assert "environment step: crashed" in warning


GYM_FILE = '''
from rlvr.environments import GymText, episode_return, gym_examples, turn_rewards
from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Task


class SayDigit:
    """gymnasium's API in text: say the seed's digit; "again" until right, cut after 3 turns."""

    def reset(self, seed=None, options=None):
        self.target, self.turns = str(seed % 10), 0
        return f"game {seed}: say {self.target}", {}

    def step(self, action):
        self.turns += 1
        right = action.strip().endswith(self.target)
        return ("yes" if right else "again"), float(right), right, self.turns >= 3, {}


def make():
    card = RewardCard(pays_for="the turn that says the digit", ignores="the rest", exploit="none known")
    return Task(name="say-digit", train=gym_examples(SayDigit, range(10, 60)), heldout=gym_examples(SayDigit, range(10)),
                rewards={"turns": Reward("turns", turn_rewards, card)},
                goal=lambda p, r, a: episode_return(p, r, a) > 0, max_new_tokens=12, alphabet=" 0123456789:abeginmsy",
                environment=lambda: GymText(SayDigit))
'''


def test_a_gymnasium_style_text_environment_through_the_adapter(tmp_path, monkeypatch):
    (tmp_path / "say_digit.py").write_text(GYM_FILE)
    task = load_task(f"{tmp_path / 'say_digit.py'}:make")
    ex = task.heldout[3]
    assert (ex.prompt, ex.answer) == ("game 3: say 3", 3)
    got = step_episode(task.environment, ex.prompt, Episode("1 again 3", ["1", "3"]), ex.answer)
    assert (got.status, got.value) == ("ok", ["yes", 1.0, True])
    got = step_episode(task.environment, "game 4: say 4", Episode("1", ["1"]), ex.answer)     # not what seed 3 shows
    assert got.status == "error" and "not deterministic per seed" in got.detail
    rows, _ = run_train(tmp_path, f'[task]\npath = "{tmp_path / "say_digit.py"}:make"\nreward = "turns"\n'
                                  'reward_workers = 1\n', "--sampling.max_tool_calls=2")
    train = [r for r in rows if "train/reward" in r]
    assert len(train) == 2 and all(r["train/tool_errors"] == 0 for r in train)
    assert sum(r["train/tool_calls_per_response"] for r in train) > 0
