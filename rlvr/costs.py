"""The price of a run, computed before it starts (seed 000: "Price this one in sampled tokens").

Arithmetic on counters, nanoGPT `estimate_mfu` style; no sampling, no model forward.

    sampled tokens per batch          = P * G * T_max            (T_max: response-length bound)
    sampled tokens per gradient step  = P * G * T_max / (μ * minibatches)
    sampled tokens per run            = steps * P * G * T_max

Model copies held: the policy, AdamW's two moments, a reference policy only when the KL term is on,
and the stored old log-probs (P*G*T_max floats) that stand in for a π_old snapshot.
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
    n_params: int
    has_reference: bool
    sampled_tokens_per_batch: int
    sampled_tokens_per_grad_step: float
    sampled_tokens_per_run: int
    policy_bytes: int
    optimizer_bytes: int
    reference_bytes: int
    logp_old_bytes: int

    def lines(self) -> list[str]:
        """The price as printed before the first step."""
        mib = 1 / 2**20
        copies = [f"policy {self.policy_bytes * mib:.2f} MiB", f"AdamW state {self.optimizer_bytes * mib:.2f} MiB"]
        copies.append(f"reference {self.reference_bytes * mib:.2f} MiB" if self.has_reference else "no reference (kl_coef = 0)")
        copies.append(
            f"stored logp_old {self.logp_old_bytes * mib:.3f} MiB instead of a π_old copy "
            f"({self.policy_bytes * mib:.2f} MiB)"
        )
        return [
            f"price: sampled tokens per gradient step = {self.sampled_tokens_per_grad_step:,.0f} "
            f"(P={self.prompts_per_step} x G={self.samples_per_prompt} x T<={self.max_new_tokens} "
            f"/ {self.grad_steps_per_batch} gradient steps per batch)",
            f"price: sampled tokens per batch = {self.sampled_tokens_per_batch:,}; "
            f"per run ({self.steps} steps) = {self.sampled_tokens_per_run:,}",
            f"price: model copies held: {'; '.join(copies)}; parameters {self.n_params:,}",
        ]

    def to_dict(self) -> dict:
        return asdict(self)


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
    bytes_per_param: int = 4,
) -> Price:
    """Price a run from its shape; refuses when a number it needs is missing or unbounded."""
    for name, v in [("max_new_tokens", max_new_tokens), ("n_params", n_params),
                    ("prompts_per_step", prompts_per_step), ("samples_per_prompt", samples_per_prompt),
                    ("steps", steps), ("epochs_per_batch", epochs_per_batch), ("minibatches", minibatches)]:
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"cannot price the run: {name} must be a known positive number, got {v!r}")
    rows = prompts_per_step * samples_per_prompt
    per_batch = rows * max_new_tokens
    grad_steps = epochs_per_batch * minibatches
    policy = n_params * bytes_per_param
    return Price(
        prompts_per_step=prompts_per_step,
        samples_per_prompt=samples_per_prompt,
        max_new_tokens=max_new_tokens,
        prompt_tokens=prompt_tokens,
        steps=steps,
        grad_steps_per_batch=grad_steps,
        n_params=n_params,
        has_reference=has_reference,
        sampled_tokens_per_batch=per_batch,
        sampled_tokens_per_grad_step=per_batch / grad_steps,
        sampled_tokens_per_run=per_batch * steps,
        policy_bytes=policy,
        optimizer_bytes=2 * n_params * 4,
        reference_bytes=policy if has_reference else 0,
        logp_old_bytes=per_batch * 4,
    )
