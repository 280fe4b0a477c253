"""The price of a run, computed before it starts (in sampled tokens per gradient step: docs/background.md, section 10).

Arithmetic on counters, nanoGPT `estimate_mfu` style; no sampling, no model forward. With P prompts,
G samples, T the response-length bound, Lp the longest prompt, μ passes, M minibatches:

    sampled tokens per batch          = P * G * T                (x rounds, worst case, with dynamic sampling)
    sampled tokens per gradient step  = P * G * T / (μ * M)
    sampled tokens per run            = steps * P * G * T
    forward tokens, sampling          = P * Lp (prefill, once per prompt) + P * G * (T - 1) (decode, KV cache)
    forward tokens, logp_old          = 0: the sampler's own log-probs are stored (rlvr.trainer);
                                        P * G * (Lp + T - 1) with algorithm.logp_old = "recompute"
    forward tokens, logp_ref          = P * G * (Lp + T - 1) when the KL term is on
    trained tokens (fwd + bwd)        = μ * P * G * (Lp + T - 1)
    (with the prompt shared by its group, P * G * (Lp + T - 1) becomes P * Lp + P * G * (T - 1))

A row's last response token is never fed to a forward: a decode step feeds the token drawn before
it, and a log-prob forward runs without the last token, which predicts nothing scored.

FLOPs: forward tokens x (2N + attention), trained tokens x (6N + attention), with N the matmul
parameters and the attention term of the model's `flops_per_token` taken at the keys a token really
attends to in this run, `attended_keys(Lp, T)` = (Lp + T + 1) / 2 (`model_flops_per_token`), not
at the model's maximum context. Memory of the copies held:
the policy, AdamW's two fp32 moments, a reference policy only when the KL term is on, and the stored
old log-probs (P*G*T floats) that stand in for a π_old snapshot.

Wall time: FLOPs per run / a measured fp32 matmul rate (rlvr.run.matmul_rate; under bf16 autocast
chosen by model.autocast = auto, that rate x the measured bf16 speed-up). A lower bound:
sampling decodes one token at a time, so it is bound by memory bandwidth and per-token overhead,
and a small model's products run far below the rate of the large square products measured.
Expected wall time: the same with the decode positions (P * G * (T - 1) a batch: a decode step
feeds the token drawn before it, and the last one drawn is never fed) replaced by T - 1 decode
steps at a measured decode-step time of the run's own policy (rlvr.probes.decode_step_seconds);
with tool calls (rlvr.tools) each of the `tool_calls` continuation rounds adds P * G * T decode
positions and T - 1 decode steps more (the most a round can take, as its FLOPs are priced). The
learn stage, where measured (rlvr.learn.learn_part_seconds: one `train.micro_batches` part's training
forward and backward at full length T, and one optimizer step), is priced the same way: each
gradient step's parts and optimizer step at their measured times instead of the training FLOPs at
the rate (a small model's training runs far below the rate too: per-operation overhead, and
elementwise passes over the activations bound by memory bandwidth).

At an expected response length (RunShape.expected_response_tokens, sampling.expected_response_tokens,
below T) every T above but the memory's becomes that mean length, and the expected wall time models
the lengths as geometric with that mean, cut at T (`length_survival`): a batch decodes until its
longest row ends (`expected_longest`), each step computing the rows still in the batch
(`decode_rows_per_step`) at a fixed cost plus a cost per row (`decode_split`, from decode steps
measured at two row counts), and each learn part takes the time the learn probe measured for a
part with its rows at the expected lengths (else its rows' expected columns, `learn_part_widths`,
in proportion; the length model is rlvr.lengths). At 0 or T: the upper bounds above, unchanged.

Memory: rlvr.memory_model (the peak resident set, every term's formula).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from rlvr import price_lines
from rlvr.price_expected import expected_fields as _expected_fields, expected_lengths as _expected_lengths
from rlvr.lengths import (  # noqa: F401  (the price's length model; rlvr.costs.* are the callers' names)
    decode_row_columns,
    decode_rows_per_step,
    decode_split,
    expected_buckets,
    expected_decode_seconds,
    expected_longest,
    learn_part_widths,
    part_lengths,
    length_ratio,
    length_survival,
)
from rlvr.memory_model import Memory, ModelShape, memory
from rlvr.procmem import available_bytes, resident_bytes  # noqa: F401  (the callers' names: rlvr.run, tasks)


@dataclass
class Price:
    """Figures of a run's cost; every count is an upper bound set by the response-length bound, or
    at an expected response length (`expected_response_tokens`) its expectation."""

    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    prompt_tokens: int
    steps: int
    grad_steps_per_batch: int
    sampling_rounds: int
    n_params: int
    has_reference: bool
    reference_is_adapter_off: bool
    sampled_tokens_per_batch: int
    sampled_tokens_per_grad_step: float
    sampled_tokens_per_run: int
    sampled_tokens_per_run_worst: int
    forward_tokens_sampling_per_batch: int
    forward_tokens_logp_old_per_batch: int
    forward_tokens_logp_ref_per_batch: int
    trained_tokens_per_batch: int
    forward_tokens_per_run: int
    trained_tokens_per_run: int
    flops_sampling_per_batch: float
    flops_logp_ref_per_batch: float
    flops_train_per_batch: float
    flops_per_run: float
    policy_bytes: int
    optimizer_bytes: int
    reference_bytes: int
    logp_old_bytes: int
    matmul_flops_per_s: float = 0.0
    """Matmul rate of this machine under the run's numerics (see `matmul_kind`); 0 = not measured."""
    matmul_kind: str = "fp32"
    """"fp32": the measured fp32 rate; "bf16 autocast": that rate x the fp32 / bf16 time of
    model.autocast = auto's probe product (the run computes under bf16)."""
    threads: int = 0
    """torch threads the rate was measured with."""
    wall_seconds_estimate: float = 0.0
    """flops_per_run / matmul_flops_per_s: a lower bound on the run's wall time; 0 = not measured."""
    decode_step_s: float = 0.0
    """Measured seconds of one decode step of a batch's P x G rows (rlvr.probes.decode_step_seconds), or with
    rollout workers of the largest worker's share at a worker's threads (`decode_prompts`,
    `decode_threads`); 0 = not measured."""
    decode_prompts: int = 0
    """Prompts (G rows each) of the sampling call `decode_step_s` was measured on; 0 = all P."""
    decode_threads: int = 0
    """torch threads of that call (a rollout worker's); 0 = this process's (`threads`)."""
    rollout_workers: int = 0
    """distributed.rollout_workers: the workers that decode a batch's shares side by side (0: this process)."""
    learner_ranks: int = 1
    """distributed.learners: the ranks that run a minibatch's shares side by side (1: this process);
    with more, `learn_part_s` is one rank's part at `learn_threads` torch threads."""
    learn_threads: int = 0
    """torch threads `learn_part_s` was measured with (a learner actor's); 0 = this process's."""
    sync_bytes: int = 0
    """Bytes of the weight sync the rollout workers receive after every update (the trainable
    parameters, rlvr.distributed.sync.trainable_state); 0 without workers. Not priced in time."""
    learn_part_s: float = 0.0
    """Measured seconds of one training forward and backward of a `train.micro_batches` part of a
    minibatch at the run's lengths (rlvr.learn.learn_part_seconds); 0 = not measured (the training
    FLOPs are then priced at the matmul rate)."""
    learn_parts_per_step: int = 0
    """The parts each gradient step runs its forwards and backwards in (`learn_part_s` each)."""
    optimizer_step_s: float = 0.0
    """Measured seconds of one optimizer step over the trainable parameters (rlvr.learn.learn_part_seconds)."""
    learn_expected_part_s: float = 0.0
    """Measured seconds of a `learn_part_s` part with its rows at the expected response lengths
    (rlvr.learn.learn_part_seconds): the learn stage's part there; 0 = not measured."""
    learn_buckets_per_part: float = 0.0
    """At an expected length with train.length_buckets: the mean buckets a part's forward is cut
    into (rlvr.costs.expected_buckets); 0 = one call a part."""
    decode_cell_s: float = 0.0
    """Measured seconds more a decode step costs per row for each column the row has cached past its
    prompt (rlvr.probes.decode_column_seconds); 0 = not measured."""
    wall_seconds_expected: float = 0.0
    """The run's compute time with sampling's decode at `decode_step_s`: steps x (T - 1) x decode_step_s
    (+ `decode_cell_s` per row and cached column)
    + (when measured) every gradient step's parts at `learn_part_s` and its optimizer step at
    `optimizer_step_s` + the other FLOPs (prefill, log-prob forwards; training when not measured) at
    the matmul rate. Evaluation, rewards and checkpoints come on top. 0 = not measured."""
    memory_baseline_bytes: int = 0
    """The process before the run (torch, transformers, tokenizer, task), measured at pricing."""
    memory_gradient_bytes: int = 0
    memory_activation_bytes: int = 0
    memory_logits_bytes: int = 0
    memory_kv_cache_bytes: int = 0
    memory_eval_kv_cache_bytes: int = 0
    memory_export_bytes: int = 0
    memory_weight_copy_bytes: int = 0
    """bf16 weight copies in each forward phase's figure (CPU bf16 autocast; 0 otherwise)."""
    memory_kept_copy_bytes: int = 0
    """bf16 copies (and packs) of the frozen weights, held for the whole run (CPU bf16 autocast; 0 otherwise)."""
    memory_peak_bytes: int = 0
    """Predicted peak resident bytes (0 = not predicted: no model shape given)."""
    memory_peak_phase: str = ""
    memory_counted_peak_bytes: int = 0
    """The peak the count of tensors alone predicts (`memory`), before any measurement."""
    memory_learn_measured_bytes: int = 0
    """The resident set measured at the peak of a learn part at the cap (rlvr.learn.learn_part_seconds):
    the training phase's figure instead of the count where measured, the C library's free-but-kept
    memory included; 0 = not measured."""
    flops_logp_old_per_batch: float = 0.0
    """FLOPs of the training forward (no backward) of a batch (algorithm.logp_old = recompute, or the
    entropies of algorithm.top_entropy_quantile < 1; 0 = none: the sampler's log-probs)."""
    entropy_forward: bool = False
    """That forward gives algorithm.top_entropy_quantile its entropies."""
    logp_old_recomputed: bool = False
    """That forward gives logp_old (algorithm.logp_old = recompute, or auto with bf16 forwards)."""
    logp_old_from_learner: bool = False
    """logp_old is the learner's own forwards, detached (rlvr.run.logp_old_in_learn): no forward of its
    own with one minibatch; with more, the minibatches after the first run theirs before the first
    update (rlvr.learn.prepass_logp_old, priced in forward_tokens_logp_old_per_batch)."""
    logp_old_note: str = ""
    """Why algorithm.logp_old = auto took the source it did ("" when it was set)."""
    numerics: str = ""
    """How the policy's forwards compute (model.autocast resolved, with the measured times); "" = not given."""
    tool_calls: int = 0
    """sampling.max_tool_calls: the sampling forwards include that many continuations per response
    at most, each a prefill of the whole context then decoding (priced as if every row called)."""
    expected_response_tokens: int = 0
    """The mean response length the token counts, FLOPs and expected wall time assume
    (sampling.expected_response_tokens, below the cap); 0 = every response at the cap `max_new_tokens`
    (upper bounds). The memory prediction and `logp_old_bytes` stay at the cap."""
    decode_steps_per_batch: float = 0.0
    """At an expected length: the decode steps a batch's first sampling round is priced at, E[its
    longest response] - 1 (rlvr.costs.expected_longest); 0 = T - 1, the cap's."""
    decode_rows_per_step: float = 0.0
    """At an expected length: the mean rows those steps compute (finished rows leave the batch)."""
    decode_fixed_s: float = 0.0
    """At an expected length: a decode step's cost whatever its rows (rlvr.costs.decode_split)."""
    decode_row_s: float = 0.0
    """At an expected length: a decode step's cost per row."""
    decode_small_step_s: float = 0.0
    """Measured seconds of a decode step of `decode_small_prompts` prompts (G rows each), which splits
    `decode_step_s` into those two; 0 = not measured (all of it counted as fixed)."""
    decode_small_prompts: int = 0
    learn_part_tokens: float = 0.0
    """At an expected length: the mean response columns of a learn part (each part's expected longest row)."""
    learn_part_fraction: float = 0.0
    """At an expected length: a gradient step's parts counted in parts of the measured length T."""

    def peak_in_parts(self, factor: float) -> int:
        """The predicted peak with training's activations and logits divided by `factor` (each minibatch's
        forward and backward in `factor` times as many parts, train.micro_batches; about, as parts
        hold whole groups), the other phases as they are; 0 without a memory prediction."""
        if not self.memory_peak_bytes:
            return 0
        held = (self.memory_baseline_bytes + self.policy_bytes + self.reference_bytes + self.optimizer_bytes
                + self.memory_gradient_bytes + self.memory_kept_copy_bytes)
        w = self.memory_weight_copy_bytes
        training = int((self.memory_activation_bytes + self.memory_logits_bytes) / factor) + w
        return held + max(training, self.memory_kv_cache_bytes + w, self.memory_eval_kv_cache_bytes + w,
                          self.memory_export_bytes)

    def memory_line(self) -> str:
        """The predicted peak and its parts, in MiB (rlvr.price_lines)."""
        return price_lines.memory_line(self)

    def lines(self) -> list[str]:
        """The price as printed by `rlvr price` and before the first step of `rlvr train` (rlvr.price_lines)."""
        return price_lines.lines(self)

    def wall_line(self) -> str:
        """The wall-time line (rlvr.price_lines)."""
        return price_lines.wall_line(self)

    def to_dict(self) -> dict:
        return asdict(self)


def sampling_forward_tokens(prompts: int, prompt_len: int, rows: int, response_len: int) -> int:
    """Token positions one sampling pass computes: each prompt once (prefill; its KV cache is then
    shared by the group), then each of the `rows` rows' response tokens but the last (a decode step
    feeds the token sampled before it; the last one sampled is never fed back)."""
    return prompts * prompt_len + rows * max(response_len - 1, 0)


def logp_old_forward_tokens(per_forward: int, prompts: int, minibatches: int, own_forward: bool,
                            from_learner: bool) -> int:
    """Token positions a batch computes for logp_old (and top_entropy_quantile's entropies) beyond
    the sampling and training forwards, given `per_forward` for one log-prob forward of the batch:
    all of it for the rollout stage's forward (`own_forward`); from the learner with more than one
    minibatch, the minibatches after the first (torch.chunk of the P groups: the first holds
    ceil(P / M)), each run before the first update (rlvr.learn.prepass_logp_old); else none."""
    if own_forward:
        return per_forward
    if from_learner and minibatches > 1:
        return per_forward * (prompts - -(-prompts // minibatches)) // prompts
    return 0


def logp_forward_tokens(rows: int, group_size: int, prompt_len: int, response_len: int, *,
                        shared_prompt: bool) -> int:
    """Token positions one log-prob forward (reference or training) computes over `rows` rows:
    every row's prompt and response but its last token (which predicts nothing scored; the forward
    runs without it), or, with the prompt shared by its group of `group_size`, each prompt once
    and every row's response but its last token."""
    if shared_prompt:
        return rows // group_size * prompt_len + rows * max(response_len - 1, 0)
    return rows * (prompt_len + max(response_len - 1, 0))


def attended_keys(prompt_tokens: int, response_tokens: int) -> float:
    """Mean keys a token attends to in one sequence of L = prompt_tokens + response_tokens: (L + 1) / 2.

    Under causal attention token t (0-based) attends t + 1 keys, in the training forward and in
    KV-cached decoding alike, so the mean over the L tokens is (L + 1) / 2. This is the ``seq_len``
    to give a model's ``flops_per_token``: the model's maximum context (8,192 for SmolLM2) prices
    attention over keys that never exist (a 47-token prompt and 16 new tokens attend 32 keys on
    average, not 8,192).
    """
    for name, v in (("prompt_tokens", prompt_tokens), ("response_tokens", response_tokens)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"attended_keys: {name} must be a whole number >= 0, got {v!r}")
    return (prompt_tokens + response_tokens + 1) / 2


def model_flops_per_token(model, prompt_tokens: int, response_tokens: int) -> tuple[int, int]:
    """(forward, training) FLOPs per token of ``model`` at this run's lengths: its
    ``flops_per_token(attended_keys(prompt_tokens, response_tokens), training=False / True)``.
    Give the two to ``price(flops_fwd_per_token=..., flops_train_per_token=...)`` and use them for the
    run's FLOP counter, so the count and the price agree."""
    keys = attended_keys(prompt_tokens, response_tokens)
    return model.flops_per_token(keys, training=False), model.flops_per_token(keys, training=True)


def _check_counts(prompt_tokens, **counts: int) -> None:
    """ValueError naming the first count that is not a known positive whole number (`prompt_tokens`:
    a known number >= 0)."""
    for name, v in counts.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"cannot price the run: {name} must be a known positive number, got {v!r}")
    if not isinstance(prompt_tokens, int) or prompt_tokens < 0:
        raise ValueError(f"cannot price the run: prompt_tokens must be a known number, got {prompt_tokens!r}")


def _memory_fields(mem, learn_peak: int = 0) -> dict:
    """The `Price` fields of a `memory(...)` prediction; `learn_peak` (measured resident bytes of a learn
    part at the cap, 0 = none) stands for the training phase and what is held with it."""
    phases, peak, phase = mem.phases, mem.peak, max(mem.phases, key=mem.phases.get)
    if learn_peak:
        rest = max((k for k in phases if k != "training"), key=phases.get)
        other = mem.held + phases[rest]                   # the largest other phase, with what is held
        peak, phase = (learn_peak, "training") if learn_peak >= other else (other, rest)
    return dict(
        memory_baseline_bytes=mem.baseline, memory_gradient_bytes=mem.gradients,
        memory_activation_bytes=mem.activations, memory_logits_bytes=mem.logits,
        memory_kv_cache_bytes=mem.kv_cache, memory_eval_kv_cache_bytes=mem.eval_kv_cache,
        memory_export_bytes=mem.export_copy, memory_weight_copy_bytes=mem.weight_copies,
        memory_kept_copy_bytes=mem.kept_copies, memory_peak_bytes=peak, memory_peak_phase=phase,
        memory_counted_peak_bytes=mem.peak, memory_learn_measured_bytes=learn_peak)


def expected_wall_seconds(flops: float, decode_flops: float, decode_steps: int, rate: float,
                          decode_step_s: float, train_flops: float = 0.0, grad_steps: int = 0,
                          parts_per_step: float = 1, learn_part_s: float = 0.0, optimizer_step_s: float = 0.0,
                          extra_decode_s: float = 0.0) -> float:
    """A run's compute seconds with its decode at a measured time: the `flops` less the decode
    positions' `decode_flops` at `rate` FLOP/s, plus `decode_steps` decode steps of `decode_step_s`
    each (T - 1 a batch: the first token comes from the prefill) and `extra_decode_s` (decode priced
    otherwise: at an expected response length, `expected_decode_seconds`). With a measured
    `learn_part_s` the training FLOPs `train_flops` leave the rate's share too, replaced by
    `grad_steps` gradient steps of `parts_per_step` parts at `learn_part_s` (a fraction of a part
    where parts stop short of T: `learn_part_widths`) and an optimizer step at `optimizer_step_s`
    each. 0.0 when the rate or the decode step is not measured."""
    if rate <= 0 or decode_step_s <= 0:
        return 0.0
    decode = decode_steps * decode_step_s + extra_decode_s
    if learn_part_s <= 0:
        return (flops - decode_flops) / rate + decode
    return ((flops - decode_flops - train_flops) / rate + decode
            + grad_steps * (parts_per_step * learn_part_s + optimizer_step_s))


@dataclass(frozen=True)
class ScaleOut:
    """How a run's two stages spread over Ray actors (rlvr.distributed), as its price needs it."""

    rollout_workers: int = 0
    """distributed.rollout_workers: the workers that sample a batch's shares side by side (0: this process)."""
    decode_share: tuple[int, int] | None = None
    """(prompts, torch threads) of the sampling call a decode step was measured on: a worker's
    largest share (rlvr.run.decode_probe_share)."""
    sync_bytes: int = 0
    """Bytes each weight sync sends the workers (the trainable parameters)."""
    learner_ranks: int = 1
    """distributed.learners: the ranks that run a minibatch's shares side by side."""
    learn_share: tuple[int, int] | None = None
    """(groups, torch threads) of a rank's minibatch share the learn stage was measured on
    (rlvr.run.learn_probe_share)."""



@dataclass(frozen=True)
class RunShape:
    """What the config and the model say about a run, as its price needs it."""

    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int  # T, the response-length bound.
    prompt_tokens: int  # Lp, the longest prompt.
    steps: int
    epochs_per_batch: int
    minibatches: int
    n_params: int
    has_reference: bool  # The KL term is on (a reference forward per batch).
    micro_batches: int = 1
    """train.micro_batches: the parts a minibatch's forward and backward run in (memory, learn time)."""
    flops_fwd_per_token: float = 0.0  # Forward FLOPs per token (`model_flops_per_token`); 0: the 2N rule.
    flops_train_per_token: float = 0.0  # Training FLOPs per token; 0: the 6N rule.
    sampling_rounds: int = 1  # Dynamic sampling's rounds at most (the worst case's factor).
    bytes_per_param: int = 4
    trainable_params: int | None = None  # The parameters AdamW holds state for (LoRA: the adapter); None: all.
    reference_is_adapter_off: bool = False  # The reference is the policy with its adapter disabled: no copy held.
    shared_prompt: bool = False
    """The reference and training forwards run each prompt once per group (P * Lp + P * G * (T - 1) tokens)."""
    recompute_logp_old: bool = False
    """algorithm.logp_old = recompute (or auto with bf16 forwards): one log-prob forward more per batch."""
    logp_old_from_learner: bool = False
    """logp_old is the learner's first forward, detached: no forward with one minibatch, (M - 1) / M of
    one with M (rlvr.learn.prepass_logp_old)."""
    logp_old_note: str = ""  # Why algorithm.logp_old = auto took its source.
    entropy_forward: bool = False
    """algorithm.top_entropy_quantile < 1 needs a forward's entropies (one forward serves both)."""
    tool_calls: int = 0  # Continuations per row in sampling, each at most Lp + T prefilled and T decoded (rlvr.tools).
    expected_response_tokens: int = 0
    """sampling.expected_response_tokens: the mean response length the token counts and the expected
    wall time assume, lengths modelled as geometric with that mean, cut at T (`length_survival`);
    0 (or T) = every response at the cap T, an upper bound."""
    length_buckets: bool = False
    """train.length_buckets: a minibatch's groups sorted by length before its parts (`learn_part_widths`)."""
    compact_finished: float | None = None
    """rlvr.sampling.COMPACT_FINISHED where the decode drops finished rows (`decode_rows_per_step`);
    None: every row computed until the batch's last one ends."""

    @property
    def priced_response_tokens(self) -> int:
        """The response length the counts use: `expected_response_tokens` when set below T, else T."""
        e = self.expected_response_tokens
        return e if 0 < e < self.max_new_tokens else self.max_new_tokens

    @property
    def trainable(self) -> int:
        return self.n_params if self.trainable_params is None else self.trainable_params

    @property
    def reference_copy(self) -> bool:
        """A reference policy is held as a copy (KL on, and not the adapter disabled)."""
        return self.has_reference and not self.reference_is_adapter_off


@dataclass(frozen=True)
class Measured:
    """What was measured at start-up on this machine; 0 = not measured."""

    matmul_flops_per_s: float = 0.0  # The matmul rate under the run's numerics (gives the wall-time lower bound).
    matmul_kind: str = "fp32"  # What the rate measures: "fp32", or "bf16 autocast".
    threads: int = 0  # torch threads the rate was measured with.
    numerics: str = ""  # The model.autocast line, with its measured times.
    decode_step_s: float = 0.0
    """One decode step of the P x G rows (gives the expected wall time, `expected_wall_seconds`)."""
    learn_part_s: float = 0.0
    """One micro part's training forward and backward: prices the learn stage instead of its FLOPs."""
    optimizer_step_s: float = 0.0  # One optimizer step.
    decode_small_step_s: float = 0.0
    """One decode step of fewer rows, `decode_small_prompts` prompts of G (rlvr.probes.decode_step_seconds):
    with `decode_step_s` it splits a step's cost into a fixed part and a part per row (`decode_split`),
    for an expected response length; 0 = not measured (the whole step then counts as fixed)."""
    decode_small_prompts: int = 0
    decode_cell_s: float = 0.0
    """Seconds more a decode step costs per row for each column the row has cached past its prompt
    (rlvr.probes.decode_column_seconds); 0 = not measured (a step costs the same at every column)."""
    learn_expected_part_s: float = 0.0
    """Seconds of that part with its rows at the expected response lengths (rlvr.lengths.part_lengths,
    rlvr.learn.learn_part_seconds); 0 = not measured (the part at T scaled to the expected positions)."""
    learn_peak_bytes: int = 0
    """The process's resident bytes at the peak of a learn part at the cap (rlvr.learn.learn_part_seconds)."""

    def with_learn(self, learn_part_s: float, optimizer_step_s: float, learn_expected_part_s: float = 0.0,
                   learn_peak_bytes: int = 0) -> Measured:
        """These figures with the learn stage's measured times and peak."""
        return replace(self, learn_part_s=learn_part_s, optimizer_step_s=optimizer_step_s,
                       learn_expected_part_s=learn_expected_part_s, learn_peak_bytes=learn_peak_bytes)


@dataclass(frozen=True)
class MemoryInputs:
    """What the memory prediction (`memory`) needs beyond the run's shape."""

    shape: ModelShape
    baseline_bytes: int = 0  # The process before the run (measured).
    logprob_chunk_rows: int = 0
    logit_bytes: int = 4  # Bytes of a logit in the forwards (`logits_bytes`).
    eval_rows: int = 0  # Rows decoded together in evaluation.
    export_copy: bool = False  # Export merges LoRA into a copy.
    weight_copy_bytes: int = 0  # The bf16 weight copies of a forward phase (CPU bf16 autocast).
    kept_copy_bytes: int = 0  # The bf16 copies kept for the whole run.


@dataclass(frozen=True)
class _Tokens:
    """A batch's token positions by forward (the module docstring's counts)."""

    sampling: int
    logp_ref: int
    logp_old: int
    trained: int


def _tokens(run: RunShape) -> _Tokens:
    """The token positions a batch of `run` computes in each forward."""
    P, G, T, Lp = run.prompts_per_step, run.samples_per_prompt, run.max_new_tokens, run.prompt_tokens
    T_cap, T = T, run.priced_response_tokens      # tool continuations stay priced at the cap
    rows = P * G
    per_forward = logp_forward_tokens(rows, G, Lp, T, shared_prompt=run.shared_prompt)
    return _Tokens(
        sampling=sampling_forward_tokens(P, Lp, rows, T) + run.tool_calls * rows * (Lp + 2 * T_cap),
        logp_ref=per_forward * run.has_reference,
        logp_old=logp_old_forward_tokens(per_forward, P, run.minibatches, run.recompute_logp_old or run.entropy_forward,
                                         run.logp_old_from_learner),
        trained=run.epochs_per_batch * per_forward)


def _learn_parts(run: RunShape, so: ScaleOut) -> int:
    """The parts each gradient step runs its forwards and backwards in: whole groups, at least one a
    part; with a learner group, parts of one rank's share."""
    share = run.prompts_per_step // run.minibatches if so.learn_share is None else so.learn_share[0]
    return min(run.micro_batches, max(1, share))


def _memory_prediction(run: RunShape, mem: MemoryInputs) -> Memory:
    """`memory` for `run` with the inputs `mem`."""
    T = run.max_new_tokens
    return memory(
        mem.shape, prompts=run.prompts_per_step, group=run.samples_per_prompt, prompt_len=run.prompt_tokens,
        response_len=T, minibatches=run.minibatches * run.micro_batches, n_params=run.n_params,
        trainable_params=run.trainable, has_reference_copy=run.reference_copy, baseline=mem.baseline_bytes,
        bytes_per_param=run.bytes_per_param, shared_prompt=run.shared_prompt,
        logprob_chunk_rows=mem.logprob_chunk_rows, logit_bytes=mem.logit_bytes, eval_rows=mem.eval_rows,
        export_copy=mem.export_copy, weight_copy_bytes=mem.weight_copy_bytes, kept_copy_bytes=mem.kept_copy_bytes,
        cache_reserve=2 * T * run.tool_calls)


def _check_run(run: RunShape) -> None:
    """ValueError naming the first count of `run` that is missing (`_check_counts`)."""
    _check_counts(run.prompt_tokens, max_new_tokens=run.max_new_tokens, n_params=run.n_params,
                  prompts_per_step=run.prompts_per_step, samples_per_prompt=run.samples_per_prompt, steps=run.steps,
                  epochs_per_batch=run.epochs_per_batch, minibatches=run.minibatches,
                  sampling_rounds=run.sampling_rounds, micro_batches=run.micro_batches)


def price(run: RunShape, measured: Measured = Measured(), mem: MemoryInputs | None = None,
          scale_out: ScaleOut = ScaleOut()) -> Price:
    """Price `run`; refuses, naming the number, when one it needs is missing.

    `measured` gives the wall times: the FLOP lower bound at its matmul rate, the expected time at its
    decode step (`expected_wall_seconds`), and the learn stage at its measured part and optimizer
    step instead of its FLOPs. `mem` adds the predicted memory peak (`memory`; else 0). `scale_out`
    says whose decode and learn steps were measured with rollout workers or a learner group.
    """
    _check_run(run)
    fwd, trn = run.flops_fwd_per_token or 2 * run.n_params, run.flops_train_per_token or 6 * run.n_params
    P, G, T, steps = run.prompts_per_step, run.samples_per_prompt, run.max_new_tokens, run.steps
    L = run.priced_response_tokens                # T, or the expected response length
    rows, per_batch = P * G, P * G * L
    grad_steps = run.epochs_per_batch * run.minibatches
    tok = _tokens(run)
    forward = tok.sampling + tok.logp_ref + tok.logp_old
    flops_per_run = float((forward * fwd + tok.trained * trn) * steps)
    rounds = 1 + run.tool_calls    # sampling rounds a batch: the first, then each continuation's (at most T decoded)
    m, so = measured, scale_out
    parts = _learn_parts(run, so)
    # decode positions a batch, as counted above: L - 1 per row in the first round, T per continuation
    decode_positions = rows * (L - 1) + run.tool_calls * rows * T
    e = _expected_lengths(run, m, so, parts) if L < T else None
    decode_rows = (so.decode_share[0] if so.decode_share else P) * G   # the rows the decode probes measured
    # at the cap: every row caches 1 ... T - 1 columns past its prompt over the first round's steps
    growth = m.decode_cell_s * decode_row_columns([1.0] * T, decode_rows, run.compact_finished) if e is None else 0.0
    expected = expected_wall_seconds(flops_per_run, steps * decode_positions * fwd,
                                     steps * (rounds - (e is not None)) * (T - 1),
                                     m.matmul_flops_per_s, m.decode_step_s, float(tok.trained * trn * steps),
                                     steps * grad_steps, parts if e is None else e.parts, m.learn_part_s,
                                     m.optimizer_step_s, steps * (growth if e is None else e.decode_s))
    measured_learn = expected > 0 and m.learn_part_s > 0
    policy = run.n_params * run.bytes_per_param
    return Price(
        prompts_per_step=P, samples_per_prompt=G, max_new_tokens=T, prompt_tokens=run.prompt_tokens, steps=steps,
        grad_steps_per_batch=grad_steps, sampling_rounds=run.sampling_rounds, n_params=run.n_params,
        has_reference=run.has_reference, reference_is_adapter_off=run.reference_is_adapter_off,
        sampled_tokens_per_batch=per_batch, sampled_tokens_per_grad_step=per_batch / grad_steps,
        sampled_tokens_per_run=per_batch * steps, sampled_tokens_per_run_worst=per_batch * steps * run.sampling_rounds,
        forward_tokens_sampling_per_batch=tok.sampling, forward_tokens_logp_old_per_batch=tok.logp_old,
        forward_tokens_logp_ref_per_batch=tok.logp_ref, trained_tokens_per_batch=tok.trained,
        forward_tokens_per_run=forward * steps, trained_tokens_per_run=tok.trained * steps,
        flops_sampling_per_batch=float(tok.sampling * fwd), flops_logp_ref_per_batch=float(tok.logp_ref * fwd),
        flops_train_per_batch=float(tok.trained * trn), flops_per_run=flops_per_run,
        policy_bytes=policy, optimizer_bytes=2 * run.trainable * 4, reference_bytes=policy if run.reference_copy else 0,
        logp_old_bytes=rows * T * 4, matmul_flops_per_s=float(m.matmul_flops_per_s), threads=m.threads,
        wall_seconds_estimate=flops_per_run / m.matmul_flops_per_s if m.matmul_flops_per_s > 0 else 0.0,
        decode_step_s=float(m.decode_step_s) if expected else 0.0, wall_seconds_expected=expected,
        learn_part_s=float(m.learn_part_s) if measured_learn else 0.0,
        learn_parts_per_step=parts if measured_learn else 0,
        optimizer_step_s=float(m.optimizer_step_s) if measured_learn else 0.0,
        learn_expected_part_s=float(m.learn_expected_part_s) if measured_learn else 0.0,
        decode_cell_s=float(m.decode_cell_s) if expected else 0.0,
        flops_logp_old_per_batch=float(tok.logp_old * fwd), entropy_forward=run.entropy_forward,
        logp_old_recomputed=run.recompute_logp_old, logp_old_note=run.logp_old_note,
        logp_old_from_learner=run.logp_old_from_learner, numerics=m.numerics, matmul_kind=m.matmul_kind,
        tool_calls=run.tool_calls,
        decode_prompts=so.decode_share[0] if so.decode_share and expected else 0,
        decode_threads=so.decode_share[1] if so.decode_share and expected else 0,
        rollout_workers=so.rollout_workers, sync_bytes=so.sync_bytes, learner_ranks=so.learner_ranks,
        expected_response_tokens=L if L < T else 0,
        **(_expected_fields(e, m) if e is not None and expected else {}),
        learn_threads=so.learn_share[1] if so.learn_share and so.learner_ranks > 1 and measured_learn else 0,
        **({} if mem is None else _memory_fields(_memory_prediction(run, mem), m.learn_peak_bytes)))
