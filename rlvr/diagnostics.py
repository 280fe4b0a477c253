"""Is the run learning? Figures and rules that answer it, since the GRPO loss does not.

With one update per batch the ratio is 1 and a centered Δ averages out, so the printed loss is
about 0 while the gradient is not (docs/background.md, section 6). What does show learning: the fraction of non-zero
Δ, the fraction of groups that agree (and teach nothing), the per-group pass rates, entropy, KL,
the held-out goal against the training proxy. `Watch` turns them into warnings that name a fix.
"""

from __future__ import annotations

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


@dataclass
class Watch:
    """Rules over the run's history that print a warning naming the fix.

    - agreeing groups above `agree_max` (mean of the last `window` steps): the batch teaches little.
    - entropy fell by more than `entropy_drop` since the previous evaluation while the held-out
      goal rose by less than `flat_goal` and is below `saturated`: collapse without progress.
      (Groups that agree because they are all solved get their own message: the prompts are too easy.)
    - training reward rose while the held-out goal fell by more than `goal_drop`: the proxy is
      being gamed.
    Each rule warns at most once every `cooldown` steps.
    """

    agree_max: float = 0.8
    entropy_drop: float = 0.5
    flat_goal: float = 0.01
    goal_drop: float = 0.02
    saturated: float = 0.95
    window: int = 10
    cooldown: int = 100
    _agree: list = field(default_factory=list)
    _solved: list = field(default_factory=list)
    _entropy: list = field(default_factory=list)
    _reward: list = field(default_factory=list)
    _last_eval: dict | None = None
    _last_warned: dict = field(default_factory=dict)

    def _due(self, rule: str, step: int) -> bool:
        last = self._last_warned.get(rule)
        if last is not None and step - last < self.cooldown:
            return False
        self._last_warned[rule] = step
        return True

    def after_step(self, step: int, row: dict) -> list[str]:
        self._agree.append(row["train/agreeing_groups_frac"])
        hist = row.get("train/pass_rate_hist")
        self._solved.append(hist[-1] / max(1, sum(hist)) if hist else 0.0)
        self._entropy.append(row["train/entropy"])
        self._reward.append(row["train/reward"])
        recent = self._agree[-self.window:]
        if len(recent) == self.window and sum(recent) / len(recent) > self.agree_max and self._due("agree", step):
            solved = sum(self._solved[-self.window:]) / self.window
            head = f"{100 * sum(recent) / len(recent):.0f}% of groups agree over the last {self.window} steps and teach nothing"
            if solved >= 0.5 * sum(recent) / len(recent):
                return [f"{head}; most are fully solved: the training prompts are now too easy (use harder prompts, "
                        f"or stop if eval/goal has reached its target)"]
            return [f"{head}: use easier prompts, more samples per prompt (train.samples_per_prompt) or "
                    f"algorithm.dynamic_sampling = true"]
        return []

    def after_eval(self, step: int, goal: float) -> list[str]:
        msgs = []
        w = self.window
        now = {"goal": goal, "entropy": _mean(self._entropy[-w:]), "reward": _mean(self._reward[-w:])}
        prev = self._last_eval
        self._last_eval = now
        if prev is None or now["entropy"] is None or prev["entropy"] is None:
            return msgs
        if (now["entropy"] < (1 - self.entropy_drop) * prev["entropy"] and now["goal"] - prev["goal"] < self.flat_goal
                and now["goal"] < self.saturated and self._due("entropy", step)):
            msgs.append(f"sampling entropy fell from {prev['entropy']:.3f} to {now['entropy']:.3f} while the held-out "
                        f"goal stayed at {now['goal']:.3f}: lower train.lr or add a KL term (algorithm.kl_coef)")
        if now["reward"] > prev["reward"] and now["goal"] < prev["goal"] - self.goal_drop and self._due("gamed", step):
            msgs.append(f"training reward rose ({prev['reward']:.3f} -> {now['reward']:.3f}) while the held-out goal "
                        f"fell ({prev['goal']:.3f} -> {now['goal']:.3f}): the reward is being gamed; run `rlvr audit`")
        return msgs


def _mean(xs: list) -> float | None:
    return sum(xs) / len(xs) if xs else None
