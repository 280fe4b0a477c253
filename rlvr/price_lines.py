"""The price's lines as `rlvr price` prints them and `rlvr train` before its first step (rlvr.costs.Price)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlvr.costs import Price


def memory_line(p: Price) -> str:
    """The predicted peak and its parts, in MiB."""
    mib = 1 / 2**20
    measured = (f"; a learn part at the cap measured {p.memory_learn_measured_bytes * mib:,.0f} MiB resident at its "
                f"peak, the allocator's free-but-kept memory included); the count of tensors says "
                f"~{p.memory_counted_peak_bytes * mib:,.0f} MiB" if p.memory_learn_measured_bytes else ")")
    return (f"price: memory peak ~{p.memory_peak_bytes * mib:,.0f} MiB (during {p.memory_peak_phase}{measured} = "
            f"process {p.memory_baseline_bytes * mib:,.0f} + policy {p.policy_bytes * mib:,.0f} + "
            f"reference {p.reference_bytes * mib:,.0f} + AdamW {p.optimizer_bytes * mib:,.1f} + "
            f"gradients {p.memory_gradient_bytes * mib:,.1f} + "
            + (f"bf16 copies of the frozen weights {p.memory_kept_copy_bytes * mib:,.0f} + "
               if p.memory_kept_copy_bytes else "")
            + f"the largest of: training activations "
            f"{p.memory_activation_bytes * mib:,.0f} + logits {p.memory_logits_bytes * mib:,.0f}, "
            f"sampling KV cache {p.memory_kv_cache_bytes * mib:,.0f}, evaluation KV cache "
            f"{p.memory_eval_kv_cache_bytes * mib:,.0f}, export copy {p.memory_export_bytes * mib:,.0f}"
            + (f"; each but export with bf16 weight copies {p.memory_weight_copy_bytes * mib:,.0f}"
               if p.memory_weight_copy_bytes else ""))


def length_phrase(p: Price) -> str:
    """Which response length the counts and the expected wall time assume: the cap, or the expected
    length the config gives (sampling.expected_response_tokens)."""
    if p.expected_response_tokens:
        return (f"at an expected {p.expected_response_tokens:,} tokens a response "
                f"(sampling.expected_response_tokens; cap {p.max_new_tokens:,})")
    return f"at the {p.max_new_tokens:,}-token cap"


def lines(p: Price) -> list[str]:
    """The price as printed by `rlvr price` and before the first step of `rlvr train`."""
    mib = 1 / 2**20
    worst = ""
    if p.sampling_rounds > 1:
        worst = (f"; worst case with dynamic sampling ({p.sampling_rounds} rounds) "
                 f"{p.sampled_tokens_per_run_worst:,}")
    copies = [f"policy {p.policy_bytes * mib:.2f} MiB", f"AdamW state {p.optimizer_bytes * mib:.2f} MiB"]
    if not p.has_reference:
        copies.append("no reference (kl_coef = 0)")
    elif p.reference_is_adapter_off:
        copies.append("reference = the policy with its LoRA adapter disabled (no copy)")
    else:
        copies.append(f"reference {p.reference_bytes * mib:.2f} MiB")
    copies.append(
        f"stored logp_old {p.logp_old_bytes * mib:.3f} MiB instead of a π_old copy "
        f"({p.policy_bytes * mib:.2f} MiB, saving {(p.policy_bytes - p.logp_old_bytes) * mib:.2f} MiB)"
    )
    what = ("its entropies for top_entropy_quantile, logp_old stored from the sampler"
            if p.entropy_forward and not p.logp_old_recomputed else "recomputed under the training numerics"
            + (", with the entropies for top_entropy_quantile" if p.entropy_forward else ""))
    logp_old = (f"{p.flops_logp_old_per_batch:.3g} FLOP, the learner's forwards at π_old, detached: the "
                "first minibatch's own, the others' over their own parts before the first update"
                if p.forward_tokens_logp_old_per_batch and p.logp_old_from_learner else
                f"{p.flops_logp_old_per_batch:.3g} FLOP, {what}"
                if p.forward_tokens_logp_old_per_batch else
                "the learner's first forward, detached" if p.logp_old_from_learner else
                "stored from the sampler")
    if p.logp_old_note:
        logp_old += f"; {p.logp_old_note}"
    return [
        f"price: sampled tokens per gradient step = {p.sampled_tokens_per_grad_step:,.0f} "
        f"(P={p.prompts_per_step} x G={p.samples_per_prompt} x "
        + (f"an expected {p.expected_response_tokens} tokens, sampling.expected_response_tokens, T<={p.max_new_tokens} "
           if p.expected_response_tokens else f"T<={p.max_new_tokens} ")
        + f"/ {p.grad_steps_per_batch} gradient steps per batch)",
        f"price: sampled tokens per batch = {p.sampled_tokens_per_batch:,}; "
        f"per run ({p.steps} steps) = {p.sampled_tokens_per_run:,}{worst}",
        f"price: forward tokens per batch: sampling {p.forward_tokens_sampling_per_batch:,} "
        f"({p.flops_sampling_per_batch:.3g} FLOP), logp_old {p.forward_tokens_logp_old_per_batch:,} "
        f"({logp_old}), logp_ref {p.forward_tokens_logp_ref_per_batch:,} "
        f"({p.flops_logp_ref_per_batch:.3g} FLOP); trained tokens {p.trained_tokens_per_batch:,} "
        f"({p.flops_train_per_batch:.3g} FLOP)",
        f"price: per run: {p.forward_tokens_per_run:,} forward + {p.trained_tokens_per_run:,} trained tokens, "
        f"{p.flops_per_run:.3g} FLOP ({'expectation' if p.expected_response_tokens else 'cap'}-based: "
        f"{length_phrase(p)})",
        f"price: model copies held: {'; '.join(copies)}; parameters {p.n_params:,}",
    ] + ([f"price: tool calls: sampling forwards priced with {p.tool_calls} continuation(s) per response, "
          f"each over its whole context (the most they can take: a continuation appends to the first round's "
          f"KV cache where that computes less; sampled tokens stay within T)"]
         if p.tool_calls else []) + ([f"price: numerics: {p.numerics}"] if p.numerics else []) \
        + ([wall_line(p)] if p.matmul_flops_per_s else []) + ([memory_line(p)] if p.memory_peak_bytes else [])


def wall_line(p: Price) -> str:
    """The wall-time lower bound at the measured matmul rate and, where a decode step was measured, the
    expected wall time and what it counts."""
    worst = (f" ({p.wall_seconds_estimate * p.sampling_rounds:,.1f} s in the worst case of dynamic sampling)"
             if p.sampling_rounds > 1 else "")
    line = (f"price: wall time >= {p.wall_seconds_estimate:,.1f} s{worst} on this machine "
            f"({p.flops_per_run:.3g} FLOP at a measured {p.matmul_kind} matmul rate of "
            f"{p.matmul_flops_per_s / 1e9:.1f} GFLOP/s with {p.threads} threads); a lower bound: "
            f"sampling is bound by memory bandwidth and per-token overhead, not by matmul speed")
    if not p.wall_seconds_expected:
        return line
    rounds = 1 + p.tool_calls
    return (f"{line}; expected ~{p.wall_seconds_expected:,.1f} s {length_phrase(p)}, with "
            + (_expected_decode(p) if p.expected_response_tokens else
               f"each of the {rounds * (p.max_new_tokens - 1)} decode steps per batch"
               + (f" ({rounds} sampling rounds: the first and {p.tool_calls} tool continuation(s))"
                  if p.tool_calls else ""))
            + f" at the measured {p.decode_step_s * 1e3:,.3g} ms "
            + (f"+ {p.decode_cell_s * 1e6:,.3g} us a row for each column it has cached (measured after a longer "
               "prompt) " if p.decode_cell_s else "")
            + (f"({_probe_rows(p)} rows)" if not p.rollout_workers else
               f"(a rollout worker's largest share, {p.decode_prompts} prompts x {p.samples_per_prompt} = "
               f"{p.decode_prompts * p.samples_per_prompt} rows at {p.decode_threads} torch thread(s); "
               f"the {p.rollout_workers} workers decode side by side; Ray's calls and the weight syncs, "
               f"{p.sync_bytes / 2**20:,.2f} MiB after every update, not counted)")
            + (f" and each of the {p.steps * p.grad_steps_per_batch} gradient steps at the measured "
               f"{p.learn_parts_per_step} x {p.learn_part_s * 1e3:,.4g} ms (forward and backward"
               f"{' of each part' if p.learn_parts_per_step > 1 else ''}"
               + (f" at {p.max_new_tokens:,} response tokens; at the expected length a row computes "
                  f"{p.learn_part_tokens:,.0f} response columns on average (its part's longest row, or with "
                  f"train.length_buckets its bucket's, {p.learn_buckets_per_part:.1f} buckets a part), so "
                  f"{p.learn_part_fraction:.2f} such parts"
                  + (f" (a part at the expected lengths measured at {p.learn_expected_part_s * 1e3:,.4g} ms)"
                     if p.learn_expected_part_s else "")
                  if p.expected_response_tokens and p.learn_part_fraction else "")
               + (f" of one learner rank's share at {p.learn_threads} torch thread(s); the {p.learner_ranks} "
                  f"ranks side by side; their gradient all-reduce not counted" if p.learner_ranks > 1 else "")
               + f") + {p.optimizer_step_s * 1e3:,.3g} ms (optimizer)" if p.learn_part_s else "")
            + ", before evaluation and rewards")


def _probe_rows(p: Price) -> int:
    """Rows of the decode step measured: a rollout worker's share, or all P x G."""
    return (p.decode_prompts or p.prompts_per_step) * p.samples_per_prompt


def _expected_decode(p: Price) -> str:
    """The decode at an expected response length: the steps and rows it is priced at, and how a
    step's cost was split into a fixed part and a part per row."""
    split = (f" at {p.decode_fixed_s * 1e3:,.3g} ms + {p.decode_row_s * 1e3:,.3g} ms a row, from the line through "
             f"a step of {p.decode_small_prompts * p.samples_per_prompt} rows, {p.decode_small_step_s * 1e3:,.3g} ms, and"
             if p.decode_small_step_s else ", whatever its rows (no smaller step measured),")
    tools = (f", then {p.tool_calls} tool continuation(s) of {p.max_new_tokens - 1} full steps each"
             if p.tool_calls else "")
    return (f"{p.decode_steps_per_batch:,.1f} decode steps per batch expected (until its longest response "
            f"ends) computing {p.decode_rows_per_step:,.1f} rows a step on average (finished rows leave the "
            f"batch){tools}, each step{split}")
