"""rlvr fine-tunes a language model with policy-gradient reinforcement learning (GRPO and its
family) against a reward a program computes, prices the run in sampled tokens before it starts,
and tells you while it runs whether it is learning. Background: docs/background.md.

commands:
  rlvr train CONFIG.toml [--section.key=value ...] [--out DIR] [--overwrite | --resume]
                                    train; --resume continues the run in --out from its last state
  rlvr sft CONFIG.toml [--section.key=value ...] [--out DIR] [--overwrite]
                                    a supervised warm start on demonstrations ([sft]); then
                                    rlvr train CONFIG --model.init=RUN/checkpoint starts RL from it
  rlvr eval RUN_DIR [--prompts N] [--task.path=...] [--trust-run-config]
                                    reload a run's checkpoint (or best/, or its last state), score
                                    the held-out goal; a run directory is data: code other than
                                    rlvr.tasks.* that its config names runs only when you say so
  rlvr price CONFIG.toml [--json]   sampled tokens per gradient step, FLOPs, memory, wall-time lower bound
  rlvr probe CONFIG.toml [--checkpoint RUN_DIR] [--prompts N] [--samples K] [--json]
                                    which prompts are worth sampling: how many Δ are non-zero
  rlvr audit CONFIG.toml [--threshold F] [--json]
                                    does the reward pay strategies that do not solve the task?
  rlvr report RUN_DIR [RUN_DIR ...] [--out DIR]
                                    plots and one HTML page; several runs are overlaid
  rlvr lab                          the finite-policy figures, each with what produced it
  rlvr lab bandit [--lr ...]        the three-action bandit and its learning-rate exercise

Any config key can be overridden, e.g. --train.samples_per_prompt=16 --algorithm.scheme=grpo
--task.options.n=6; `rlvr train --help` lists every key with its type, default and docstring.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rlvr import config  # stdlib only; the heavy modules are imported by the command that needs them


def _split_overrides(extra: list[str]) -> list[str]:
    bad = [x for x in extra if not (x.startswith("--") and "=" in x and "." in x.split("=", 1)[0])]
    if bad:
        raise config.ConfigError(f"unrecognised argument {bad[0]!r}; config overrides look like --train.steps=100")
    return extra


def _fail(msg: str) -> int:
    print(f"rlvr: error: {msg}", file=sys.stderr)
    return 2


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from rlvr import tracking, trainer
    from rlvr.reward_pool import RewardPoolError
    from rlvr.setup_types import RunError
    from rlvr.state import StateError
    from rlvr.tasks import TaskError

    try:
        cfg = config.load(args.config, _split_overrides(extra))
        tracking.check_installed(cfg.log)  # a missing backend is named before anything is built
        out = Path(args.out) if args.out else Path("runs") / f"{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        if args.resume and not args.out:
            raise RunError("--resume needs --out RUN_DIR (the run to continue)")
        if not args.resume:  # a symbolic --out, or one --overwrite may not replace: refused before anything is built
            from rlvr.rundir import RunDir

            RunDir(out).check_out(overwrite=args.overwrite)
        _preload_allocator(cfg, args.argv, args.owns_process)
        summary = trainer.train(cfg, out, overwrite=args.overwrite, resume=args.resume)
    except (config.ConfigError, RunError, TaskError, StateError, RewardPoolError, tracking.TrackingError) as e:
        return _fail(str(e))
    print(f"run directory: {out}")
    if summary.get("interrupted"):  # stopped by SIGINT / SIGTERM after saving state: 130 / 143
        return summary["exit_code"]
    print(json.dumps({k: v for k, v in summary.items() if k != "price"}, indent=2))
    return 0


def _preload_allocator(cfg: config.Config, argv: list[str], owns_process: bool) -> None:
    """With train.host_memory = jemalloc, this command again (`python -m rlvr ARGV`) in this process's
    place, jemalloc preloaded (rlvr.hostmem.preload_env), before anything is built or written; with
    auto too where rlvr.hostmem.auto_takes_jemalloc says so, the command owns its process (`main`
    read the command line, not a caller's list) and the library is found."""
    from rlvr import hostmem
    from rlvr.setup_types import RunError

    auto = owns_process and hostmem.auto_takes_jemalloc(bool(cfg.model.path), cfg.train.device)
    try:
        env = hostmem.preload_env(cfg.train.host_memory, dict(os.environ), auto_jemalloc=auto)
    except ValueError as e:
        raise RunError(str(e)) from None
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "rlvr", *argv], env)


def cmd_sft(args: argparse.Namespace, extra: list[str]) -> int:
    from rlvr import tracking
    from rlvr.reward_pool import RewardPoolError
    from rlvr.setup_types import RunError
    from rlvr.sft import SftError, train_sft
    from rlvr.tasks import TaskError

    try:
        cfg = config.load(args.config, _split_overrides(extra))
        tracking.check_installed(cfg.log)
        out = Path(args.out) if args.out else Path("runs") / f"{Path(args.config).stem}-sft-{time.strftime('%Y%m%d-%H%M%S')}"
        summary = train_sft(cfg, out, overwrite=args.overwrite)
    except (config.ConfigError, RunError, TaskError, SftError, RewardPoolError, tracking.TrackingError) as e:
        return _fail(str(e))
    print(f"run directory: {out}")
    print(json.dumps(summary, indent=2))
    return 0


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from rlvr import hostmem
    from rlvr.build import limits as run_limits, load_run, reward_weights
    from rlvr.evaluate import evaluate
    from rlvr.machine import set_threads
    from rlvr.numerics import eval_numerics
    from rlvr.reward_pool import RewardPoolError, open_pool
    from rlvr.rundir import RunDir
    from rlvr.setup_types import RunError
    from rlvr.state import StateError
    from rlvr.tasks import TaskError, load_task
    from rlvr.trust import refuse_links_out, refuse_run_task, run_config_guard

    try:
        overrides = _split_overrides(extra)
        if args.prompts is not None and args.prompts < 1:
            raise RunError(f"--prompts {args.prompts}: must be >= 1 (the number of held-out prompts to score)")
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            raise RunError(f"{run_dir} is not a finished run: no such directory")
        refuse_links_out(run_dir, trusted=args.trust_run_config)      # before its config.toml is read
        cfg_file = run_dir / "config.toml"
        if cfg_file.is_file():  # the task is imported below: never code the run directory names
            refuse_run_task(config.load(cfg_file, overrides), cfg_file,
                            overrides=overrides, trusted=args.trust_run_config)
        cfg, model, tok = load_run(run_dir, overrides, trusted=args.trust_run_config,
                                   note=lambda msg: print(f"rlvr: note: {msg}", file=sys.stderr))
        set_threads(cfg)                        # as the run trained: its threads, its host allocator
        hostmem.set_host_memory(cfg.train.host_memory, cfg.model.gradient_checkpointing)
        with run_config_guard(cfg, cfg_file, overrides=overrides, trusted=args.trust_run_config):
            task = load_task(cfg.task.path, **cfg.task.options)
        weights = reward_weights(cfg, task)
        limits = run_limits(cfg, task, tok, model)
        numerics = eval_numerics(cfg, model, RunDir(run_dir).recorded_autocast())
        with open_pool(cfg.task, task) as pool:
            res = evaluate(model, tok, task, reward_weights=weights, limits=limits,
                           prompts=args.prompts if args.prompts is not None else cfg.eval.prompts,
                           batch_size=cfg.eval.batch_size, pass_k=cfg.eval.pass_k,
                           pass_k_prompts=cfg.eval.pass_k_prompts, temperature=cfg.sampling.temperature,
                           top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k, min_p=cfg.sampling.min_p,
                           seed=cfg.train.seed, pool=pool, autocast=numerics.context, group_by=cfg.eval.group_by)
        res["numerics"] = numerics.describe()
    except (config.ConfigError, RunError, TaskError, RewardPoolError, StateError) as e:
        return _fail(str(e))
    print(json.dumps({f"eval/{k}": v for k, v in res.items()}, indent=2))
    return 0


def cmd_price(args: argparse.Namespace, extra: list[str]) -> int:
    from rlvr.build import build
    from rlvr.machine import set_threads
    from rlvr.run_price import price_of
    from rlvr.setup_types import RunError
    from rlvr.tasks import TaskError

    try:
        cfg = config.load(args.config, _split_overrides(extra))
        _, busy = set_threads(cfg)  # the wall-time estimate is measured with the run's threads
        # under --json stdout holds the JSON alone: the build's notes go to stderr
        log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
        price = price_of(build(cfg, log=log, time_bf16=True), probe_learn=True)
    except (config.ConfigError, RunError, TaskError, ValueError) as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(price.to_dict(), indent=2))
    else:
        print("\n".join(price.lines() + ([f"warning: {busy}"] if busy else [])))
    return 0


def cmd_lab(args: argparse.Namespace, extra: list[str]) -> int:
    from rlvr import lab

    if extra:
        return _fail(f"lab: unrecognised argument {extra[0]!r}")
    if args.lab_cmd is None:
        print(lab.format_report())
        return 0
    try:  # the lab checks its arguments (ValueError naming the one that is out of range)
        res = lab.bandit_exercise(lrs=tuple(args.lr), seeds=args.seeds, group_size=args.group_size,
                                  steps=args.steps, scheme=args.scheme, rewards=tuple(args.rewards))
    except ValueError as e:
        return _fail(f"lab bandit: {e}")
    print(lab.format_exercise(res))
    return 0


def _with_overrides(command, args: argparse.Namespace, extra: list[str]) -> int:
    """Run `command(args, overrides)` (probe, audit) after checking the --section.key=value overrides."""
    try:
        overrides = _split_overrides(extra)
    except config.ConfigError as e:
        return _fail(str(e))
    return command(args, overrides)


def cmd_probe(args: argparse.Namespace, extra: list[str]) -> int:
    from rlvr import probe

    return _with_overrides(probe.command, args, extra)


def cmd_audit(args: argparse.Namespace, extra: list[str]) -> int:
    from rlvr import audit

    return _with_overrides(audit.command, args, extra)


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from rlvr import report

    if extra:
        return _fail(f"report: unrecognised argument {extra[0]!r}")
    return report.command(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvr", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)

    _add_run_commands(sub)
    _add_inspect_commands(sub)
    return p


def _add_run_commands(sub) -> None:
    """train, sft, eval and price."""
    from rlvr.config import help_text

    t = sub.add_parser("train", allow_abbrev=False, help="train a policy from a TOML config", epilog="config keys (override any as --section.key=value):\n" + help_text(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", help="TOML config file")
    t.add_argument("--out", help="run directory (default runs/<config>-<time>)")
    t.add_argument("--overwrite", action="store_true",
                   help="replace an existing run directory: only one rlvr wrote, and only the names rlvr writes "
                        "(never the current directory, one above it, the home directory or a symbolic link)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last saved state")
    t.set_defaults(func=cmd_train)

    sf = sub.add_parser("sft", allow_abbrev=False, help="a supervised warm start on demonstrations (sft.data or the "
                        "task's demonstrate()); its checkpoint starts `rlvr train`",
                        epilog="the [sft] keys and every other config key: rlvr train --help",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sf.add_argument("config", help="TOML config file (a train config; its [sft] section)")
    sf.add_argument("--out", help="run directory (default runs/<config>-sft-<time>)")
    sf.add_argument("--overwrite", action="store_true", help="replace an existing run directory (as rlvr train)")
    sf.set_defaults(func=cmd_sft)

    e = sub.add_parser("eval", allow_abbrev=False, help="reload a run's checkpoint and evaluate it on held-out prompts")
    e.add_argument("run_dir")
    e.add_argument("--prompts", type=int, default=None, help="held-out prompts (default: the run's eval.prompts)")
    e.add_argument("--trust-run-config", action="store_true",
                   help="run the code the run's config.toml names (a task file or module, files or modules in "
                        "task.options) and follow its symbolic links outside it; by default only the project's task "
                        "factories (rlvr.tasks.*) load and no link may point outside the run directory")
    e.set_defaults(func=cmd_eval)

    pr = sub.add_parser("price", allow_abbrev=False, help="price a run before it starts (sampled tokens per gradient step)")
    pr.add_argument("config")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_price)


def _add_inspect_commands(sub) -> None:
    """probe, audit, report and lab."""
    pb = sub.add_parser("probe", allow_abbrev=False, help="K samples per prompt: how many Δ are usable, which groups agree and teach nothing")
    pb.add_argument("config")
    pb.add_argument("--checkpoint", help="a run directory whose checkpoint is probed (default: the config's initial model)")
    pb.add_argument("--prompts", type=int, default=8, help="prompts to probe (N)")
    pb.add_argument("--samples", type=int, default=8, help="responses per prompt (K >= 2)")
    pb.add_argument("--scheme", nargs="*", default=[], help="Δ schemes to count besides raw and centered")
    pb.add_argument("--split", choices=["train", "heldout"], default="train", help="which prompts to probe")
    pb.add_argument("--json", action="store_true")
    pb.add_argument("--trust-run-config", action="store_true",
                    help="run code other than rlvr.tasks.* named by a run directory's config (CONFIG named config.toml or "
                         "inside a run directory, or --checkpoint's state)")
    pb.set_defaults(func=cmd_probe)

    au = sub.add_parser("audit", allow_abbrev=False, help="score strategies that do not solve the task; exit 1 if the reward pays them")
    au.add_argument("config")
    au.add_argument("--threshold", type=float, default=0.5,
                    help="flag a strategy whose mean reward reaches this fraction of a solved response's while its goal is 0")
    au.add_argument("--prompts", type=int, default=200, help="held-out prompts to score each strategy on")
    au.add_argument("--json", action="store_true")
    au.add_argument("--trust-run-config", action="store_true",
                    help="run code other than rlvr.tasks.* named by CONFIG when CONFIG is a run directory's config "
                         "(named config.toml, or inside a run directory)")
    au.set_defaults(func=cmd_audit)

    rp = sub.add_parser("report", allow_abbrev=False,
                        help="plots and one HTML page for a run (finished, running or cut off); several runs are overlaid")
    rp.add_argument("run_dir", nargs="+", help="one run directory, or several to compare")
    rp.add_argument("--out", help="directory for the PNGs and report.html (default RUN_DIR/report; for several runs "
                                  "compare-A-vs-B... beside the first)")
    rp.set_defaults(func=cmd_report)

    lab = sub.add_parser("lab", allow_abbrev=False, help="the finite-policy lab: the policy-gradient figures of docs/background.md checked exactly")
    lab_sub = lab.add_subparsers(dest="lab_cmd")
    b = lab_sub.add_parser("bandit", allow_abbrev=False, help="the three-action bandit over many RNG seeds: how often it locks onto a wrong action")
    b.add_argument("--lr", type=float, nargs="+", default=[5.0, 0.5], help="learning rates to compare")
    b.add_argument("--group-size", type=int, default=8)
    b.add_argument("--steps", type=int, default=200)
    b.add_argument("--seeds", type=int, default=200, help="number of seeds (0..N-1)")
    b.add_argument("--scheme", default="centered", help="Δ scheme (rlvr.advantages)")
    b.add_argument("--rewards", type=float, nargs="+", default=[0.0, 0.0, 1.0],
                   help="reward of each action (default 0 0 1: only action 2 pays); e.g. 0.5 0.5 1 with --scheme raw shows lock-in")
    lab.set_defaults(func=cmd_lab)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # the command as given (_preload_allocator)
    args.owns_process = argv is None                             # run as a command, not called from Python
    return args.func(args, extra)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
