"""What a built run is, for the stages that use it: `RunError`, the generation `Limits`, the
`Setup` (task, tokenizer, policy, limits, device, numerics) and the decisions derived from the config
and the numerics alone (where logp_old comes from). Building a run is rlvr.build's job; this module
holds no code that loads anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlvr import config as config_mod
from rlvr.numerics import Numerics
from rlvr.policy import Policy, Tokenizer
from rlvr.tasks import Task


class RunError(RuntimeError):
    """A run that cannot start or continue, with the reason."""


@dataclass(frozen=True)
class Limits:
    """How long a response may be and where it ends, for one task on one tokenizer."""

    max_new_tokens: int
    """Response bound: `sampling.max_new_tokens`, or the task's own bound when that is 0."""
    eos_id: int | None
    """The end token; None on fixed-length tasks (exactly max_new_tokens tokens, no end token)."""
    prompt_tokens: int
    """Tokens of the longest prompt, train and held-out (pricing and the context check)."""
    stop: tuple = ()
    """`sampling.stop`: strings that end a response at the token completing one (rlvr.sampling.StopStrings)."""
    tool_calls: int = 0
    """`sampling.max_tool_calls`: the task's tool answers up to this many stop strings per response (rlvr.tools)."""
    tool_role: str = ""
    """`sampling.tool_role`: "" inserts the tool's text as it is; a role, as that role's chat turn."""
    tool_on_end: bool = False
    """`sampling.tool_on_end`: a response that ends at eos calls the tool too (a multi-turn environment)."""


@dataclass
class Setup:
    """Everything a run needs, built and checked before any compute."""

    cfg: config_mod.Config
    task: Task
    tokenizer: Tokenizer
    model: Policy
    reward_weights: dict[str, float]
    limits: Limits
    device: torch.device
    """Where the policy (and the reference) run."""
    baseline_bytes: int = 0
    """This process's resident set just before the policy was loaded (torch, transformers, the
    task): the memory prediction's baseline (rlvr.memory_model.memory)."""
    numerics: Numerics | None = None
    """How the policy's forwards compute (`model.autocast` resolved at build time); None given = fp32."""

    def __post_init__(self):
        if self.numerics is None:
            self.numerics = Numerics(False, "off", self.device.type)

    @property
    def recompute_logp_old(self) -> bool:
        """Whether logp_old comes from the learner's forward rather than the sampler (`logp_old_source`)."""
        return logp_old_source(self.cfg, self.numerics) == "recompute"

    @property
    def logp_old_from_learner(self) -> bool:
        """Whether that forward is the learn stage's own first one (`logp_old_in_learn`): no extra forward."""
        return self.recompute_logp_old and logp_old_in_learn(self.cfg)


def shares_prompt(cfg: config_mod.Config, model: Policy) -> bool:
    """True when log-prob forwards run each prompt once per group (`model.share_prompt_forward` on a
    model whose cache is differentiable)."""
    return cfg.model.share_prompt_forward and model.differentiable_cache


def bf16_forwards(cfg: config_mod.Config, numerics: Numerics) -> bool:
    """Whether the policy's forwards compute in bf16: under bf16 autocast, or a Hugging Face model
    loaded with bf16 weights (model.dtype)."""
    return numerics.bf16 or bool(cfg.model.path) and cfg.model.dtype == "bf16"


def logp_old_source(cfg: config_mod.Config, numerics: Numerics) -> str:
    """algorithm.logp_old resolved: `sampler` or `recompute` as set; `auto` is `recompute` where the
    forwards run in bf16 (`bf16_forwards`: the sampler's decode steps and the training forward then
    round differently, so the sampler's log-probs are not the trainer's), else `sampler`. A resumed
    run, a rollout worker and a learner actor get the same answer: the numerics decision travels."""
    asked = cfg.algorithm.logp_old
    if asked != "auto":
        return asked
    return "recompute" if bf16_forwards(cfg, numerics) else "sampler"


def logp_old_in_learn(cfg: config_mod.Config) -> bool:
    """Whether a recomputed logp_old comes from the learn stage's own forwards, detached, rather than
    a forward of the rollout stage's. With train.minibatches = 1 the first pass computes every row at
    π_old, before any update, so its log-probs are π_old's as the learner computes them (ratio
    exactly 1, as TRL takes `old_per_token_logps` when it updates once) and the batch costs no extra
    forward. With more minibatches the first minibatch's forward gives its rows and the others' rows
    come from forwards over the very parts their updates will run in, before the first update
    (rlvr.learn.prepass_logp_old; in a learner group each rank its own rows, exchanged after the
    first minibatch): each minibatch's first ratio is exactly 1 there too, for (minibatches - 1) /
    minibatches of a forward. The rollout stage still runs one where it needs the numbers before Δ
    (algorithm.top_entropy_quantile < 1, algorithm.kl_in = "reward" with a KL) and for rows sampled
    by older weights (distributed.max_staleness > 0; rlvr.distributed.staleness)."""
    ac = cfg.algorithm
    kl_in_reward = ac.kl_in == "reward" and ac.kl_coef > 0
    return ac.top_entropy_quantile >= 1 and not kl_in_reward and cfg.distributed.max_staleness == 0


def logp_old_note(cfg: config_mod.Config, numerics: Numerics) -> str:
    """What the price says of `algorithm.logp_old = auto`'s choice ("" when it was set)."""
    if cfg.algorithm.logp_old != "auto":
        return ""
    if logp_old_source(cfg, numerics) == "recompute":
        return ("algorithm.logp_old = auto: the forwards run in bf16, where the sampler's log-probs are not "
                "the trainer's")
    return "algorithm.logp_old = auto: fp32 forwards, the sampler's log-probs are the trainer's to rounding"
