"""`rlvr probe`: which prompts are worth sampling, and how many Δ are usable (docs/background.md, section 5).

    rlvr probe CONFIG.toml [--checkpoint RUN_DIR] [--prompts N] [--samples K] [--scheme S ...]
                           [--split train|heldout] [--json] [--section.key=value ...]

Sample K responses for each of N prompts from the policy (the config's initial model, or a run's
checkpoint), score them with the configured reward, and for every group (one prompt, K rewards)
count the responses that carry a non-zero Δ under `raw`, `centered` and any scheme asked for.

With a 0/1 reward, `raw` leaves every wrong response at Δ = 0: the non-zero count is the number
of correct responses. `centered` gives the wrong ones a negative push, so in a mixed group all K
carry a gradient. A group whose K rewards are exactly equal (all solved, all failed, or all at the
same partial score) gets Δ = 0 under every baseline scheme: a group that agrees teaches nothing,
and the prompt is not worth sampling at this policy (too easy, or too hard).

Text mode prints, under each group's line, the answer and the K sampled responses with their
rewards (`--json` gives the same and more, for scripts).

Split in two:
  * `probe_counts` / `summarize`: pure functions of an (N, K) reward matrix (and optionally the
    (N, K) goal hits). No model, no config.
  * `run_probe` / `command`: load the config (and checkpoint), sample, score, print.

Which prompts: `train` draws N prompts with `random.Random(train.seed).sample`, as the trainer
draws its first batch (so with N <= train.prompts_per_step they are the first N prompts of step
1); `heldout` takes the first N held-out prompts, as `rlvr eval` does. Sampling uses a
`torch.Generator` seeded with `train.seed`, at `sampling.temperature` / `sampling.top_p`, so a
probe is reproducible (same device and thread count), under the numerics training samples with
(model.autocast as resolved at build; for a checkpoint, the decision its run recorded, as `rlvr eval`). `algorithm.top_k` is not applied: the probe
counts what each scheme does to the rewards themselves.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from rlvr import advantages, config, hostmem

DEFAULT_SCHEMES = ("raw", "centered")
"""Always counted; `--scheme` adds to these."""

USABLE, ALL_SOLVED, ALL_FAILED, ALL_EQUAL = "usable", "all_solved", "all_failed", "all_equal"
VERDICT_TEXT = {
    USABLE: "usable: worth sampling",
    ALL_SOLVED: "teaches nothing: all solved (too easy)",
    ALL_FAILED: "teaches nothing: all failed (too hard)",
    ALL_EQUAL: "teaches nothing: every reward equal",
}


class ProbeError(ValueError):
    """Bad probe input (K < 2, N < 1, an unknown scheme, too many prompts), with the reason."""


def usable_schemes() -> list[str]:
    """Schemes a probe can count: every key of `advantages.SCHEMES` except `baseline`."""
    return [s for s in advantages.SCHEMES if s != "baseline"]


def check_schemes(extra: Sequence[str]) -> list[str]:
    """`raw`, `centered`, then the extra schemes in order, deduplicated; ProbeError on a bad name.

    `grpo` and `rloo` are read as `normalized` and `loo`, as in the config."""
    out = list(DEFAULT_SCHEMES)
    for s in extra:
        s = config.ALIASES["algorithm.scheme"].get(s, s)  # grpo, rloo: the names users know
        if s == "baseline":
            raise ProbeError("--scheme baseline needs a per-prompt B(S) from the caller, which a probe does not have; "
                             f"known schemes: {', '.join(usable_schemes())}")
        if s not in advantages.SCHEMES:
            raise ProbeError(f"--scheme: unknown scheme {s!r}; known schemes: {', '.join(usable_schemes())}")
        if s not in out:
            out.append(s)
    return out


def check_sizes(prompts: int, samples: int) -> None:
    """ProbeError unless N >= 1 and K >= 2."""
    if samples < 2:
        raise ProbeError(f"--samples must be >= 2, got {samples}: a group of one response has no baseline "
                         "(its centered Δ is always 0), so it cannot show what the group teaches")
    if prompts < 1:
        raise ProbeError(f"--prompts must be >= 1, got {prompts}")


@dataclass
class GroupProbe:
    """One prompt's group of K responses: what each scheme makes of its rewards."""

    index: int
    """Row of the reward matrix (the prompt's position in the probe)."""
    rewards: list[float]
    """The K rewards, in sample order."""
    nonzero: dict[str, int]
    """{scheme: how many of the K responses carry a non-zero Δ}."""
    agrees: bool
    """Every reward exactly equal (max == min): Δ = 0 under every baseline scheme."""
    mean_reward: float
    verdict: str
    """`usable`, or why not: `all_solved`, `all_failed`, `all_equal` (see VERDICT_TEXT)."""
    goal_hits: int | None = None
    """How many of the K responses meet the task's goal; None when goals were not given."""

    @property
    def samples(self) -> int:
        return len(self.rewards)

    @property
    def worth_sampling(self) -> bool:
        return not self.agrees


def _verdict(row: Tensor, agrees: bool, hits: int | None, k: int) -> str:
    if not agrees:
        return USABLE
    value = float(row[0])
    if hits is not None:
        if hits == k:
            return ALL_SOLVED
        if hits == 0 and value == 0.0:
            return ALL_FAILED
        return ALL_EQUAL
    # no goal check given: read the reward as the built-in ones are, 0 = failed and 1 = solved
    if value == 0.0:
        return ALL_FAILED
    if value == 1.0:
        return ALL_SOLVED
    return ALL_EQUAL


def probe_counts(rewards: Tensor | Sequence[Sequence[float]], schemes: Sequence[str] = DEFAULT_SCHEMES,
                 goals: Tensor | Sequence[Sequence[bool]] | None = None) -> list[GroupProbe]:
    """(N, K) rewards -> one GroupProbe per row: non-zero Δ counts per scheme, agreement, verdict.

    `schemes` are keys of `advantages.SCHEMES` (not `baseline`). `goals`, an (N, K) bool matrix of
    goal hits, decides all-solved against all-failed for an agreeing group; without it a group
    agreeing at reward 0 is `all_failed`, at 1 `all_solved`, elsewhere `all_equal`. Agreement is
    exact equality, so equal non-integer rewards (0.3 each) agree. ValueError (ProbeError) on a
    matrix that is not 2-D, K < 2, or a bad scheme.
    """
    r = torch.as_tensor(rewards)
    if r.dim() != 2:
        raise ProbeError(f"rewards must be 2-D (N prompts, K samples), got shape {tuple(r.shape)}")
    check_sizes(r.shape[0], r.shape[1])
    if not r.is_floating_point():
        r = r.to(torch.float64)
    bad = [s for s in schemes if s == "baseline" or s not in advantages.SCHEMES]
    if bad:
        check_schemes(bad)  # raises with the known names
    g = None
    if goals is not None:
        g = torch.as_tensor(goals).bool()
        if g.shape != r.shape:
            raise ProbeError(f"goals must have the rewards' shape {tuple(r.shape)}, got {tuple(g.shape)}")
    counts = {s: (advantages.compute(r, s) != 0).sum(dim=1).tolist() for s in dict.fromkeys(schemes)}
    agree = advantages.agreeing_groups(r).tolist()
    k = r.shape[1]
    out = []
    for i in range(r.shape[0]):
        hits = int(g[i].sum()) if g is not None else None
        out.append(GroupProbe(
            index=i, rewards=r[i].tolist(), nonzero={s: int(c[i]) for s, c in counts.items()},
            agrees=bool(agree[i]), mean_reward=float(r[i].mean()), verdict=_verdict(r[i], bool(agree[i]), hits, k),
            goal_hits=hits,
        ))
    return out


@dataclass
class ProbeSummary:
    """Over all N groups of a probe."""

    prompts: int
    samples: int
    usable_groups: int
    """Groups that do not agree (their Δ is not all zero under a baseline scheme)."""
    usable_frac: float
    nonzero_frac: dict[str, float]
    """{scheme: non-zero Δ entries / (N * K)}: the share of sampled responses that carry a gradient."""
    mean_reward: float
    goal_rate: float | None
    """Goal hits / (N * K), or None when goals were not given."""
    worth_sampling: list[int] = field(default_factory=list)
    """Indices of the usable groups."""
    not_worth_sampling: dict[int, str] = field(default_factory=dict)
    """{index: verdict} of the agreeing groups."""


def summarize(groups: Sequence[GroupProbe]) -> ProbeSummary:
    """Fractions over the groups of `probe_counts` (all with the same K and schemes)."""
    if not groups:
        raise ProbeError("summarize: no groups")
    n, k = len(groups), groups[0].samples
    total = n * k
    schemes = list(groups[0].nonzero)
    usable = [g.index for g in groups if not g.agrees]
    hits = [g.goal_hits for g in groups]
    return ProbeSummary(
        prompts=n, samples=k, usable_groups=len(usable), usable_frac=len(usable) / n,
        nonzero_frac={s: sum(g.nonzero[s] for g in groups) / total for s in schemes},
        mean_reward=sum(sum(g.rewards) for g in groups) / total,
        goal_rate=None if any(h is None for h in hits) else sum(hits) / total,
        worth_sampling=usable,
        not_worth_sampling={g.index: g.verdict for g in groups if g.agrees},
    )


# ------------------------------------------------------------------------------------ sampling


@dataclass
class ProbeResult:
    """A probe of a policy: the prompts, responses, the per-group counts and the summary."""

    source: str
    """What was probed: `initial model` or `checkpoint RUN_DIR`."""
    split: str
    reward: dict[str, float]
    schemes: list[str]
    seed: int
    temperature: float
    top_p: float
    prompts: list[str]
    answers: list[str]
    responses: list[list[str]]
    groups: list[GroupProbe]
    summary: ProbeSummary
    sampled_tokens: int
    reward_failures: dict[str, int]
    notes: list[str] = field(default_factory=list)
    top_k: int = 0
    min_p: float = 0.0

    def to_dict(self) -> dict:
        return {
            "source": self.source, "split": self.split, "reward": self.reward, "schemes": self.schemes,
            "seed": self.seed, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p,
            "prompts": self.summary.prompts, "samples": self.summary.samples,
            "sampled_tokens": self.sampled_tokens, "reward_failures": self.reward_failures, "notes": self.notes,
            "groups": [{"prompt": p, "answer": a, "responses": resp, **asdict(g), "worth_sampling": g.worth_sampling}
                       for p, a, resp, g in zip(self.prompts, self.answers, self.responses, self.groups)],
            "summary": {**asdict(self.summary),
                        "not_worth_sampling": {str(i): v for i, v in self.summary.not_worth_sampling.items()}},
        }


def _pick(examples: Sequence, n: int, split: str, seed: int) -> list:
    if n > len(examples):
        raise ProbeError(f"--prompts {n} exceeds the {len(examples)} {split} prompts of the task")
    if split == "train":
        return [examples[i] for i in random.Random(seed).sample(range(len(examples)), n)]
    return list(examples[:n])


def initial_model_source(cfg) -> str:
    """Where the model a fresh run starts from comes from, in the probe's words: a checkpoint
    (model.init), a pretrained model (model.path, with a LoRA adapter initialised from train.seed when
    model.lora_r > 0), or the built-in model initialised at random from train.seed."""
    if cfg.model.init:
        return cfg.model.init
    if cfg.model.path:
        lora = f", LoRA r = {cfg.model.lora_r} initialised with seed {cfg.train.seed}" if cfg.model.lora_r else ""
        return f"the model at model.path {cfg.model.path}{lora}"
    return f"built-in model, random init with seed {cfg.train.seed}"


def _to_stderr(*args, **kwargs) -> None:
    """A log for what the probe's setup says (a model cache note, a warning): standard error."""
    print(*args, file=sys.stderr, **kwargs)


def run_probe(cfg: config.Config, *, prompts: int, samples: int, schemes: Sequence[str] = (),
              split: str = "train", checkpoint: str | Path | None = None, trusted: bool = False) -> ProbeResult:
    """Sample K responses for N prompts of `split` and count usable Δ. Raises ProbeError,
    config.ConfigError, rlvr.setup_types.RunError or TaskError on bad input, all before sampling."""
    from rlvr.build import build, limits as run_limits, load_run, reward_weights
    from rlvr.machine import set_threads
    from rlvr.numerics import eval_numerics
    from rlvr.reward_pool import open_pool
    from rlvr.groups import sample_and_score
    from rlvr.rundir import RunDir
    from rlvr.setup_types import RunError
    from rlvr.tasks import load_task

    check_sizes(prompts, samples)
    schemes = check_schemes(schemes)
    if split not in ("train", "heldout"):
        raise ProbeError(f"--split must be train or heldout, got {split!r}")
    notes: list[str] = []
    if checkpoint is not None:
        run_cfg, model, tok = load_run(Path(checkpoint), trusted=trusted, note=notes.append)
        task = load_task(cfg.task.path, **cfg.task.options)
        weights = reward_weights(cfg, task)
        if run_cfg.task != cfg.task:
            notes.append(f"the run was trained with task {run_cfg.task.path} options {run_cfg.task.options} "
                         f"reward {run_cfg.task.reward_weights or run_cfg.task.reward}; probing with the config's "
                         f"{cfg.task.path} options {cfg.task.options} reward {cfg.task.reward_weights or cfg.task.reward}")
        source = f"checkpoint {checkpoint}"
        numerics = eval_numerics(cfg, model, RunDir(Path(checkpoint)).recorded_autocast())
    else:
        setup = build(cfg, log=_to_stderr)     # the building's notes never mix into --json on stdout
        task, model, tok, weights = setup.task, setup.model, setup.tokenizer, setup.reward_weights
        source = "initial model (" + initial_model_source(cfg) + ")"
        numerics = setup.numerics
    if numerics.bf16:
        notes.append(f"sampled under {numerics.describe()}, as training samples")
    seed = cfg.train.seed
    examples = _pick(task.train if split == "train" else task.heldout, prompts, split, seed)
    why = f" ({notes[0]})" if notes else ""
    try:
        limits = run_limits(cfg, task, tok, model, examples)
    except RunError as e:
        raise ProbeError(f"{split} prompts: {e}{why}") from e

    set_threads(cfg)
    hostmem.set_host_memory(cfg.train.host_memory, cfg.model.gradient_checkpointing)  # the trainer's (rlvr.hostmem)
    model.eval()
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    K = samples
    with open_pool(cfg.task, task) as pool:
        scored = sample_and_score(model, tok, task, examples, G=K, limits=limits, weights=weights,
                                  temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                                  top_k=cfg.sampling.top_k, min_p=cfg.sampling.min_p, generator=gen,
                                  chunk_prompts=max(1, cfg.eval.batch_size // K), pool=pool,
                                  autocast=numerics.context)
    responses, rewards, goals = scored.responses, scored.rewards, scored.hits
    sampled_tokens = int(scored.rollout.mask.sum())
    if scored.goal_failures:
        notes.append(f"{scored.goal_failures} goal checks raised and count as not met")
    if scored.tools is not None:  # the run calls the task's tool (rlvr.tools)
        t = scored.tools
        notes.append(f"tool calls: {t.calls / len(responses):.2f} per response, {t.inserted_tokens} tokens inserted"
                     + (f"; {t.errors} failed, first: {t.first_error}" if t.errors else ""))
    groups = probe_counts(rewards, schemes, goals)
    failures = {s: c for s, c in scored.status_counts.items() if s not in ("ok", "goal_error") and c}
    if failures:
        notes.append(f"{sum(failures.values())} reward calls failed and scored 0: {failures}"
                     + (f"; first error: {scored.errors[0]}" if scored.errors else ""))
    return ProbeResult(
        source=source, split=split, reward=weights, schemes=schemes, seed=seed,
        temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
        min_p=cfg.sampling.min_p, prompts=[ex.prompt for ex in examples], answers=[str(ex.answer) for ex in examples],
        responses=[responses[i * K:(i + 1) * K] for i in range(len(examples))],
        groups=groups, summary=summarize(groups), sampled_tokens=sampled_tokens, reward_failures=failures,
        notes=notes,
    )


# ------------------------------------------------------------------------------------ printing


def _num(v: float) -> str:
    return "0" if v == 0 else f"{v:.3g}"


INLINE_RESPONSE_CHARS = 16
"""Responses up to this long are printed on one line per group; longer ones one per line."""
RESPONSE_CHARS = 120
"""A longer response is cut to this many characters (its repr) when printed as text."""


def _clip(text: str, limit: int = RESPONSE_CHARS) -> str:
    r = repr(text)
    return r if len(r) <= limit else r[:limit - 1] + "…"


def response_lines(answer: str, responses: Sequence[str], rewards: Sequence[float]) -> list[str]:
    """The sampled responses of one group, each with its reward, under the answer.

    Short responses (a sort, a number) share one line; longer ones get a line each, cut to
    RESPONSE_CHARS characters.
    """
    if all(len(r) <= INLINE_RESPONSE_CHARS for r in responses):
        return [f"    answer {answer!r}  responses: " + "  ".join(f"{r!r} {_num(v)}" for r, v in zip(responses, rewards))]
    return [f"    answer {_clip(answer)}"] + [f"    {_num(v):>6}  {_clip(r)}" for r, v in zip(responses, rewards)]


def format_lines(res: ProbeResult) -> list[str]:
    """The human-readable probe: a header, one line per prompt with its responses, then the summary."""
    s = res.summary
    n, k = s.prompts, s.samples
    reward = " + ".join(f"{w:g}*{name}" if w != 1 else name for name, w in res.reward.items())
    width = max(len(p) for p in res.prompts)
    lines = [f"probe: {res.source}; {n} {res.split} prompts x {k} samples (temperature {res.temperature:g}, "
             f"top_p {res.top_p:g}{f', top_k {res.top_k}' if res.top_k else ''}"
             f"{f', min_p {res.min_p:g}' if res.min_p else ''}, seed {res.seed}); reward {reward}"]
    for p, a, resp, g in zip(res.prompts, res.answers, res.responses, res.groups):
        counts = " ".join(f"{sch} {c}/{k}" for sch, c in g.nonzero.items())
        lines.append(f"[{g.index}] {p:<{width}}  rewards {' '.join(_num(v) for v in g.rewards)}  "
                     f"goal {g.goal_hits}/{k}  non-zero Δ: {counts}  {VERDICT_TEXT[g.verdict]}")
        lines.extend(response_lines(a, resp, g.rewards))
    lines.append(f"summary: usable groups {s.usable_groups}/{n} ({s.usable_frac:.0%}); non-zero Δ: "
                 + ", ".join(f"{sch} {f:.0%}" for sch, f in s.nonzero_frac.items())
                 + f"; mean reward {s.mean_reward:.3f}"
                 + (f"; goal {s.goal_rate:.3f}" if s.goal_rate is not None else ""))
    lines.append(f"cost: {res.sampled_tokens} sampled tokens for {n * k} responses (a mean of "
                 f"{res.sampled_tokens / max(1, n * k):.1f} tokens a response: sampling.expected_response_tokens "
                 f"prices a run at it); {s.usable_groups * k} of them in groups that teach something")
    worth = [f"[{i}] {res.prompts[i]}" for i in s.worth_sampling]
    lines.append("worth sampling: " + (", ".join(worth) if worth else "none"))
    if s.not_worth_sampling:
        by_verdict: dict[str, list[str]] = {}
        for i, v in s.not_worth_sampling.items():
            by_verdict.setdefault(v, []).append(f"[{i}] {res.prompts[i]}")
        reasons = {ALL_SOLVED: "all solved, too easy", ALL_FAILED: "all failed, too hard", ALL_EQUAL: "rewards all equal"}
        lines.append("not worth sampling (a group that agrees teaches nothing): "
                     + "; ".join(f"{reasons[v]}: {', '.join(ps)}" for v, ps in by_verdict.items()))
    else:
        lines.append("not worth sampling: none")
    return lines


def command(args: argparse.Namespace, overrides: list[str]) -> int:
    """`rlvr probe`: 0 on success; 2 with `rlvr: error: ...` on stderr for bad input."""
    from rlvr.reward_pool import RewardPoolError
    from rlvr.setup_types import RunError
    from rlvr.tasks import TaskError
    from rlvr.trust import is_run_config, refuse_run_task, run_config_guard

    try:
        check_sizes(args.prompts, args.samples)
        schemes = check_schemes(args.scheme or [])
        if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
            raise ProbeError(f"--checkpoint {args.checkpoint} is not a run directory")
        cfg = config.load(args.config, overrides)
        trusted = getattr(args, "trust_run_config", False)
        untrusted = is_run_config(Path(args.config))  # a run directory's config is data: its code is not run unasked
        if untrusted:
            refuse_run_task(cfg, Path(args.config), overrides=overrides, trusted=trusted)
        with run_config_guard(cfg, Path(args.config), overrides=overrides, trusted=trusted or not untrusted):
            res = run_probe(cfg, prompts=args.prompts, samples=args.samples, schemes=schemes[len(DEFAULT_SCHEMES):],
                            split=args.split, checkpoint=args.checkpoint, trusted=trusted)
    except (ProbeError, config.ConfigError, RunError, TaskError, RewardPoolError) as e:
        print(f"rlvr: error: {e}", file=sys.stderr)
        return 2
    for note in res.notes:
        print(f"rlvr: warning: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        print("\n".join(format_lines(res)))
    return 0
