"""The glue between a built run and its price (rlvr.costs): the run's shape and what was measured at
start-up (the matmul rate, a decode step, the learn stage's parts) gathered into `price_of`, and the
refusals of a run whose predicted memory does not fit (`check_memory`, `check_device_memory`).
"""

from __future__ import annotations

import torch

from rlvr import config as config_mod, costs, learn, logprobs, machine, memory_model, probes, sampling
from rlvr.models.lean_llama import decode_reads_packs
from rlvr.numerics import model_shape
from rlvr.setup_types import RunError, Setup, bf16_forwards, logp_old_note, shares_prompt



def priced_chunk_rows(setting: int, shape: memory_model.ModelShape | None) -> int:
    """``model.logprob_chunk_rows`` as the memory price counts it (CPU runs, where ``shape`` is
    known): -1 (auto) -> rlvr.logprobs.auto_chunk_rows for the vocabulary, else the setting."""
    if setting != -1:
        return setting
    return logprobs.auto_chunk_rows(shape.vocab, "cpu") if shape is not None else 0


def eval_rows(setup: Setup) -> int:
    """Rows one evaluation decode holds at once: greedy, min(prompts, eval.batch_size); pass@k,
    k per prompt for eval.batch_size // k prompts (rlvr.evaluate)."""
    ec = setup.cfg.eval
    prompts = min(ec.prompts or len(setup.task.heldout), len(setup.task.heldout))
    rows = min(prompts, max(1, ec.batch_size))
    if ec.pass_k:
        rows = max(rows, min(prompts, ec.pass_k_prompts, max(1, ec.batch_size // ec.pass_k)) * ec.pass_k)
    return rows


def price_of(setup: Setup, rate: float | None = None, decode_s: float | None = None,
             learn_s: tuple[float, ...] | None = None, probe_learn: bool = False,
             decode_small: tuple[float, int] | None = None) -> costs.Price:
    """The price of the run `setup` describes (rlvr.costs), before it starts, with a wall-time
    estimate against `rate` FLOP/s (default: `matmul_rate` measured on the run's device) and an
    expected wall time with every decode step at `decode_s` seconds (default: `decode_step_seconds`
    measured on the run's policy) and the learn stage at `learn_s` (a part's forward and backward,
    an optimizer step, and optionally a call's fixed cost; with `probe_learn`, as the trainer and
    `rlvr price` ask, measured by
    rlvr.learn.learn_part_seconds only where the run's predicted memory fits, `check_memory` and
    `check_device_memory`, so a run that will be refused computes nothing more; without it, or
    (0, 0): the training FLOPs at the rate). `train.price_probes = false` runs neither default probe:
    no decode step measured, so no expected wall time, only the FLOP lower bound. Its memory
    baseline is the larger of the resident set before the policy was loaded (`setup.baseline_bytes`)
    and the resident set now less the policy's weights (what was loaded since: tokenizer, imports).
    With sampling.expected_response_tokens below the bound the price assumes that mean response
    length (rlvr.costs.length_survival), and a second decode step of fewer rows is measured with the
    first (`decode_small`: its (seconds, prompts) given instead; probes.decode_small_prompts) to split a
    step's cost into a fixed part and a part per row. With the decode step measured here, a step
    after a longer prompt is measured too (probes.decode_column_seconds): what each column a row has
    cached adds to a step."""
    cfg, model = setup.cfg, setup.model
    T, expected_len = setup.limits.max_new_tokens, cfg.sampling.expected_response_tokens
    at_expected = 0 < expected_len < T
    fwd, trn = costs.model_flops_per_token(model, setup.limits.prompt_tokens, expected_len if at_expected else T)
    bytes_per_param = 2 if cfg.model.path and cfg.model.dtype == "bf16" else 4
    on_cpu = setup.device.type == "cpu"
    speedup = setup.numerics.matmul_speedup()       # the wall-time estimate at the rate the run computes at
    kept_copies, phase_copies = (bf16_copy_bytes(model, cfg.algorithm.kl_coef > 0 and not model.has_adapter)
                                 if on_cpu and setup.numerics.bf16 else (0, 0))
    baseline = max(setup.baseline_bytes,
                   costs.resident_bytes() - (model.num_params() * bytes_per_param if on_cpu else 0))
    shape = model_shape(model) if on_cpu else None
    run_shape = costs.RunShape(
        prompts_per_step=cfg.train.prompts_per_step, samples_per_prompt=cfg.train.samples_per_prompt,
        max_new_tokens=setup.limits.max_new_tokens,
        prompt_tokens=setup.limits.prompt_tokens,
        steps=cfg.train.steps, epochs_per_batch=cfg.train.epochs_per_batch, minibatches=cfg.train.minibatches,
        micro_batches=cfg.train.micro_batches, n_params=model.num_params(), has_reference=cfg.algorithm.kl_coef > 0,
        trainable_params=sum(p.numel() for p in model.trainable_params()),
        reference_is_adapter_off=model.has_adapter,
        shared_prompt=shares_prompt(cfg, model),
        bytes_per_param=bytes_per_param,
        flops_fwd_per_token=fwd, flops_train_per_token=trn,
        sampling_rounds=cfg.algorithm.dynamic_sampling_rounds if cfg.algorithm.dynamic_sampling else 1,
        recompute_logp_old=setup.recompute_logp_old and not setup.logp_old_from_learner,
        logp_old_from_learner=setup.logp_old_from_learner, logp_old_note=logp_old_note(cfg, setup.numerics),
        entropy_forward=cfg.algorithm.top_entropy_quantile < 1, tool_calls=setup.limits.tool_calls,
        expected_response_tokens=expected_len if at_expected else 0, length_buckets=cfg.train.length_buckets,
        compact_finished=compact_finished(cfg, setup.limits.tool_calls),
    )
    probing = decode_s is None and cfg.train.price_probes
    decode_s = (probes.decode_step_seconds(setup) if cfg.train.price_probes else 0.0) if decode_s is None else decode_s
    cell = probes.decode_column_seconds(setup, decode_s) if probing else 0.0
    if decode_small is None and at_expected and decode_s and cfg.train.price_probes:
        few = probes.decode_small_prompts(setup)
        decode_small = (probes.decode_step_seconds(setup, prompts=few), few) if few else None
    measured = costs.Measured(
        matmul_flops_per_s=(machine.matmul_rate(setup.device) if rate is None else rate) * speedup,
        matmul_kind="bf16 autocast" if speedup != 1.0 else "fp32", threads=torch.get_num_threads(),
        decode_step_s=decode_s, numerics=setup.numerics.describe(), decode_cell_s=cell,
        **({} if decode_small is None else dict(decode_small_step_s=decode_small[0],
                                                decode_small_prompts=decode_small[1])),
    )
    so = scale_out(setup)
    mem = None if shape is None else costs.MemoryInputs(
        shape, baseline_bytes=baseline, logprob_chunk_rows=priced_chunk_rows(cfg.model.logprob_chunk_rows, shape),
        logit_bytes=2 if bf16_forwards(cfg, setup.numerics) else 4, eval_rows=eval_rows(setup),
        export_copy=model.has_adapter, kept_copy_bytes=kept_copies, weight_copy_bytes=phase_copies,
    )
    first = costs.price(run_shape, measured, mem, so)
    if learn_s is None and probe_learn and cfg.train.price_probes:
        try:
            check_memory(cfg, first)
            check_device_memory(cfg, first, setup.device)
        except RunError:
            return first       # refused by the caller's checks; nothing more is computed
        learn_s = learn.learn_part_seconds(setup) if first.wall_seconds_expected else (0.0, 0.0)
    if learn_s is None or not learn_s[0]:
        return first
    return costs.price(run_shape, measured.with_learn(*learn_s), mem, so)


def compact_finished(cfg: config_mod.Config, tool_calls: int) -> float | None:
    """rlvr.sampling.COMPACT_FINISHED where the run's decode drops finished rows from its batch, for
    the price at an expected response length; None where it does not (a graphed decode,
    model.cuda_graphs; tool calls, whose continuations need every row's cache)."""
    return None if cfg.model.cuda_graphs or tool_calls else sampling.COMPACT_FINISHED


def scale_out(setup: Setup) -> costs.ScaleOut:
    """What the price needs of the run's rollout workers and learner group (rlvr.distributed)."""
    d, model = setup.cfg.distributed, setup.model
    return costs.ScaleOut(
        rollout_workers=d.rollout_workers, learner_ranks=d.learners,
        decode_share=probes.decode_probe_share(setup) if d.rollout_workers else None,
        learn_share=probes.learn_probe_share(setup) if d.learners > 1 else None,
        sync_bytes=(sum(p.numel() * p.element_size() for _, p in model.named_parameters() if p.requires_grad)
                    if d.rollout_workers else 0))   # rlvr.distributed.sync.trainable_state's bytes


def bf16_copy_bytes(model, reference_copy: bool) -> tuple[int, int]:
    """(bytes kept for the whole run, bytes held in each forward phase) of the bf16 weight copies of
    CPU bf16 autocast (rlvr.models.lean_llama.bf16_weights): 2 a frozen parameter kept, twice that
    where decode reads them prepacked too (lean_llama.decode_reads_packs), 2 a parameter of a
    `reference_copy` kept; 2 a trainable parameter in each forward phase."""
    trainable = sum(p.numel() for p in model.trainable_params())
    frozen = model.num_params() - trainable
    kept = 2 * frozen * (2 if decode_reads_packs() else 1) + (2 * model.num_params() if reference_copy else 0)
    return kept, 2 * trainable


def check_memory(cfg: config_mod.Config, price: costs.Price, available: int | None = None,
                 resident: int | None = None) -> None:
    """Refuse (RunError naming the numbers) a run whose predicted peak (`price.memory_peak_bytes`)
    needs more memory than the machine has available (MemAvailable; `available` overrides it).
    What the process already holds is not asked for again: the baseline and the loaded policy, or,
    where the peak is a measured resident set (`price.memory_learn_measured_bytes`), which counts
    everything the process held then, its resident set now where larger (`resident` overrides it:
    what the C library kept of the probes' memory, which MemAvailable no longer counts).
    `train.memory_check = false` turns the check off; so does a price without a memory prediction."""
    if not cfg.train.memory_check or not price.memory_peak_bytes:
        return
    available = costs.available_bytes() if available is None else available
    if available is None:
        return
    held = price.memory_baseline_bytes + price.policy_bytes
    if price.memory_learn_measured_bytes:
        resident = costs.resident_bytes() if resident is None else resident
        held = max(held, min(resident, price.memory_peak_bytes))
    needed = price.memory_peak_bytes - held
    if needed > available:
        gib = 1 / 2**30
        raise RunError(
            f"this run needs about {price.memory_peak_bytes * gib:.2f} GiB at its peak (during "
            f"{price.memory_peak_phase}; {held * gib:.2f} GiB already held, {needed * gib:.2f} GiB more), but the "
            f"machine has {available * gib:.2f} GiB available (MemAvailable).{_parts_that_fit(cfg, price, held + available)}"
            f" Lower train.prompts_per_step, train.samples_per_prompt or sampling.max_new_tokens, raise "
            f"train.micro_batches (the same update) or train.minibatches, set model.logprob_chunk_rows"
            f"{', model.gradient_checkpointing = true' if cfg.model.path and not cfg.model.gradient_checkpointing else ''}"
            f", or set train.memory_check = false to start anyway ({price.memory_line()})")


def _parts_that_fit(cfg: config_mod.Config, price: costs.Price, limit: int) -> str:
    """A sentence naming the fewest train.micro_batches whose predicted peak fits under `limit` bytes,
    when training is the phase that does not fit and some count (whole groups a part) does; else ""."""
    t = cfg.train
    if price.memory_peak_phase != "training":
        return ""
    for k in range(t.micro_batches + 1, t.prompts_per_step // t.minibatches + 1):
        peak = price.peak_in_parts(k / t.micro_batches)
        if peak <= limit:
            return (f" With train.micro_batches = {k} (the same update, {k} forward/backward parts a minibatch) "
                    f"the predicted peak is {peak / 2**30:.2f} GiB, which fits.")
    return ""


def check_device_memory(cfg: config_mod.Config, price: costs.Price, device: torch.device,
                        free: int | None = None) -> None:
    """On a GPU (where the price predicts no peak: `check_memory` covers the CPU's resident set),
    refuse (RunError naming the numbers) a run whose copies allocated after the policy loaded do not
    fit the device's free memory (`free` overrides the measurement, `cuda_free_bytes`): the
    reference copy (KL on without LoRA), AdamW's two moments and the gradients, 16 bytes per
    trainable parameter with the reference, all held from the first update on. Activations, logits
    and the KV cache come on top and are not predicted here, so passing this check is no promise.
    Under `distributed.sharding = fsdp2` with N learners each GPU holds 1/N of these. Other devices,
    and `train.memory_check = false`, skip it."""
    if not cfg.train.memory_check or device.type != "cuda":
        return
    free = machine.cuda_free_bytes(device) if free is None else free
    gradients = price.optimizer_bytes // 2                       # 4 bytes per trainable parameter; AdamW holds 8
    later = price.reference_bytes + price.optimizer_bytes + gradients
    dc = cfg.distributed
    if dc.sharding == "fsdp2" and dc.learners > 1:
        later //= dc.learners
    if later > free:
        gib = 1 / 2**30
        raise RunError(
            f"train.device = {device}: this run allocates {later * gib:.2f} GiB more on the GPU by its first update "
            f"(reference copy {price.reference_bytes * gib:.2f} + AdamW moments {price.optimizer_bytes * gib:.2f} + "
            f"gradients {gradients * gib:.2f} GiB; activations, logits and the KV cache come on top), but only "
            f"{free * gib:.2f} GiB are free there (policy {price.policy_bytes * gib:.2f} GiB already loaded). "
            "Train a LoRA adapter (model.lora_r), set model.dtype = bf16, use a GPU with more memory or shard "
            "over several (distributed.sharding = fsdp2), or set train.memory_check = false to start anyway")


