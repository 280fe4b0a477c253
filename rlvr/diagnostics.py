"""Is the run learning? Figures and rules that answer it, since the GRPO loss does not.

With one update per batch the ratio is 1 and a centered Δ averages out, so the printed loss is
about 0 while the gradient is not (docs/background.md, section 6). What does show learning: the fraction of non-zero
Δ, the fraction of groups that agree (and teach nothing), the per-group pass rates, entropy, KL,
the held-out goal against the training proxy. `Watch` turns them into warnings that name a fix.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

PASS_RATE_BINS = ("0", "(0,.25]", "(.25,.5]", "(.5,.75]", "(.75,1)", "1")
"""Labels of `pass_rate_histogram`: all failed, four quarters, all solved."""


def pass_rate_histogram(hits: torch.Tensor) -> list[int]:
    """Groups per pass-rate bin (PASS_RATE_BINS) from a (P, G) 0/1 goal matrix."""
    rate = hits.float().mean(1)                                              # (P,)
    bins = [int((rate == 0).sum()), int(((rate > 0) & (rate <= 0.25)).sum()),
            int(((rate > 0.25) & (rate <= 0.5)).sum()), int(((rate > 0.5) & (rate <= 0.75)).sum()),
            int(((rate > 0.75) & (rate < 1)).sum()), int((rate == 1).sum())]
    return bins


def length_by_outcome(lengths: torch.Tensor, hits: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """Mean response length (tokens) of solved, unsolved and truncated responses; NaN-free (absent = omitted)."""
    out = {}
    for name, sel in (("solved", hits.bool()), ("unsolved", ~hits.bool()), ("truncated", truncated.bool())):
        if sel.any():
            out[name] = float(lengths[sel].float().mean())
    return out


def agreement_breakdown(rewards: torch.Tensor, hits: torch.Tensor) -> dict[str, float]:
    """Where the groups that agree agree: fractions of all P groups, from (P, G) rewards and goal hits.

    - `train/agree_zero_frac`: every reward of the group is 0 (all failed: too hard, or too sparse);
    - `train/agree_solved_frac`: every response meets the goal (too easy);
    - `train/agree_partial_frac`: the same non-zero reward without every response solving the task
      (a constant answer, or a shaping term paid alone);
    - `train/agree_partial_reward`: the mean reward of those partial groups (absent when none).
    The three fractions sum to `train/agreeing_groups_frac`.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64)                  # (P, G)
    hits = torch.as_tensor(hits).bool()                                      # (P, G)
    agree = rewards.amax(1) == rewards.amin(1)                               # (P,)
    solved = agree & hits.all(1)
    zero = agree & ~solved & (rewards[:, 0] == 0)
    partial = agree & ~solved & ~zero
    P = max(1, rewards.shape[0])
    out = {"train/agree_zero_frac": float(zero.sum()) / P, "train/agree_solved_frac": float(solved.sum()) / P,
           "train/agree_partial_frac": float(partial.sum()) / P}
    if partial.any():
        out["train/agree_partial_reward"] = float(rewards[partial, 0].mean())
    return out


def response_concentration(responses: list[str]) -> dict:
    """The most common response of a batch and its share: `train/top_response` (text, for
    metrics.jsonl and the warnings), `train/top_response_frac` (a number in (0, 1]).

    A policy that collapsed onto one answer gives the same text to most prompts; that is the
    `constant_answer` strategy `rlvr audit` scores, whatever the reward pays it.
    """
    if not responses:
        return {}
    text, count = Counter(responses).most_common(1)[0]
    return {"train/top_response": text, "train/top_response_frac": count / len(responses)}


def missing_symbols(answers: list[str], responses: list[str], G: int, min_frac: float = 0.05,
                    max_rate: float = 0.05) -> dict:
    """Characters the answers need that the responses of the groups needing them (almost) never write:
    the sign of a policy that stopped writing something (the sort task's digit it replaces by a
    neighbour). Once samples no longer draw it, every group that needs it agrees at a partial reward
    and nothing teaches it back; a stray sample that writes it now and then does not change that.

    `answers` has one entry per group (P; a number counts as its digits, an answer that is neither
    string nor number, such as a mixture's, needs nothing), `responses` G per group, row b in group
    b // G. A character counts when at least `min_frac` of the groups (and at least one) need it and
    at most `max_rate` of their responses hold it (a healthy policy writes it in nearly all of them,
    even a random one in a good share). Returns `train/missing_symbols` (those characters, sorted, as
    one string) and `train/missing_need_frac` (the fraction of groups needing at least one of them);
    {} when none."""
    P = len(answers)
    need: dict[str, list[int]] = {}
    for g, answer in enumerate(answers):
        text = str(answer) if isinstance(answer, (str, int, float)) else ""
        for c in set(text) - set(" \t\n"):
            need.setdefault(c, []).append(g)

    def write_rate(c: str, groups: list[int]) -> float:
        return sum(c in responses[g * G + j] for g in groups for j in range(G)) / (len(groups) * G)

    missing = sorted(c for c, groups in need.items() if len(groups) >= max(1, min_frac * P)
                     and write_rate(c, groups) <= max_rate)
    if not missing:
        return {}
    needing = {g for c in missing for g in need[c]}
    return {"train/missing_symbols": "".join(missing), "train/missing_need_frac": len(needing) / P}


def exploration_levers(entropy_coef: float, samples_per_prompt: int, temperature: float) -> dict:
    """What a run already does to keep every token in play, read from its configuration, for the
    warnings that recommend the next lever (`Watch.levers`)."""
    return {"entropy_coef": entropy_coef, "samples_per_prompt": samples_per_prompt, "temperature": temperature}


def next_exploration_lever(levers: dict) -> str:
    """The next setting to try when a run stops sampling something it needs, never one the run has:
    an entropy bonus of ENTROPY_STRONG first (from none, or from a weaker one), then more samples per
    prompt (each one more chance to draw the rare token while it can still be taught back). Each
    step names the measurement behind it; the tables are in docs/benchmarks.md (sort over seeds)."""
    coef, G = levers.get("entropy_coef", 0.0), levers.get("samples_per_prompt", 0)
    if coef < ENTROPY_STRONG:
        have = (f"algorithm.entropy_coef is {coef:g} already: raise it to" if coef else
                "the run has no entropy bonus: set algorithm.entropy_coef =")
        return (f"{have} {ENTROPY_STRONG:g} (examples/sort.toml, a seed that lost its 3 at 0.01 "
                f"ended at held-out 0.605; at {ENTROPY_STRONG:g} the same seed ended at 1.000, see "
                f"docs/benchmarks.md)")
    return (f"algorithm.entropy_coef is {coef:g} already: draw more samples per prompt "
            f"(train.samples_per_prompt = {2 * G if G else 16}; on the sort task at equal sampled tokens "
            f"G = 4 lost a digit on 1 of 3 seeds, G = 8 and 16 on none, see docs/benchmarks.md)")


ENTROPY_STRONG = 0.03
"""The entropy bonus `next_exploration_lever` recommends once a run's own one has not been enough."""


@dataclass
class Watch:
    """Rules over the run's history that print a warning naming the fix.

    - agreeing groups above `agree_max` (mean of the last `window` steps): the batch teaches little.
      The warning says where they agree (needs the `agreement_breakdown` fields in the row): at
      reward 0 (too hard or too sparse: easier prompts, more samples, dynamic sampling), all solved
      (too easy), or at one constant partial reward (a constant answer or the shaping term alone:
      more samples will not help; look at the rollouts and run `rlvr audit`).
    - one response makes up more than `constant_max` of the samples (mean of the last `window`
      steps, `response_concentration` fields) while the training goal is below `saturated`: the
      policy gives a constant answer, one of `rlvr audit`'s strategies.
    - entropy collapse without progress: at an evaluation, the sampling entropy (mean of the last
      `window` steps) is below (1 - `entropy_drop`) x its value at an earlier reference point, the
      held-out goal rose by less than `flat_goal` since that point and is below `saturated`. The
      reference points are the start of the run (the first `window` steps, with the goal of a
      step-0 evaluation when there is one, else the training goal of those steps) and every
      earlier evaluation. (Comparing only with the previous evaluation misses a collapse spread
      over several evaluations, or one finished before the first: each interval then falls by less
      than `entropy_drop`; on 2-digit addition the entropy fell 2.67 -> 0.83 in 225 steps, never
      by half between two evaluations 25 steps apart.)
    - training reward rose while the held-out goal fell by more than `goal_drop` since the previous
      evaluation: the proxy is being gamed, unless the training goal (the goal met by the training
      samples, mean of the last `window` steps) did not fall either. Then the samples still meet
      the goal, and what fell is the held-out evaluation: a greedy answer (eval/goal decodes
      greedily, training samples at the sampling temperature) that drifted from what sampling
      trains, or a policy that fits the training prompts only; the warning says so, and points at
      `best/`.
    Each rule warns at most once every `cooldown` steps.
    """

    agree_max: float = 0.8
    constant_max: float = 0.5
    entropy_drop: float = 0.5
    flat_goal: float = 0.01
    goal_drop: float = 0.02
    saturated: float = 0.95
    stuck_partial: float = 0.2
    """Groups agreeing at one partial reward, as a fraction of all groups, that the "too easy" warning
    names as well (the rest of the batch solved, these stuck: a token the policy no longer samples)."""
    window: int = 10
    cooldown: int = 100
    levers: dict = field(default_factory=dict)
    """What the run already does to keep tokens in play (`exploration_levers`), so that no warning
    recommends a setting the run has; set from the run's configuration, not restored from a state."""
    lost_min: float = 0.8
    """A character counts as lost when `missing_symbols` names it in at least this fraction of the last
    `window` steps."""
    _rows: list = field(default_factory=list)
    _start_goal: float | None = None
    _evals: list = field(default_factory=list)
    _last_warned: dict = field(default_factory=dict)

    def _due(self, rule: str, step: int) -> bool:
        last = self._last_warned.get(rule)
        if last is not None and step - last < self.cooldown:
            return False
        self._last_warned[rule] = step
        return True

    def _recent(self, key: str, n: int | None = None) -> float | None:
        vals = [r[key] for r in self._rows[-(n or self.window):] if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def after_step(self, step: int, row: dict) -> list[str]:
        hist = row.get("train/pass_rate_hist")
        self._rows.append({
            "step": step, "agree": row["train/agreeing_groups_frac"], "entropy": row["train/entropy"],
            "reward": row["train/reward"], "goal": row.get("train/goal"),
            "hist_solved": hist[-1] / max(1, sum(hist)) if hist else None,     # groups whose samples all meet the goal
            "zero": row.get("train/agree_zero_frac"), "agree_solved": row.get("train/agree_solved_frac"),
            "partial": row.get("train/agree_partial_frac"), "partial_reward": row.get("train/agree_partial_reward"),
            "top": row.get("train/top_response"), "top_frac": row.get("train/top_response_frac"),
            "missing": row.get("train/missing_symbols", ""),
        })
        if len(self._rows) < self.window:
            return []
        msgs = []
        recent = [r.get("missing", "") for r in self._rows[-self.window:]]
        lost = sorted(c for c in set("".join(recent)) if sum(c in m for m in recent) >= self.lost_min * self.window)
        if lost and self._due("missing", step):
            msgs.append(self._missing_message(lost, row))
        agree = self._recent("agree")
        if agree > self.agree_max and self._due("agree", step):
            msgs.append(self._agree_message(agree))
        top_frac, goal = self._recent("top_frac"), self._recent("goal")
        if (top_frac is not None and top_frac > self.constant_max and (goal is None or goal < self.saturated)
                and self._due("constant", step)):
            msgs.append(f"the policy gives the same response {self._rows[-1]['top']!r} to {top_frac:.0%} of its samples "
                        f"over the last {self.window} steps: a constant answer, one of the strategies `rlvr audit` "
                        f"scores; see rollouts.jsonl, run `rlvr audit CONFIG` to see what the reward pays it, and lower "
                        f"train.lr or add a KL term (algorithm.kl_coef)")
        return msgs

    def _missing_since(self, c: str) -> int:
        """The first step of the stretch over which `c` has been missing: the earliest step naming it
        that no full `window` of steps writing it separates from now."""
        since, gap = self._rows[-1]["step"], 0
        for r in reversed(self._rows):
            if c in r.get("missing", ""):
                since, gap = r["step"], 0
            else:
                gap += 1
                if gap >= self.window:
                    break
        return since

    def _missing_message(self, lost: list[str], row: dict) -> str:
        since = min(self._missing_since(c) for c in lost)
        what = " or ".join(repr(c) for c in lost)
        need = row.get("train/missing_need_frac")
        goal = self._plateau_since("goal")
        plateau = f"; the training goal has stayed near {goal[1]:.3g} since step {goal[0]}" if goal else ""
        return (f"(almost) no sample has written {what} since step {since}"
                f"{f', though {need:.0%} of the prompts need it' if need is not None else ''}: the policy "
                f"stopped writing it, so every group that needs it agrees and nothing teaches it back"
                f"{plateau}; {next_exploration_lever(self.levers)}")

    def _plateau_since(self, key: str, tol: float = 0.02) -> tuple[int, float] | None:
        """(first step, value) of the stretch at the end of the run over which the `window`-step mean
        of `key` stayed within `tol` of its last value; None without values."""
        vals = [(r["step"], r[key]) for r in self._rows if r.get(key) is not None]
        if len(vals) < self.window:
            return None
        means = [(vals[i][0], sum(v for _, v in vals[i - self.window + 1:i + 1]) / self.window)
                 for i in range(self.window - 1, len(vals))]
        last = means[-1][1]
        first = len(means) - 1
        while first > 0 and abs(means[first - 1][1] - last) <= tol:
            first -= 1
        return means[first][0] - self.window + 1 if first else vals[0][0], last

    def _agree_message(self, agree: float) -> str:
        head = f"{100 * agree:.0f}% of groups agree over the last {self.window} steps and teach nothing"
        zero, solved, partial = self._recent("zero"), self._recent("agree_solved"), self._recent("partial")
        if zero is None:  # no breakdown in the rows: read the goal histogram and the reward
            solved = self._recent("hist_solved") or 0.0
            zero = agree - solved if self._recent("reward") == 0 else None
            partial = None
        kinds = {k: v for k, v in (("zero", zero), ("solved", solved), ("partial", partial)) if v is not None}
        top = max(kinds, key=kinds.get) if kinds else None
        if top == "solved" and solved >= 0.5 * agree:
            stuck = ""
            if partial is not None and partial >= self.stuck_partial:
                value = self._recent("partial_reward")
                stuck = (f"; but {partial:.0%} of groups agree at the same partial reward"
                         f"{f' {value:.3g}' if value is not None else ''} without solving: the policy may have "
                         f"stopped writing something those prompts need (no sample draws it, so nothing teaches "
                         f"it back); see rollouts.jsonl; {next_exploration_lever(self.levers)}")
            return (f"{head}; most are fully solved: the training prompts are now too easy (use harder prompts, "
                    f"or stop if eval/goal has reached its target){stuck}")
        if top == "partial" and partial >= 0.5 * agree:
            value = self._recent("partial_reward")
            return (f"{head}; most agree at the same partial reward{f' {value:.3g}' if value is not None else ''} "
                    f"without solving the task: every sample earns the same (a constant answer, or the shaping "
                    f"term alone), so more samples will not help; see rollouts.jsonl, run `rlvr audit CONFIG` to see "
                    f"which non-solving strategies the reward pays, and lower train.lr or add a KL term "
                    f"(algorithm.kl_coef)")
        if top == "zero" and zero >= 0.5 * agree:
            return (f"{head}; most agree at reward 0 (every sample failed): the prompts are too hard for this policy "
                    f"or the reward too sparse: use easier prompts or a denser reward, more samples per prompt "
                    f"(train.samples_per_prompt) or algorithm.dynamic_sampling = true")
        return (f"{head}: use easier prompts, more samples per prompt (train.samples_per_prompt) or "
                f"algorithm.dynamic_sampling = true")

    def after_eval(self, step: int, goal: float) -> list[str]:
        if not self._rows:  # an evaluation before the first step: the goal at the start of the run
            self._start_goal = goal
            return []
        now = {"step": step, "goal": goal, "entropy": self._recent("entropy"), "reward": self._recent("reward"),
               "train_goal": self._recent("goal")}
        refs = []
        first = self._rows[:self.window]
        start_goal = self._start_goal
        goal_kind = "held-out goal"
        if start_goal is None and all(r["goal"] is not None for r in first):
            start_goal, goal_kind = sum(r["goal"] for r in first) / len(first), "training goal"
        if start_goal is not None:
            refs.append({"label": f"steps {first[0]['step']}-{first[-1]['step']}", "goal": start_goal,
                         "goal_kind": goal_kind, "entropy": sum(r["entropy"] for r in first) / len(first)})
        refs += [{**e, "label": f"step {e['step']}", "goal_kind": "held-out goal"} for e in self._evals]
        prev = self._evals[-1] if self._evals else None
        self._evals.append(now)
        msgs = []
        for ref in refs:
            if (now["entropy"] < (1 - self.entropy_drop) * ref["entropy"] and goal - ref["goal"] < self.flat_goal
                    and goal < self.saturated and self._due("entropy", step)):
                top, top_frac = self._rows[-1]["top"], self._recent("top_frac")
                if top_frac is not None and top_frac > self.constant_max:
                    constant = (f"; it now answers {top!r} to {top_frac:.0%} of its samples (a constant answer: see "
                                f"rollouts.jsonl and `rlvr audit`)")
                elif top_frac is not None:
                    constant = f"; its most common response is {top!r} ({top_frac:.0%} of samples): see rollouts.jsonl"
                else:
                    constant = "; see rollouts.jsonl for what it now answers"
                msgs.append(f"sampling entropy fell from {ref['entropy']:.3f} ({ref['label']}) to {now['entropy']:.3f} "
                            f"(step {step}) while the held-out goal stayed at {goal:.3f} ({ref['goal_kind']} "
                            f"{ref['goal']:.3f} at {ref['label']}): the policy is collapsing without progress{constant}; "
                            f"lower train.lr or add a KL term (algorithm.kl_coef)")
                break
        if prev is not None and now["reward"] > prev["reward"] and goal < prev["goal"] - self.goal_drop \
                and self._due("gamed", step):
            msgs.append(self._heldout_fell_message(prev, now))
        return msgs

    @staticmethod
    def _heldout_fell_message(prev: dict, now: dict) -> str:
        """The warning for a training reward that rose while the held-out goal fell: gamed, unless the
        training goal did not fall (then the evaluation's greedy answer or the prompts differ)."""
        head = (f"training reward rose ({prev['reward']:.3f} -> {now['reward']:.3f}) while the held-out goal fell "
                f"({prev['goal']:.3f} -> {now['goal']:.3f})")
        was, got = prev.get("train_goal"), now.get("train_goal")      # None: no goal rows, or an older saved state
        known = was is not None and got is not None
        if not known or got < was:
            fell = f" and the training goal fell ({was:.3f} -> {got:.3f})" if known else ""
            return f"{head}{fell}: the reward is being gamed; run `rlvr audit`"
        return (f"{head}, but the training goal did not fall ({was:.3f} -> {got:.3f}): the samples still meet the "
                f"goal, so the reward is not what is gamed. What fell is the held-out evaluation: its greedy answer "
                f"(eval/goal decodes greedily, training samples at sampling.temperature) drifting from what sampling "
                f"trains (eval/pass@k samples at that temperature), or a policy that fits the training prompts only. "
                f"best/ keeps the weights of the best evaluation (eval.keep_best)")
