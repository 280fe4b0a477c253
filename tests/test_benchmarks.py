"""Every benchmark script starts: its module-level imports resolve (the helpers it loads from this
repository included) and it prints its usage for --help. The benchmarks themselves are too slow for
the suite (they are run by hand, see benchmarks/README.md); this catches a script left pointing at a
file that moved."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

CHILD = r"""
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # an import that does not resolve, or any other failure at start
        code = repr(e)
    out[path] = [code, len(buf.getvalue())]
print(json.dumps(out))
"""


def test_every_benchmark_prints_its_usage():
    assert len(SCRIPTS) >= 10
    proc = subprocess.run([sys.executable, "-c", CHILD, *map(str, SCRIPTS)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(got) == sorted(map(str, SCRIPTS))
    for path, (code, printed) in got.items():
        # 0: argparse's --help; 2: a script that prints its usage itself when not given a config
        assert code in (0, 2) and printed > 0, (path, code, proc.stderr[-3000:])


def test_the_real_model_benchmark_sets_its_figures_against_its_targets():
    import importlib.util
    spec = importlib.util.spec_from_file_location("real_model", ROOT / "benchmarks" / "real_model.py")
    rm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rm)
    profile = [{"phase": "sampling prefill", "x_bound": 1.9}, {"phase": "sampling decode", "x_bound": 4.1},
               {"phase": "decode products", "x_bound": 2.0}, {"phase": "optimizer", "x_bound": 1.5}]
    curves = {"rlvr": [(0.0, 0, 0.175), (121.0, 18, 0.675), (602.0, 94, 0.800)],
              "trl": [(0.0, 0, 0.175), (146.0, 5, 0.430), (622.0, 22, 0.690)]}
    got = rm.targets(profile, {"rlvr": 7.94, "trl": 30.49}, curves)
    assert got[0] == "missed step rate: TRL / rlvr = 3.84 (target >= 4)"
    assert got[1] == "held   held-out gain: 0.175 at step 0 -> 0.800 after 602 s (+62.5 points; target >= +40)"
    assert got[2] == ("held   above TRL at the last evaluation: 0.800 after 602 s against TRL's 0.690 after 622 s; "
                      "above at each of the 2 evaluations after step 0")
    assert got[3] == ("missed every phase within 2x its bound: sampling prefill 1.9x, sampling decode 4.1x, "
                      "optimizer 1.5x (over: sampling decode 4.1x)")       # decode's products alone are not a phase
    curves["rlvr"][1] = (121.0, 18, 0.400)
    got = rm.targets(profile[:1], {"rlvr": 6.61, "trl": 26.51}, curves)
    assert got[0].startswith("held   step rate: TRL / rlvr = 4.01") and got[3].startswith("held   every phase")
    assert got[2].endswith("not at every evaluation (121 s: 0.400 vs 0.430)")
    curves["rlvr"][-1] = (602.0, 94, 0.574)                                   # +39.9 points, below TRL
    got = rm.targets(profile, {"rlvr": 1.0, "trl": 4.0}, curves)
    assert got[1].startswith("missed held-out gain") and "+39.9 points" in got[1] and got[2].startswith("missed")


def test_long_responses_counts_the_scoring_positions_and_their_padding():
    """benchmarks/long_responses.py's Positions wraps rlvr.scoring.sequence_token_logprobs: every call is
    counted (rows x response width "before", each row's length bucket "after") and "before" really
    forwards every row to the full width (the same log-probs: the columns past a row's end are masked)."""
    import importlib.util

    import torch

    from rlvr import scoring
    from rlvr.models.tiny import TinyConfig, TinyTransformer

    spec = importlib.util.spec_from_file_location("long_responses", ROOT / "benchmarks" / "long_responses.py")
    lr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lr)
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab_size=11, n_layer=1, n_head=2, n_embd=16, block_size=16)).eval()
    Lp, T = 2, 6
    ids = torch.randint(3, 11, (3, Lp + T))
    am = torch.ones_like(ids)
    am[0, Lp + 2:] = 0                                                   # response lengths 2, 6, 4
    am[2, Lp + 4:] = 0
    kw = {"temperature": 1.0, "top_p": 1.0}
    want = scoring.sequence_token_logprobs(model, (ids, am, Lp), **kw)
    widths = []
    model.register_forward_pre_hook(lambda m, args: widths.append(args[0].size(1)))
    with lr.Positions(scoring, full=True) as pos:
        assert scoring.sequence_token_logprobs is not pos.real          # the wrapper is in place
        got = scoring.sequence_token_logprobs(model, (ids, am, Lp), **kw)
    assert scoring.sequence_token_logprobs is pos.real                  # and gone after
    assert (pos.computed, pos.padding) == (3 * T, 3 * T - 12)
    assert widths == [Lp + T - 1]                                       # one forward of every row to the full width
    torch.testing.assert_close(got, want)
    widths.clear()
    with lr.Positions(scoring, full=False) as pos:
        scoring.sequence_token_logprobs(model, (ids, am, Lp), buckets=True, **kw)
    assert pos.computed == 2 + 4 + 6 and pos.padding == 0               # each row its own bucket here
    assert sorted(widths) == [Lp + 2 - 1, Lp + 4 - 1, Lp + 6 - 1]


def test_the_chain_of_thought_comparison_sets_its_gain_against_the_evaluations_noise(monkeypatch):
    """long_responses.py --vs-trl's targets: 6x TRL's step rate, and a held-out gain of at least two
    standard errors of the difference between rlvr's step-0 and last evaluations at the evaluation's
    prompt count, sqrt((p0 (1 - p0) + p1 (1 - p1)) / n); the lead over TRL is said in standard errors
    too. Figures of a 200-prompt run: 0.095 -> 0.270 is 17.5 points, se = sqrt((0.095 * 0.905 +
    0.27 * 0.73) / 200) = 0.0376, so 4.7 of them against a target of 2 x 0.0376 = 7.5 points; 0.270
    against TRL's 0.210 is 6.0 points, se = sqrt((0.21 * 0.79 + 0.27 * 0.73) / 200) = 0.0426, 1.4."""
    import importlib.util
    mods = {}
    for name in ("real_model", "long_responses"):
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    rm, lr = mods["real_model"], mods["long_responses"]
    monkeypatch.setattr(rm, "TARGET_STEP_RATIO", lr.TARGET_STEP_RATIO)
    monkeypatch.setattr(rm, "GAIN_STANDARD_ERRORS", lr.GAIN_STANDARD_ERRORS)
    curves = {"rlvr": [(0.0, 0, 0.095), (339.7, 8, 0.215), (604.0, 17, 0.270)],
              "trl": [(0.0, 0, 0.095), (364.3, 3, 0.170), (646.9, 5, 0.210)]}
    got = rm.targets([{"phase": "sampling decode", "x_bound": 4.9}], {"rlvr": 38.02, "trl": 165.33}, curves, 200)
    assert got[0] == "missed step rate: TRL / rlvr = 4.35 (target >= 6)"
    assert got[1] == ("held   held-out gain: 0.095 at step 0 -> 0.270 after 604 s (+17.5 points, 4.7 standard errors "
                      "of the difference at 200 prompts; target >= +7.5, 2 standard errors)")
    assert got[2] == ("held   above TRL at the last evaluation: 0.270 after 604 s against TRL's 0.210 after 647 s "
                      "(+6.0 points, 1.4 standard errors of the difference at 200 prompts); above at each of the 2 "
                      "evaluations after step 0")
    # 0.095 -> 0.150 at 200 prompts: 5.5 points, under two standard errors (2 x 0.0326 = 6.5 points)
    curves["rlvr"][-1] = (604.0, 17, 0.150)
    assert rm.targets([], {"rlvr": 1.0, "trl": 6.0}, curves, 200)[1].startswith("missed held-out gain")
    # step times only (--minutes 0): rlvr never evaluated after step 0, so no accuracy verdict either way
    curves = {"rlvr": [(0.0, 0, 0.25)], "trl": [(0.0, 0, 0.25), (129.0, 1, 0.10)]}
    got = rm.targets([{"phase": "sampling decode", "x_bound": 4.9}], {"rlvr": 28.94, "trl": 125.21}, curves, 20)
    assert got[0] == "missed step rate: TRL / rlvr = 4.33 (target >= 6)"
    assert got[1] == "not measured: held-out gain and above TRL (no evaluation of rlvr after step 0; --minutes 0)"
    assert len(got) == 3 and got[2].startswith("missed every phase within 2x")


def test_the_comparisons_noise_is_paired_where_each_prompts_hits_are_kept(monkeypatch):
    """With each evaluation's per-prompt hits (the same prompts for both libraries, in order), the
    held-out lines count standard errors of the paired difference: sd(d) / sqrt(n) over the
    per-prompt differences d. By hand, 10 prompts: rlvr's step 0 hits 0.2 and last 0.5 with d = 1 on
    three prompts and 0 on seven, mean 0.3, sum of squared deviations 3 x 0.49 + 7 x 0.09 = 2.1,
    se = sqrt(2.1 / 9 / 10) = 0.1528: 2.0 of them (1.5 taken as independent), short of the target of
    2 x 0.1528 = 30.6 points; against TRL's 0.3, d = 1 on two prompts: mean 0.2, 2 x 0.64 + 8 x 0.04 =
    1.6, se = sqrt(1.6 / 9 / 10) = 0.1333, 1.5 of them."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("real_model", ROOT / "benchmarks" / "real_model.py")
    rm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rm)
    monkeypatch.setattr(rm, "GAIN_STANDARD_ERRORS", 2.0)
    h0 = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    h1 = [1, 1, 1, 0, 0, 0, 0, 0, 1, 1]
    t1 = [1, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert rm.paired_standard_error(h0, h1) == pytest.approx(math.sqrt(2.1 / 9 / 10))
    assert rm.paired_standard_error(t1, h1) == pytest.approx(math.sqrt(1.6 / 9 / 10))
    assert rm.paired_standard_error(h1, h1) == 0.0
    with pytest.raises(ValueError, match="same prompts"):
        rm.paired_standard_error(h0, h1[:-1])
    curves = {"rlvr": [(0.0, 0, 0.2), (600.0, 20, 0.5)], "trl": [(0.0, 0, 0.2), (610.0, 6, 0.3)],
              "hits": {"rlvr": [h0, h1], "trl": [h0, t1]}}
    got = rm.targets([], {"rlvr": 1.0, "trl": 6.0}, curves, 10)
    assert got[1] == ("missed held-out gain: 0.200 at step 0 -> 0.500 after 600 s (+30.0 points, 2.0 standard errors "
                      "of the paired difference at 10 prompts; target >= +30.6, 2 standard errors)")
    assert got[2].startswith("held   above TRL at the last evaluation: 0.500 after 600 s against TRL's 0.300 after "
                             "610 s (+20.0 points, 1.5 standard errors of the paired difference at 10 prompts)")
    curves["hits"]["rlvr"][-1] = h0                                # no prompt changed: no gain, whatever the noise
    curves["rlvr"][-1] = (600.0, 20, 0.2)
    assert rm.targets([], {"rlvr": 1.0, "trl": 6.0}, curves, 10)[1].startswith("missed held-out gain")
    curves["hits"]["rlvr"][-1], curves["rlvr"][-1] = h1, (600.0, 20, 0.5)
    del curves["hits"]                                             # the same figures taken as independent
    assert "1.5 standard errors of the difference at 10 prompts" in rm.targets([], {"rlvr": 1.0, "trl": 6.0}, curves, 10)[1]


def test_the_real_model_comparison_trains_both_libraries_at_its_seed(monkeypatch, tmp_path):
    """real_model.py --seed (SEED): rlvr's train.seed and TRL's seed; the task's split stays its own."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("real_model", ROOT / "benchmarks" / "real_model.py")
    rm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rm)
    assert rm.rlvr_config(tmp_path, 1, 10, 1).train.seed == 0
    monkeypatch.setattr(rm, "SEED", 3)
    cfg = rm.rlvr_config(tmp_path, 1, 10, 1)
    assert cfg.train.seed == 3 and cfg.task.options["seed"] == rm.TASK_OPTIONS["seed"] == 0
    made = []
    monkeypatch.setattr(rm, "TrlRun", lambda *a, **kw: made.append(kw.get("seed")) or SimpleNamespace(
        run=lambda *a, **kw: [], tokens=[], rewards=[], agree=[]))
    monkeypatch.setattr(rm, "RlvrRun", lambda *a, **kw: SimpleNamespace(step=lambda: 1.0, hits=lambda n: [1, 0], tokens=[],
                                                                      rewards=[], agree=[]))
    rm.accuracy_curves(tmp_path, SimpleNamespace(minutes=0.0, eval_every=1.0, curve_steps=0, eval_prompts=2, threads=1,
                                                 numerics="fp32", compile="off", host_memory="keep"), None)
    assert made == [3]


def test_trls_curve_takes_no_step_when_its_budget_is_zero(monkeypatch, tmp_path):
    """TrlRun.run with no seconds to spend evaluates step 0 and never calls trainer.train() (TRL checks
    its budget after a step, so it would take one that rlvr's curve at ``--minutes 0`` does not);
    with a budget it trains. GRPOTrainer is a stand-in (TRL is not a test dependency): this checks
    the harness; the tokenizer is a tiny one saved to the model directory."""
    from hf_models import make_model_dir
    rm = _real_model()
    make_model_dir(tmp_path, chat=True, weights=False)
    trained = []
    _stand_in_trl(monkeypatch, [], trained)
    setup = SimpleNamespace(task=SimpleNamespace(train=[SimpleNamespace(prompt="1 + 1?", answer="2")]))
    evals = []
    run = rm.TrlRun(tmp_path, setup, 10, 1)
    assert run.run(0.0, [0.0], lambda *x: evals.append(x)) == []
    assert evals == [(0.0, 0, "model")] and trained == []
    assert run.run(60.0, [0.0], lambda *x: evals.append(x)) == [] and trained == [True]


def test_the_comparisons_kl_coefficient_reaches_both_libraries(monkeypatch, tmp_path):
    """long_responses.py --vs-trl --kl-coef 0.05 passes it to real_model.py, whose KL_COEF is rlvr's
    algorithm.kl_coef and TRL's beta (GRPOTrainer a stand-in, as above); 0 by default, below 0 refused."""
    from hf_models import make_model_dir
    rm = _real_model()
    lr = _long_responses_over(monkeypatch, rm)
    passed = []
    monkeypatch.setattr(rm, "main", lambda argv: passed.append(argv) or 0)
    assert lr.main(["--vs-trl", "--kl-coef", "0.05"]) == 0 and lr.main(["--vs-trl"]) == 0
    assert passed[0][passed[0].index("--kl-coef") + 1] == "0.05" and "--kl-coef" not in passed[1]

    rm = _real_model()
    assert rm.rlvr_config(tmp_path, 1, 10, 1).algorithm.kl_coef == 0.0
    made = []
    monkeypatch.setattr(rm, "model_dir", lambda: tmp_path)
    monkeypatch.setattr(rm, "set_host_memory", lambda how: "")
    monkeypatch.setattr(rm, "rlvr_by_steps", lambda mdir, a, marks: made.append(
        rm.rlvr_config(mdir, 1, 10, 1).algorithm.kl_coef) or {"train": {}})
    assert rm.main(["--kl-coef", "0.05", "--rlvr-steps", "1", "--threads", "1"]) == 0 and made == [0.05]
    configs = []
    _stand_in_trl(monkeypatch, configs, [])
    make_model_dir(tmp_path, chat=True, weights=False)
    setup = SimpleNamespace(task=SimpleNamespace(train=[SimpleNamespace(prompt="1 + 1?", answer="2")]))
    rm.TrlRun(tmp_path, setup, 10, 1).run(0.0, [], lambda *x: None)
    assert configs[0]["beta"] == 0.05
    with pytest.raises(SystemExit):
        rm.main(["--kl-coef", "-1", "--rlvr-steps", "1"])


def _stand_in_trl(monkeypatch, configs: list, trained: list) -> None:
    """TRL's GRPOConfig and GRPOTrainer as stand-ins (TRL is not a test dependency): each config's
    keywords go to `configs` (the config is that dict), each trainer.train() call to `trained`."""
    import types

    class Trainer:
        def __init__(self, **kw):
            self.model = "model"

        def remove_callback(self, cb):
            pass

        def train(self):
            trained.append(True)

    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(GRPOConfig=lambda **kw: configs.append(kw) or kw,
                                                                  GRPOTrainer=Trainer))


def _long_responses_over(monkeypatch, rm):
    """benchmarks/long_responses.py loaded so that the real_model it imports is `rm` (this test's own
    module, its globals the test's to set)."""
    monkeypatch.setitem(sys.modules, "real_model", rm)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("long_responses", ROOT / "benchmarks" / "long_responses.py")
    lr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lr)
    return lr


def _real_model():
    import importlib.util
    spec = importlib.util.spec_from_file_location("real_model", ROOT / "benchmarks" / "real_model.py")
    rm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rm)
    return rm


def test_the_comparisons_targets_pool_several_runs_with_the_larger_of_two_errors(monkeypatch):
    """--pool: the mean gain and lead over runs, judged against the larger of the evaluations' error
    sqrt(sum se^2) / runs and the runs' spread sd / sqrt(runs). By hand, 10 prompts, two runs with the
    same step 0 (0.2). Run 1 (the paired test's figures above): gain +0.3 (se sqrt(2.1 / 90)), lead
    over TRL's 0.3 +0.2 (se sqrt(1.6 / 90)). Run 2: 0.3 after training (one prompt more), TRL 0.4 (one
    prompt more than rlvr): gain +0.1 with se sqrt(0.9 / 90) = 0.1 (d = 1 once: 0.81 + 9 x 0.01), lead
    -0.1, se 0.1. Mean gain +0.2: evaluations sqrt(3 / 90) / 2 = 0.0913, spread sd(0.3, 0.1) / sqrt 2 =
    0.1, so 2.0 standard errors: held at a target of 2. Mean lead +0.05: evaluations sqrt(2.5 / 90) / 2
    = 0.0833, spread sd(0.2, -0.1) / sqrt 2 = 0.15: 0.3 of them, above zero. Step ratios 3 and 5:
    median 4, short of 6."""
    rm = _real_model()
    monkeypatch.setattr(rm, "GAIN_STANDARD_ERRORS", 2.0)
    monkeypatch.setattr(rm, "TARGET_STEP_RATIO", 6.0)
    h0 = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]

    def run(seed, h1, t1, trl_s):
        acc = sum(h1) / 10
        return {"seed": seed, "step_s": {"rlvr": 1.0, "trl": trl_s},
                "curves": {"rlvr": [(0.0, 0, 0.2), (600.0, 20, acc)], "trl": [(0.0, 0, 0.2), (610.0, 6, sum(t1) / 10)],
                           "hits": {"rlvr": [h0, h1], "trl": [h0, t1]}}}

    runs = [run(0, [1, 1, 1, 0, 0, 0, 0, 0, 1, 1], [1, 0, 0, 0, 0, 0, 0, 0, 1, 1], 3.0),
            run(1, [1, 0, 0, 0, 0, 0, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0, 1, 1], 5.0)]
    got = rm.pooled_targets(runs)
    assert got[0] == ("run 1 (seed 0): step ratio 3.00; rlvr 0.200 -> 0.500 after 20 steps (+30.0 points, 2.0 paired SE); "
                      "TRL 0.300 after 6 steps (rlvr +20.0 points, 1.5 paired SE)")
    assert got[1].startswith("run 2 (seed 1): step ratio 5.00; rlvr 0.200 -> 0.300 after 20 steps (+10.0 points, 1.0 paired SE); "
                             "TRL 0.400 after 6 steps (rlvr -10.0 points, -1.0 paired SE)")
    assert got[2] == "missed step rate over 2 runs: median TRL / rlvr = 4.00 (target >= 6)"
    assert got[3] == ("held   held-out gain over 2 runs: +20.0 points on average (standard error 9.1 from the evaluations, "
                      "10.0 from the runs' spread: 2.0 of the larger; target >= 2 of them)")
    assert got[4] == ("held   above TRL at the last evaluation over 2 runs: +5.0 points on average (standard error 8.3 "
                      "from the evaluations, 15.0 from the runs' spread: 0.3 of the larger)")
    runs[1]["curves"]["hits"]["rlvr"][-1] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]     # run 2 gains nothing: +0.15 < 2 x 0.15
    assert rm.pooled_targets(runs)[3].startswith("missed held-out gain over 2 runs: +15.0 points")
    del runs[0]["curves"]["hits"]
    with pytest.raises(ValueError, match="run 1: no per-prompt hits"):
        rm.pooled_targets(runs)


def test_the_comparison_reports_each_librarys_training_reward_and_agreeing_groups(monkeypatch):
    """RlvrRun.step keeps each step's mean reward and its share of groups whose G rewards are all equal
    (no Δ there): 6 of 12 rewards are 1, and 2 of the 4 groups agree. training_signal prints both by
    halves of the run (by hand: 0.1 | 0.2, 0.3 -> 0.250)."""
    import torch

    import rlvr.learn
    import rlvr.rollout

    rm = _real_model()
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])   # (P, G)
    batch = SimpleNamespace(groups=SimpleNamespace(rewards=rewards, rollout=SimpleNamespace(mask=torch.ones(12, 5))))
    monkeypatch.setattr(rlvr.rollout, "rollout", lambda *a, **kw: batch)
    monkeypatch.setattr(rlvr.learn, "learn", lambda *a, **kw: None)
    run = rm.RlvrRun.__new__(rm.RlvrRun)
    run.state = SimpleNamespace(setup=None, policy=None, reference=None, draw=None, version=0, sample_gen=None, learner=None)
    run.tokens, run.rewards, run.agree = [], [], []
    run.step()
    assert run.rewards == [0.5] and run.agree == [0.5] and run.tokens == [60]
    lines = rm.training_signal({"rlvr": {"reward": [0.1, 0.2, 0.3], "agree": [0.5, 0.25, 0.75]},
                                "trl": {"reward": [], "agree": []}})
    assert lines == ["rlvr: 3 steps, mean training reward 0.100 over steps 1-1 -> 0.250 over steps 2-3; "
                     "groups whose rewards all agree: 0.50 of them a step"]


def test_rlvr_alone_is_evaluated_after_the_step_counts_asked(monkeypatch, tmp_path):
    """--rlvr-steps 0,2,3: one run of 3 steps, held-out hits at step 0 and after steps 2 and 3 (not 1),
    each step's seconds and training figures kept."""
    rm = _real_model()
    calls = []

    class Fake:
        def __init__(self, mdir, steps, prompts, threads, numerics, compile_layers):
            calls.append(("new", steps))
            self.rewards, self.agree = [], []

        def step(self):
            calls.append(("step",))
            self.rewards.append(0.1 * len(self.rewards))
            self.agree.append(0.5)
            return 2.0

        def hits(self, n):
            calls.append(("eval", len(self.rewards)))
            return [1] * len(self.rewards) + [0] * (n - len(self.rewards))

    monkeypatch.setattr(rm, "RlvrRun", Fake)
    a = SimpleNamespace(eval_prompts=4, threads=1, numerics="fp32", compile="off")
    got = rm.rlvr_by_steps(tmp_path, a, [0, 2, 3])
    assert calls == [("new", 3), ("eval", 0), ("step",), ("step",), ("eval", 2), ("step",), ("eval", 3)]
    assert [(n, acc) for n, acc, _ in got["evals"]] == [(0, 0.0), (2, 0.5), (3, 0.75)]
    assert got["step_s"] == [2.0, 2.0, 2.0] and got["train"]["rlvr"]["reward"] == pytest.approx([0.0, 0.1, 0.2])


def test_the_comparisons_step_counts_and_pooled_files_are_checked_before_any_run(tmp_path, capsys):
    """--rlvr-steps takes sorted step counts and refuses others; --pool names a file it cannot use
    and returns 2 without a traceback."""
    import argparse

    rm = _real_model()
    assert rm.step_counts("9,3,6,3") == [3, 6, 9]
    for bad in ("3,x", "", "-1,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            rm.step_counts(bad)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"curves": {"rlvr": [], "trl": []}, "step_s": {"rlvr": 1.0, "trl": 2.0}}))
    assert rm.main(["--pool", str(old)]) == 2
    assert "no per-prompt hits" in capsys.readouterr().err
    assert rm.main(["--pool", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_the_comparison_under_jemalloc_runs_its_own_command_again_with_it_preloaded(monkeypatch):
    """real_model.py --host-memory jemalloc: the interpreter's own command line again, jemalloc first in
    LD_PRELOAD and JEMALLOC_CONF as MALLOC_CONF unless the caller set one; not again once preloaded."""
    rm = _real_model()
    execs = []
    monkeypatch.setattr(rm.hostmem, "allocator_library", lambda: "/opt/lib/libjemalloc.so.2")
    monkeypatch.setattr(rm.hostmem.platform, "system", lambda: "Linux")
    monkeypatch.setattr(rm.os, "execve", lambda exe, argv, env: execs.append((exe, argv, env)))
    monkeypatch.setattr(rm.sys, "orig_argv", ["python3", "-u", "benchmarks/long_responses.py", "--vs-trl",
                                              "--host-memory", "jemalloc"])
    for var in ("MALLOC_CONF", rm.hostmem.PRELOADED):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    rm.rerun_with_jemalloc()
    (exe, argv, env), = execs
    assert exe == sys.executable and argv == [sys.executable, "-u", "benchmarks/long_responses.py", "--vs-trl",
                                              "--host-memory", "jemalloc"]
    assert env["LD_PRELOAD"] == "/opt/lib/libjemalloc.so.2:/opt/other.so"
    assert env["MALLOC_CONF"] == rm.JEMALLOC_CONF == "dirty_decay_ms:-1,muzzy_decay_ms:-1"
    assert env[rm.hostmem.PRELOADED] == "/opt/lib/libjemalloc.so.2"
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")                   # the caller's own setting stays
    rm.rerun_with_jemalloc()
    assert execs[1][2]["MALLOC_CONF"] == "narenas:1"
    monkeypatch.setenv(rm.hostmem.PRELOADED, "/opt/lib/libjemalloc.so.2")   # the process it started: no loop
    rm.rerun_with_jemalloc()
    assert len(execs) == 2


def test_long_responses_passes_its_host_memory_to_the_comparison(monkeypatch):
    """long_responses.py --vs-trl --host-memory jemalloc reaches real_model.py's --host-memory."""
    rm = _real_model()
    lr = _long_responses_over(monkeypatch, rm)
    got = []
    monkeypatch.setattr(rm, "main", lambda argv: got.append(argv) or 0)
    assert lr.main(["--vs-trl", "--host-memory", "jemalloc"]) == 0
    argv, = got
    assert argv[argv.index("--host-memory") + 1] == "jemalloc"


def test_each_library_runs_its_blocks_and_curve_in_a_process_of_its_own_under_its_allocator(monkeypatch, tmp_path):
    """--host-memory each: every block of step times and each curve is this command again with --part
    part:lib:FILE; rlvr's process has jemalloc preloaded, TRL's has it taken out of LD_PRELOAD (the
    rest kept); what each child wrote comes back, gathered as the in-process code gathers it."""
    rm = _real_model()
    monkeypatch.setattr(rm.hostmem, "allocator_library", lambda: "/opt/lib/libjemalloc.so.2")
    monkeypatch.setattr(rm.hostmem.platform, "system", lambda: "Linux")
    monkeypatch.setattr(rm.sys, "orig_argv", ["python3", "benchmarks/long_responses.py", "--vs-trl",
                                              "--host-memory", "each"])
    monkeypatch.setenv(rm.hostmem.PRELOADED, "/opt/lib/libjemalloc.so.2")    # the parent runs under rlvr's
    monkeypatch.setenv("LD_PRELOAD", "/opt/lib/libjemalloc.so.2:/opt/other.so")
    runs = []

    def child(cmd, env, check):
        part, lib, path = cmd[cmd.index("--part") + 1].split(":", 2)
        runs.append((cmd[:-2], part, lib, env["LD_PRELOAD"], env.get(rm.hostmem.PRELOADED)))
        n = {"rlvr": 3, "trl": 1}[lib]
        got = ({"times": [10.0 / n] * 2, "tokens": [100.0, 200.0]} if part == "block" else
               {"points": [[0.0, 0, 0.1], [60.0, n, 0.2]], "hits": [[0, 1], [1, 1]], "step_s": [60.0 / n] * n,
                "train": {"reward": [0.5] * n, "agree": [0.0] * n}})
        Path(path).write_text(json.dumps(got))

    monkeypatch.setattr(rm.subprocess, "run", child)
    a = SimpleNamespace(host_memory="each", warmup=0, blocks=1, block_steps=2)
    st = rm.step_times(tmp_path, a, None)
    assert [r[1:3] for r in runs] == [("block", "trl"), ("block", "rlvr")]            # TRL first in round 0
    assert runs[0][0] == [sys.executable, "benchmarks/long_responses.py", "--vs-trl", "--host-memory", "each"]
    assert runs[0][3:] == ("/opt/other.so", None)                                     # TRL: glibc
    assert runs[1][3:] == ("/opt/lib/libjemalloc.so.2:/opt/other.so", "/opt/lib/libjemalloc.so.2")
    assert (st["rlvr"], st["trl"]) == (pytest.approx(10 / 3), 10.0)
    assert st["tokens_per_s"]["trl"] == pytest.approx(300 / 20)
    runs.clear()
    curves = rm.accuracy_curves(tmp_path, a, None)
    assert [r[1:3] for r in runs] == [("curve", "rlvr"), ("curve", "trl")]
    assert curves["rlvr"] == [[0.0, 0, 0.1], [60.0, 3, 0.2]] and curves["trl"][-1] == [60.0, 1, 0.2]
    assert curves["hits"]["trl"] == [[0, 1], [1, 1]] and curves["step_s"]["rlvr"] == [20.0] * 3
    assert curves["train"]["trl"] == {"reward": [0.5], "agree": [0.0]}


def test_a_child_part_runs_what_it_names_and_writes_it(monkeypatch, tmp_path):
    """--part part:lib:FILE (run_part): one block or one curve of that library, its JSON in FILE,
    under that library's allocator (ALLOCATORS)."""
    rm = _real_model()
    monkeypatch.setattr(rm, "model_dir", lambda: tmp_path)
    monkeypatch.setattr(rm, "RlvrRun", lambda *a, **kw: SimpleNamespace(setup="setup"))
    monkeypatch.setattr(rm, "set_host_memory", lambda mode: f"host memory: {mode}")
    monkeypatch.setattr(rm, "block", lambda lib, mdir, a, setup: {"times": [1.0], "tokens": [], "lib": lib,
                                                                  "setup": setup})
    monkeypatch.setattr(rm, "trl_curve", lambda mdir, a, setup: {"points": [], "setup": setup})
    a = SimpleNamespace(eval_prompts=2, threads=1, numerics="fp32")
    assert rm.run_part(f"block:rlvr:{tmp_path / 'b.json'}", a) == 0
    assert json.loads((tmp_path / "b.json").read_text())["lib"] == "rlvr"
    assert rm.run_part(f"curve:trl:{tmp_path / 'c.json'}", a) == 0
    assert json.loads((tmp_path / "c.json").read_text()) == {"points": [], "setup": "setup"}
    assert rm.ALLOCATORS == {"rlvr": "jemalloc", "trl": "keep"}
