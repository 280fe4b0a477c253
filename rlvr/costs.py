"""The price of a run, computed before it starts (seed 000: "Price this one in sampled tokens").

Arithmetic on counters, nanoGPT `estimate_mfu` style; no sampling, no model forward. With P prompts,
G samples, T the response-length bound, Lp the longest prompt, μ passes, M minibatches:

    sampled tokens per batch          = P * G * T                (x rounds, worst case, with dynamic sampling)
    sampled tokens per gradient step  = P * G * T / (μ * M)
    sampled tokens per run            = steps * P * G * T
    forward tokens, sampling          = P * Lp (prefill, once per prompt) + P * G * T (decode, KV cache)
    forward tokens, logp_old          = 0: the sampler's own log-probs are stored (rlvr.trainer)
    forward tokens, logp_ref          = P * G * (Lp + T) when the KL term is on
    trained tokens (fwd + bwd)        = μ * P * G * (Lp + T)
    (with the prompt shared by its group, P * G * (Lp + T) becomes P * Lp + P * G * T)

FLOPs: forward tokens x (2N + attention), trained tokens x (6N + attention), with N the matmul
parameters and the attention term of the model's `flops_per_token` taken at the keys a token really
attends to in this run, `attended_keys(Lp, T)` = (Lp + T + 1) / 2 (`model_flops_per_token`), not
at the model's maximum context. Memory of the copies held:
the policy, AdamW's two fp32 moments, a reference policy only when the KL term is on, and the stored
old log-probs (P*G*T floats) that stand in for a π_old snapshot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Price:
    """Figures of a run's cost; every count is an upper bound set by the response-length bound."""

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

    def lines(self) -> list[str]:
        """The price as printed by `rlvr price` and before the first step of `rlvr train`."""
        mib = 1 / 2**20
        worst = ""
        if self.sampling_rounds > 1:
            worst = (f"; worst case with dynamic sampling ({self.sampling_rounds} rounds) "
                     f"{self.sampled_tokens_per_run_worst:,}")
        copies = [f"policy {self.policy_bytes * mib:.2f} MiB", f"AdamW state {self.optimizer_bytes * mib:.2f} MiB"]
        if not self.has_reference:
            copies.append("no reference (kl_coef = 0)")
        elif self.reference_is_adapter_off:
            copies.append("reference = the policy with its LoRA adapter disabled (no copy)")
        else:
            copies.append(f"reference {self.reference_bytes * mib:.2f} MiB")
        copies.append(
            f"stored logp_old {self.logp_old_bytes * mib:.3f} MiB instead of a π_old copy "
            f"({self.policy_bytes * mib:.2f} MiB, saving {(self.policy_bytes - self.logp_old_bytes) * mib:.2f} MiB)"
        )
        return [
            f"price: sampled tokens per gradient step = {self.sampled_tokens_per_grad_step:,.0f} "
            f"(P={self.prompts_per_step} x G={self.samples_per_prompt} x T<={self.max_new_tokens} "
            f"/ {self.grad_steps_per_batch} gradient steps per batch)",
            f"price: sampled tokens per batch = {self.sampled_tokens_per_batch:,}; "
            f"per run ({self.steps} steps) = {self.sampled_tokens_per_run:,}{worst}",
            f"price: forward tokens per batch: sampling {self.forward_tokens_sampling_per_batch:,} "
            f"({self.flops_sampling_per_batch:.3g} FLOP), logp_old {self.forward_tokens_logp_old_per_batch:,} "
            f"(stored from the sampler), logp_ref {self.forward_tokens_logp_ref_per_batch:,} "
            f"({self.flops_logp_ref_per_batch:.3g} FLOP); trained tokens {self.trained_tokens_per_batch:,} "
            f"({self.flops_train_per_batch:.3g} FLOP)",
            f"price: per run: {self.forward_tokens_per_run:,} forward + {self.trained_tokens_per_run:,} trained tokens, "
            f"{self.flops_per_run:.3g} FLOP",
            f"price: model copies held: {'; '.join(copies)}; parameters {self.n_params:,}",
        ]

    def to_dict(self) -> dict:
        return asdict(self)


def sampling_forward_tokens(prompts: int, prompt_len: int, response_slots: int) -> int:
    """Token positions one sampling pass computes: each prompt once (prefill; its KV cache is then
    shared by the group), then every response slot (decode, one position per step)."""
    return prompts * prompt_len + response_slots


def logp_forward_tokens(rows: int, group_size: int, prompt_len: int, response_len: int, *,
                        shared_prompt: bool) -> int:
    """Token positions one log-prob forward (reference or training) computes over `rows` rows:
    every row's prompt and response, or, with the prompt shared by its group of `group_size`, each
    prompt once."""
    if shared_prompt:
        return rows // group_size * prompt_len + rows * response_len
    return rows * (prompt_len + response_len)


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


def price(
    *,
    prompts_per_step: int,
    samples_per_prompt: int,
    max_new_tokens: int,
    prompt_tokens: int,
    steps: int,
    epochs_per_batch: int,
    minibatches: int,
    n_params: int,
    has_reference: bool,
    flops_fwd_per_token: float = 0.0,
    flops_train_per_token: float = 0.0,
    sampling_rounds: int = 1,
    bytes_per_param: int = 4,
    trainable_params: int | None = None,
    reference_is_adapter_off: bool = False,
    shared_prompt: bool = False,
) -> Price:
    """Price a run from its shape; refuses, naming the number, when one it needs is missing.

    `flops_*_per_token` default to the 2N / 6N rule when not given (no attention term).
    `trainable_params` (LoRA: the adapter) sizes the AdamW state; `reference_is_adapter_off` means
    the reference is the policy with its adapter disabled, so it holds no copy. `shared_prompt`:
    the reference and training forwards run each prompt once per group (P * Lp + P * G * T tokens).
    """
    for name, v in [("max_new_tokens", max_new_tokens), ("n_params", n_params),
                    ("prompts_per_step", prompts_per_step), ("samples_per_prompt", samples_per_prompt),
                    ("steps", steps), ("epochs_per_batch", epochs_per_batch), ("minibatches", minibatches),
                    ("sampling_rounds", sampling_rounds)]:
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"cannot price the run: {name} must be a known positive number, got {v!r}")
    if not isinstance(prompt_tokens, int) or prompt_tokens < 0:
        raise ValueError(f"cannot price the run: prompt_tokens must be a known number, got {prompt_tokens!r}")
    fwd = flops_fwd_per_token or 2 * n_params
    trn = flops_train_per_token or 6 * n_params
    P, G, T, Lp = prompts_per_step, samples_per_prompt, max_new_tokens, prompt_tokens
    rows = P * G
    per_batch = rows * T
    grad_steps = epochs_per_batch * minibatches
    sampling_fwd = sampling_forward_tokens(P, Lp, rows * T)
    per_forward = logp_forward_tokens(rows, G, Lp, T, shared_prompt=shared_prompt)
    ref_fwd = per_forward if has_reference else 0
    trained = epochs_per_batch * per_forward
    policy = n_params * bytes_per_param
    return Price(
        prompts_per_step=P,
        samples_per_prompt=G,
        max_new_tokens=T,
        prompt_tokens=Lp,
        steps=steps,
        grad_steps_per_batch=grad_steps,
        sampling_rounds=sampling_rounds,
        n_params=n_params,
        has_reference=has_reference,
        reference_is_adapter_off=reference_is_adapter_off,
        sampled_tokens_per_batch=per_batch,
        sampled_tokens_per_grad_step=per_batch / grad_steps,
        sampled_tokens_per_run=per_batch * steps,
        sampled_tokens_per_run_worst=per_batch * steps * sampling_rounds,
        forward_tokens_sampling_per_batch=sampling_fwd,
        forward_tokens_logp_old_per_batch=0,
        forward_tokens_logp_ref_per_batch=ref_fwd,
        trained_tokens_per_batch=trained,
        forward_tokens_per_run=(sampling_fwd + ref_fwd) * steps,
        trained_tokens_per_run=trained * steps,
        flops_sampling_per_batch=float(sampling_fwd * fwd),
        flops_logp_ref_per_batch=float(ref_fwd * fwd),
        flops_train_per_batch=float(trained * trn),
        flops_per_run=float(((sampling_fwd + ref_fwd) * fwd + trained * trn) * steps),
        policy_bytes=policy,
        optimizer_bytes=2 * (n_params if trainable_params is None else trainable_params) * 4,
        reference_bytes=policy if has_reference and not reference_is_adapter_off else 0,
        logp_old_bytes=per_batch * 4,
    )
