"""The memory in the price (rlvr.memory_model.memory) by hand on a tiny shape, and the refusal of a run
that would not fit (rlvr.run_price.check_memory)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from rlvr import build as build_mod, config as config_mod, costs, memory_model, numerics as numerics_mod, run_price, setup_types

import pricing

SHAPE = memory_model.ModelShape(layers=2, hidden=8, mlp=32, heads=2, kv_heads=1, head_dim=4, vocab=10)
BASE = dict(prompts=2, group=3, prompt_len=4, response_len=2, minibatches=1, n_params=1000, trainable_params=100,
            has_reference_copy=False, baseline=1000)


def test_memory_by_hand():
    m = memory_model.memory(SHAPE, **BASE, eval_rows=5)
    # per layer and token: 6d + 4f + 2 Hkv D + H S = 48 + 128 + 8 + 2 * 6 = 196 floats
    # 6 rows x (4 + 2) tokens = 36 tokens, 2 layers, 4 bytes
    assert m.activations == 36 * 2 * 4 * 196 == 56448
    assert m.logits == 4 * (6 * 2 * 10 * 4) == 1920            # four (rows, T, V) float32 blocks
    # KV cache: 6 rows x 6 columns x 2 (k, v) x 1 kv head x 4 dims x 4 bytes = 1152 per layer, 2 + 1 layers;
    # decode logits 4 x 6 rows x 10 x 4 bytes
    assert m.kv_cache == 1152 * 3 + 960 == 4416
    assert m.eval_kv_cache == 960 * 3 + 800 == 3680              # 5 rows
    assert (m.policy, m.reference, m.optimizer, m.gradients) == (4000, 0, 800, 400)
    assert m.held == 1000 + 4000 + 800 + 400 == 6200
    assert m.peak == 6200 + 56448 + 1920 == 64568                # training is the largest phase


def test_memory_options_by_hand():
    shared = memory_model.memory(SHAPE, **BASE, shared_prompt=True)
    assert shared.activations == (2 * 4 + 6 * 2) * 2 * 4 * 196 == 31360   # P Lp + P G T tokens
    chunked = memory_model.memory(SHAPE, **BASE, logprob_chunk_rows=3)
    assert chunked.logits == 2 * 480 + 3 * 3 * 10 * 4 == 1320
    # under bf16 forwards the head's output and its gradient are bf16 (upcast a chunk at a time)
    assert memory_model.memory(SHAPE, **BASE, logprob_chunk_rows=3, logit_bytes=2).logits == 2 * 240 + 360 == 840
    # a chunk covering all 6 x 2 rows is the plain path: four float32 blocks
    for c in (12, 13):
        assert memory_model.memory(SHAPE, **BASE, logprob_chunk_rows=c, logit_bytes=2).logits == 1920
    # model.logprob_chunk_rows = -1 (auto) is priced at the rows rlvr.logprobs.auto_chunk_rows gives
    big = memory_model.ModelShape(layers=2, hidden=8, mlp=32, heads=2, kv_heads=1, head_dim=4, vocab=49152)
    assert run_price.priced_chunk_rows(-1, big) == 10 and run_price.priced_chunk_rows(-1, SHAPE) == 2 * 2**20 // 40
    assert run_price.priced_chunk_rows(0, big) == 0 and run_price.priced_chunk_rows(7, big) == 7 and run_price.priced_chunk_rows(-1, None) == 0
    ref = memory_model.memory(SHAPE, **{**BASE, "has_reference_copy": True})
    assert ref.reference == 4000 and ref.peak == memory_model.memory(SHAPE, **BASE).peak + 4000
    half = memory_model.memory(SHAPE, **BASE, bytes_per_param=2)
    assert half.policy == 2000 and half.activations == 56448 // 2 and half.logits == 1920  # logits stay float32
    two_mb = memory_model.memory(SHAPE, **{**BASE, "minibatches": 2})
    assert two_mb.activations == 3 * 6 * 2 * 4 * 196 and two_mb.logits == 4 * (3 * 2 * 10 * 4)
    export = memory_model.memory(SHAPE, **{**BASE, "n_params": 10**6}, export_copy=True)
    assert export.export_copy == 4 * 10**6 and export.peak == export.held + 4 * 10**6
    # bf16 weight copies (CPU bf16 autocast): in every forward phase, not in the export
    plain = memory_model.memory(SHAPE, **BASE, eval_rows=5)
    copies = memory_model.memory(SHAPE, **BASE, eval_rows=5, weight_copy_bytes=500)
    assert {k: copies.phases[k] - v for k, v in plain.phases.items()} == {
        "training": 500, "sampling": 500, "evaluation": 500, "export": 0}
    assert copies.peak == plain.peak + 500 and copies.held == plain.held
    # the frozen weights' copies, kept for the whole run: held in every phase, the export's too
    kept = memory_model.memory(SHAPE, **BASE, eval_rows=5, export_copy=True, kept_copy_bytes=300)
    no_kept = memory_model.memory(SHAPE, **BASE, eval_rows=5, export_copy=True)
    assert kept.held == no_kept.held + 300 and kept.phases == no_kept.phases and kept.peak == no_kept.peak + 300
    # tool continuations append to the first round's cache: 2 c T more columns (here c = 1: 6 -> 10)
    reserved = memory_model.memory(SHAPE, **BASE, eval_rows=5, cache_reserve=4)
    assert reserved.kv_cache == 6 * 10 * 2 * 4 * 4 * 3 + 960 and reserved.eval_kv_cache == 5 * 10 * 32 * 3 + 800
    p = pricing.price(prompts_per_step=2, samples_per_prompt=3, max_new_tokens=2, prompt_tokens=4, steps=1,
                    epochs_per_batch=1, minibatches=1, n_params=1000, has_reference=False, shape=SHAPE, tool_calls=1)
    assert p.memory_kv_cache_bytes == reserved.kv_cache


def test_price_carries_the_memory_line():
    p = pricing.price(prompts_per_step=2, samples_per_prompt=3, max_new_tokens=2, prompt_tokens=4, steps=1,
                    epochs_per_batch=1, minibatches=1, n_params=1000, trainable_params=100, has_reference=False,
                    shape=SHAPE, baseline_bytes=1000, eval_rows=5)
    assert p.memory_peak_bytes == 64568 and p.memory_peak_phase == "training"
    assert p.lines()[-1].startswith("price: memory peak ~0 MiB (during training)")
    json.dumps(p.to_dict())
    plain = pricing.price(prompts_per_step=2, samples_per_prompt=3, max_new_tokens=2, prompt_tokens=4, steps=1,
                        epochs_per_batch=1, minibatches=1, n_params=1000, has_reference=False)
    assert plain.memory_peak_bytes == 0 and not any("memory peak" in line for line in plain.lines())


def test_a_measured_learn_peak_stands_for_the_training_phase():
    """The count above: held 1000 + 4000 + 800 + 400 = 6,200 bytes, training 58,368, sampling's KV
    cache 4,416 (10,616 with what is held). A learn part's measured resident peak stands for training
    and everything held with it; the other phases keep their counts; the count's peak stays said."""
    kw = dict(prompts_per_step=2, samples_per_prompt=3, max_new_tokens=2, prompt_tokens=4, steps=1,
              epochs_per_batch=1, minibatches=1, n_params=1000, trainable_params=100, has_reference=False,
              shape=SHAPE, baseline_bytes=1000, eval_rows=5)
    p = pricing.price(**kw, learn_peak_bytes=20_000)
    assert (p.memory_peak_bytes, p.memory_peak_phase) == (20_000, "training")
    assert (p.memory_counted_peak_bytes, p.memory_learn_measured_bytes) == (64_568, 20_000)
    assert "a learn part at the cap measured 0 MiB resident at its peak" in p.memory_line()
    assert "the count of tensors says ~0 MiB = process" in p.memory_line()
    p = pricing.price(**kw, learn_peak_bytes=9_000)                  # below what sampling needs
    assert (p.memory_peak_bytes, p.memory_peak_phase) == (10_616, "sampling")
    p = pricing.price(**kw)                                          # none measured: the count
    assert (p.memory_peak_bytes, p.memory_counted_peak_bytes, p.memory_learn_measured_bytes) == (64_568, 64_568, 0)
    assert "the count of tensors" not in p.memory_line()


def test_the_check_does_not_ask_again_for_what_the_process_holds(monkeypatch):
    """A measured peak of 8 GiB, 0.5 GiB held by the price's baseline, 2 GiB available: refused. With
    6.5 GiB already resident (memory the C library kept after the price's probes, which MemAvailable
    no longer counts), 1.5 GiB more fits; what is resident counts up to the peak at most."""
    cfg = config_mod.load(None, [])
    monkeypatch.setattr(costs, "available_bytes", lambda: 2 * 2**30)
    measured = _price(8.0)
    measured.memory_learn_measured_bytes = measured.memory_peak_bytes
    with pytest.raises(setup_types.RunError, match="0.50 GiB already held, 7.50 GiB more"):
        run_price.check_memory(cfg, measured, resident=2**30 // 4)
    run_price.check_memory(cfg, measured, resident=int(6.5 * 2**30))
    run_price.check_memory(cfg, measured, resident=20 * 2**30)
    # a counted peak counts the baseline the price measured, whatever is resident now
    with pytest.raises(setup_types.RunError, match="0.50 GiB already held, 7.50 GiB more"):
        run_price.check_memory(cfg, _price(8.0), resident=int(6.5 * 2**30))


def test_the_resident_peak_covers_what_the_block_allocated_and_freed():
    from rlvr.procmem import ResidentPeak, resident_bytes

    import mmap

    size = 64 * 2**20
    before = resident_bytes()
    with ResidentPeak(interval=0.001) as peak:
        m = mmap.mmap(-1, size)        # fresh pages whatever the C library's allocator keeps (train.host_memory)
        for i in range(0, size, mmap.PAGESIZE):
            m[i] = 1                                                # each page written, so resident
        time.sleep(0.05)
        m.close()
    assert peak.peak >= before + 48 * 2**20
    assert resident_bytes() < peak.peak


def _price(peak_gib: float) -> costs.Price:
    p = pricing.price(prompts_per_step=2, samples_per_prompt=3, max_new_tokens=2, prompt_tokens=4, steps=1,
                    epochs_per_batch=1, minibatches=1, n_params=1000, has_reference=False, shape=SHAPE)
    p.memory_peak_bytes = int(peak_gib * 2**30)
    p.memory_baseline_bytes = 2**30 // 2
    return p


def test_a_run_that_does_not_fit_is_refused_naming_the_numbers(monkeypatch):
    cfg = config_mod.load(None, [])
    monkeypatch.setattr(costs, "available_bytes", lambda: 2 * 2**30)
    with pytest.raises(setup_types.RunError) as e:
        run_price.check_memory(cfg, _price(8.0))
    msg = str(e.value)
    assert "8.00 GiB at its peak" in msg and "2.00 GiB available" in msg and "train.memory_check = false" in msg
    run_price.check_memory(cfg, _price(2.4))          # 0.5 GiB already held: 1.9 GiB more fits in 2
    run_price.check_memory(config_mod.load(None, ["--train.memory_check=false"]), _price(8.0))


def test_the_refusal_names_the_micro_batches_that_fit(monkeypatch):
    """Training does not fit: activations 6 GiB + logits 2 GiB over 0.5 GiB held, 3.5 GiB available.
    Two parts need 0.5 + 4 > 4 GiB; three (2.67 GiB of training) are the fewest that fit."""
    cfg = config_mod.load(None, ["--train.prompts_per_step=8"])
    monkeypatch.setattr(costs, "available_bytes", lambda: 3.5 * 2**30)
    p = _price(8.5)
    p.policy_bytes = p.reference_bytes = p.optimizer_bytes = p.memory_gradient_bytes = p.memory_weight_copy_bytes = 0
    p.memory_activation_bytes, p.memory_logits_bytes, p.memory_kv_cache_bytes = 6 * 2**30, 2 * 2**30, 2**30
    p.memory_eval_kv_cache_bytes = p.memory_export_bytes = 0
    p.memory_peak_phase = "training"
    assert p.peak_in_parts(1) == p.memory_peak_bytes and p.peak_in_parts(4) == int(2.5 * 2**30)
    with pytest.raises(setup_types.RunError) as e:
        run_price.check_memory(cfg, p)
    assert ("With train.micro_batches = 3 (the same update, 3 forward/backward parts a minibatch) the predicted "
            "peak is 3.17 GiB, which fits." in str(e.value))
    assert "model.gradient_checkpointing" not in str(e.value)                # the built-in model has none
    with pytest.raises(setup_types.RunError, match="model.gradient_checkpointing = true, or set train.memory_check"):
        run_price.check_memory(config_mod.load(None, ["--train.prompts_per_step=8", "--model.path=some/hf-model"]), p)
    p.memory_kv_cache_bytes = 5 * 2**30                                     # sampling would not fit either
    with pytest.raises(setup_types.RunError) as e:
        run_price.check_memory(cfg, p)
    assert "With train.micro_batches" not in str(e.value)


def test_a_gpu_run_whose_first_update_does_not_fit_is_refused():
    """On CUDA: reference copy + AdamW moments + gradients (16 bytes per trainable parameter with
    the reference) against the device's free memory; CPU runs and memory_check = false skip it."""
    cfg = config_mod.load(None, [])
    cuda = torch.device("cuda")
    p = pricing.price(prompts_per_step=2, samples_per_prompt=3, max_new_tokens=2, prompt_tokens=4, steps=1,
                    epochs_per_batch=1, minibatches=1, n_params=2**28, has_reference=True)   # full FT, KL on
    # 2**28 parameters: reference 1 GiB + AdamW 2 GiB + gradients 1 GiB = 4 GiB by the first update
    assert (p.reference_bytes, p.optimizer_bytes) == (2**30, 2 * 2**30)
    with pytest.raises(setup_types.RunError) as e:
        run_price.check_device_memory(cfg, p, cuda, free=3 * 2**30)
    msg = str(e.value)
    assert ("allocates 4.00 GiB more on the GPU by its first update (reference copy 1.00 + AdamW moments 2.00 + "
            "gradients 1.00 GiB" in msg and "only 3.00 GiB are free" in msg and "train.memory_check = false" in msg)
    run_price.check_device_memory(cfg, p, cuda, free=4 * 2**30)                          # fits exactly
    run_price.check_device_memory(config_mod.load(None, ["--train.memory_check=false"]), p, cuda, free=0)
    run_price.check_device_memory(cfg, p, torch.device("cpu"), free=0)                   # the CPU has check_memory
    sharded = config_mod.load(None, ["--distributed.learners=2", "--distributed.sharding=fsdp2"])
    run_price.check_device_memory(sharded, p, cuda, free=2 * 2**30)                      # each of 2 GPUs holds half
    with pytest.raises(setup_types.RunError):
        run_price.check_device_memory(config_mod.load(None, ["--distributed.learners=2"]), p, cuda, free=2 * 2**30)


def test_training_refuses_before_writing_anything(monkeypatch, tmp_path):
    from rlvr.trainer import train

    cfg = config_mod.load(None, ["--task.path=rlvr.tasks.sort:sort_task", "--task.options={n = 3, heldout = 20}",
                                 "--model.n_embd=16", "--model.n_layer=1", "--model.n_head=2", "--train.steps=1",
                                 "--train.prompts_per_step=2", "--train.samples_per_prompt=2",
                                 "--task.reward_workers=0"])
    monkeypatch.setattr(costs, "available_bytes", lambda: 1)
    with pytest.raises(setup_types.RunError, match="MemAvailable"):
        train(cfg, tmp_path / "run", log=lambda *a: None)
    assert not (tmp_path / "run").exists()
    # the GPU check is asked too, with the run's device and price, before anything is written
    import rlvr.trainer as trainer_mod

    monkeypatch.setattr(costs, "available_bytes", lambda: 2**40)
    asked = []

    def gpu_check(cfg_, price, device):
        asked.append((device.type, price.optimizer_bytes))
        raise setup_types.RunError("no room on the GPU")
    monkeypatch.setattr(trainer_mod, "check_device_memory", gpu_check)
    with pytest.raises(setup_types.RunError, match="no room on the GPU"):
        train(cfg, tmp_path / "run", log=lambda *a: None)
    assert asked and asked[0][0] == "cpu" and asked[0][1] > 0 and not (tmp_path / "run").exists()


def test_price_of_a_real_setup_predicts_memory():
    cfg_args = ["--task.path=rlvr.tasks.sort:sort_task", "--task.options={n = 3, heldout = 20}",
                "--model.n_embd=16", "--model.n_layer=1", "--model.n_head=2",
                "--train.prompts_per_step=2", "--train.samples_per_prompt=2", "--eval.pass_k=0"]
    setup = build_mod.build(config_mod.load(None, cfg_args), log=lambda *a: None)
    shape = numerics_mod.model_shape(setup.model)
    assert shape == memory_model.ModelShape(layers=1, hidden=16, mlp=64, heads=2, kv_heads=2, head_dim=8,
                                     vocab=setup.model.config.vocab_size)
    assert run_price.eval_rows(setup) == 20
    p = run_price.price_of(setup)
    assert p.memory_baseline_bytes >= setup.baseline_bytes > 0
    assert p.memory_peak_bytes > p.memory_baseline_bytes + p.policy_bytes
    assert p.memory_weight_copy_bytes == 0 and "bf16 weight copies" not in p.memory_line()
    bf16 = build_mod.build(config_mod.load(None, cfg_args + ["--model.autocast=bf16"]), log=lambda *a: None)
    pb = run_price.price_of(bf16)            # each forward region holds 2-byte copies of the trainable weights
    n = bf16.model.num_params()
    assert sum(p.numel() for p in bf16.model.trainable_params()) == n   # all of them here
    assert pb.memory_weight_copy_bytes == 2 * n > 0
    assert f"bf16 weight copies {pb.memory_weight_copy_bytes / 2**20:,.0f}" in pb.memory_line()
    # and the frozen ones' copies are kept: here a KL reference's (2 a parameter)
    ref = run_price.price_of(build_mod.build(config_mod.load(None, cfg_args + ["--model.autocast=bf16", "--algorithm.kl_coef=0.1"]),
                                 log=lambda *a: None))
    assert pb.memory_kept_copy_bytes == 0 and ref.memory_kept_copy_bytes == 2 * n
    assert (ref.memory_peak_bytes - ref.memory_baseline_bytes
            == pb.memory_peak_bytes - pb.memory_baseline_bytes + ref.reference_bytes + 2 * n)
    assert f"bf16 copies of the frozen weights {2 * n / 2**20:,.0f}" in ref.memory_line()
