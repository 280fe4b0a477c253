"""Time per GRPO step: TRL's ``GRPOTrainer`` against rlvr, same model, same prompts, same CPU.

    python benchmarks/vs_trl.py                      # both libraries, both model sizes
    python benchmarks/vs_trl.py --only trl           # TRL alone (no rlvr HF support needed)
    python benchmarks/vs_trl.py --sizes small --blocks 2 --json runs/vs_trl.json

What is compared
----------------
* Model: a tiny ``LlamaForCausalLM`` built here from a fixed seed and saved with
  ``save_pretrained`` (safetensors) in a temporary directory; both libraries load the SAME
  weights and tokenizer from that path. ``small`` = 2 layers, hidden 128, 4 heads, MLP 512;
  ``large`` = 4 layers, hidden 256, 4 heads, MLP 1024 (intermediate = 4 x hidden). 4 kv heads
  (no GQA), untied lm_head, max_position_embeddings 32, sdpa attention, fp32.
* Tokenizer: ``tokenizers`` WordLevel over the characters ``0123456789=`` plus ``<pad>`` (0),
  ``<bos>`` (1), ``<eos>`` (2), ``<unk>`` (3), one token per character, a ``<bos> $A``
  post-processor (Llama style: both libraries prepend BOS to a prompt), wrapped as
  ``PreTrainedTokenizerFast`` with pad set and no chat template. Vocabulary 15.
* Task: rlvr's sort task with n = 6 (``rlvr.tasks.sort.sort_task(n=6)``): prompt ``"314159="``
  (8 tokens with BOS), reward ``position`` (rlvr's function, wrapped for TRL's
  ``reward_funcs`` signature), at most 7 response tokens (``max_completion_length=7`` /
  ``sampling.max_new_tokens=7``).
* Step: 8 prompts x 8 samples = 64 completions, KL on (beta = 0.04, so each step runs the
  reference forward), mu = 1 (one optimizer step per generation batch), lr 1e-5, temperature 1,
  top-p 1, fp32, CPU, no vLLM, ``--threads`` torch threads (default 2) for everything.
  TRL's ``gradient_checkpointing`` (GRPOConfig default True) is turned OFF so both do the same
  work (rlvr does not checkpoint; checkpointing re-runs the forward in the backward to save
  memory these models do not need); ``--trl-gradient-checkpointing`` keeps TRL's default.

Timing
------
* TRL: a ``TrainerCallback`` takes ``perf_counter`` at ``on_step_begin`` and ``on_step_end``:
  the wall time of one whole optimizer step (generation, reward, reference forward, loss,
  backward, clipping, AdamW, zero_grad). Fetching the 8 prompt rows from the dataloader and
  logging fall outside (both are negligible here).
* rlvr: ``time/step_s`` of each row of the run's ``metrics.jsonl`` (``rlvr.trainer.train``):
  sampling, scoring, reference forward, loss, backward, clipping, AdamW. Evaluation, state
  saving and metric writing fall outside.

Alternation scheme (one process, per model size)
-------------------------------------------------
1. Warm-up: one TRL run and one rlvr run of ``--warmup`` steps each, discarded.
2. ``--blocks`` rounds; round r runs one block of each library, TRL first when r is even and
   rlvr first when r is odd (so neither always follows the other). A block is a fresh run
   (a new ``GRPOTrainer`` / a new ``rlvr.trainer.train``, both loading the saved model) of
   ``--skip + --block-steps`` steps; its first ``--skip`` steps are dropped (first-step
   allocation and lazy initialisation), the rest are measured.
3. Reported: the median (and the 25th / 75th percentiles) of the measured steps of each library,
   at least ``blocks x block_steps`` (default 3 x 5 = 15) each; the speed-up = TRL median / rlvr
   median (> 1: rlvr takes less time per step).
4. The process's host allocator is set once before any run as ``rlvr train`` sets it
   (``--host-memory``, default ``keep``: rlvr.hostmem), so TRL's blocks run under the same one.

Achieved FLOP/s
---------------
The machine's fp32 matmul rate is measured first and again after each model size:
1024x1024 @ 1024x1024 with the same thread count, best of 7 trials; the best is used. Each library's nominal FLOPs per step use the SAME count of work
for both, from the model: N = weights of every Linear (q, k, v, o, gate, up, down, lm_head; the
input embedding is a lookup and is excluded), B = 64 sequences of Lp = 8 prompt + Lc = 7
completion tokens:

    FLOPs/step = 2 N B (Lp + Lc)   generation (prefill of the prompt + one forward per new token)
               + 2 N B (Lp + Lc)   reference forward over prompt + completion
               + 6 N B (Lp + Lc)   training forward + backward over prompt + completion
               = 10 N B (Lp + Lc)

Attention score/value products (4 n_layer d T per token, T <= 15 here) are left out, as are
savings either library makes (a prefill shared by the G samples of a prompt, lm_head only on
completion positions); so "achieved" is nominal work over measured time, and the ratio of the
two achieved rates equals the speed-up. It is given as a % of the measured matmul rate.

Checks (the script stops if one fails): TRL's args give generation_batch_size 64,
steps_per_generation 1, num_iterations 1, gradient_accumulation_steps 1; the reward function
is called exactly once per optimizer step with 64 completions of 8 distinct prompts x 8;
``trainer.ref_model`` exists (beta > 0); policy and reference are float32 on the CPU;
``use_vllm`` is False; bf16/fp16 off. For rlvr, the resolved config is checked the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

SIZES = {
    # name: (layers, hidden, heads, intermediate)
    "small": (2, 128, 4, 512),
    "large": (4, 256, 4, 1024),
}
P, G = 8, 8                   # prompts per step, samples per prompt
MAX_NEW = 7                   # response tokens (at most, for TRL: generation stops early only if all 64 rows hit eos)
BETA = 0.04                   # KL coefficient (reference forward runs in both)
LR = 1e-5
SORT_N = 6
CHARS = "0123456789="
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


# ----------------------------------------------------------------------------- machine rate
def matmul_rate(threads: int, n: int = 1024, reps: int = 10, trials: int = 7) -> float:
    """Best fp32 FLOP/s of ``n x n @ n x n`` over ``trials`` trials of ``reps`` products."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    c = torch.empty(n, n)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * n**3 / best


# ----------------------------------------------------------------------------- model + data
def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    bk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    bk.add_special_tokens(SPECIALS)
    bk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    bk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    bk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=bk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def build_model_dir(d: Path, size: str, seed: int = 0) -> Path:
    """Save a random-init tiny Llama + tokenizer to ``d`` (safetensors); returns ``d``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, heads, inter = SIZES[size]
    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=32,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    assert (d / "model.safetensors").is_file(), f"{d}: no model.safetensors written"
    # round trip: the tokenizer as both libraries will load it
    from transformers import AutoTokenizer

    t2 = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    ids = t2("314159=")["input_ids"]
    assert ids[0] == t2.bos_token_id and len(ids) == 8 and t2.decode(ids, skip_special_tokens=True) == "314159=", ids
    return d


def model_stats(model_dir: Path) -> dict:
    """N (Linear weights incl. lm_head) and the shape facts used for FLOPs."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    n_linear = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    return {"n_matmul_params": n_linear, "n_params": sum(p.numel() for p in m.parameters()),
            "layers": m.config.num_hidden_layers, "hidden": m.config.hidden_size,
            "heads": m.config.num_attention_heads, "intermediate": m.config.intermediate_size,
            "vocab": m.config.vocab_size}


def sort_examples():
    from rlvr.tasks.sort import sort_task

    task = sort_task(n=SORT_N)
    return task


# ----------------------------------------------------------------------------- TRL
def trl_steps(model_dir: Path, n_steps: int, *, threads: int, seed: int = 0, task=None,
              gradient_checkpointing: bool = False) -> tuple[list[float], dict]:
    """Run ``trl.GRPOTrainer`` for ``n_steps`` optimizer steps; per-step seconds and check facts.

    ``gradient_checkpointing`` is off by default here although GRPOConfig defaults it to True:
    it recomputes every layer's forward in the backward (8 N instead of 6 N per trained token)
    to save activation memory that these models do not need; rlvr does not checkpoint.
    """
    import datasets
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlvr.tasks.sort import position

    task = task or sort_examples()
    rows = task.train[:4096]
    ds = datasets.Dataset.from_dict({"prompt": [ex.prompt for ex in rows], "answer": [str(ex.answer) for ex in rows]})

    calls: list[tuple[int, int, int]] = []  # (completions, distinct prompts, largest group) per reward call

    def position_reward(prompts, completions, answer, **kw) -> list[float]:
        counts = Counter(prompts)
        calls.append((len(completions), len(counts), max(counts.values())))
        return [position(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.times: list[float] = []
            self.calls_per_step: list[int] = []
            self.threads: set[int] = set()
            self.checkpointing: set[bool] = set()
            self.logs: list[dict] = []
            self._calls_at_begin = 0

        def on_step_begin(self, args, state, control, model=None, **kw):
            self.threads.add(torch.get_num_threads())
            # the Trainer switches checkpointing on inside train(), so look at the model here
            self.checkpointing.add(any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()))
            self._calls_at_begin = len(calls)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)
            self.calls_per_step.append(len(calls) - self._calls_at_begin)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                self.logs.append(dict(logs))

    with tempfile.TemporaryDirectory(prefix="vs_trl_out_") as out:
        args = GRPOConfig(
            output_dir=out, max_steps=n_steps, per_device_train_batch_size=P * G, gradient_accumulation_steps=1,
            num_generations=G, max_completion_length=MAX_NEW, beta=BETA, num_iterations=1, learning_rate=LR,
            temperature=1.0, top_p=1.0, top_k=0, use_vllm=False, use_cpu=True, bf16=False, fp16=False,
            model_init_kwargs={"dtype": "float32"}, report_to="none", logging_steps=1, save_strategy="no",
            seed=seed, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
            gradient_checkpointing=gradient_checkpointing,
        )
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        timer = StepTimer()
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=position_reward, args=args, train_dataset=ds,
                              processing_class=tok, callbacks=[timer])
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        torch.set_num_threads(threads)

        # --- the configuration actually in force
        facts = {
            "generation_batch_size": args.generation_batch_size,
            "steps_per_generation": args.steps_per_generation,
            "num_iterations": trainer.num_iterations,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "num_generations": trainer.num_generations,
            "beta": trainer.beta,
            "ref_model": type(trainer.ref_model).__name__ if trainer.ref_model is not None else None,
            "use_vllm": trainer.use_vllm,
            "bf16": args.bf16, "fp16": args.fp16,
            "policy_dtype": str(next(trainer.model.parameters()).dtype),
            "ref_dtype": str(next(trainer.ref_model.parameters()).dtype) if trainer.ref_model is not None else None,
            "device": str(trainer.accelerator.device),
            "max_new_tokens": trainer.generation_config.max_new_tokens,
            "temperature": trainer.generation_config.temperature,
            "loss_type": args.loss_type,
            "attn_implementation": trainer.model.config._attn_implementation,
            "gradient_checkpointing": args.gradient_checkpointing,
        }
        _require(facts["generation_batch_size"] == P * G, f"TRL generation_batch_size {facts['generation_batch_size']} != {P * G}")
        _require(facts["steps_per_generation"] == 1, f"TRL steps_per_generation {facts['steps_per_generation']} != 1")
        _require(facts["num_iterations"] == 1, "TRL num_iterations != 1")
        _require(facts["ref_model"] is not None and facts["beta"] == BETA, "TRL has no reference model (beta > 0 expected)")
        _require(facts["use_vllm"] is False, "TRL uses vLLM")
        _require(facts["policy_dtype"] == "torch.float32" and facts["ref_dtype"] == "torch.float32",
                 f"TRL dtypes {facts['policy_dtype']} / {facts['ref_dtype']}")
        _require(facts["device"] == "cpu", f"TRL device {facts['device']}")

        trainer.train()

    _require(len(timer.times) == n_steps, f"TRL ran {len(timer.times)} steps, asked {n_steps}")
    _require(all(c == 1 for c in timer.calls_per_step),
             f"TRL reward calls per optimizer step {timer.calls_per_step} (expected 1 each: mu = 1)")
    _require(all(c == (P * G, P, G) for c in calls),
             f"TRL reward calls (completions, prompts, group) {calls} (expected ({P * G}, {P}, {G}))")
    _require(timer.threads == {threads}, f"torch threads during TRL steps: {timer.threads}")
    _require(timer.checkpointing == {gradient_checkpointing},
             f"TRL gradient checkpointing during steps: {timer.checkpointing}, asked {gradient_checkpointing}")
    lens = [r["completions/mean_length"] for r in timer.logs if "completions/mean_length" in r]
    maxlens = [r["completions/max_length"] for r in timer.logs if "completions/max_length" in r]
    facts.update(completions_per_step=P * G, reward_calls_per_step=1, torch_threads=threads,
                 checkpointing_during_steps=gradient_checkpointing,
                 mean_completion_len=statistics.fmean(lens) if lens else None,
                 max_completion_len=max(maxlens) if maxlens else None,
                 kl_logged=[r.get("kl") for r in timer.logs if "kl" in r][:3])
    return timer.times, facts


# ----------------------------------------------------------------------------- rlvr
def rlvr_has_hf() -> bool:
    from rlvr import config as config_mod

    return "path" in {f.name for f in dataclasses.fields(config_mod.ModelConfig)}


def rlvr_steps(model_dir: Path, n_steps: int, *, threads: int = 2, seed: int = 0,
               host_memory: str = "keep") -> tuple[list[float], dict]:
    """Run ``rlvr.trainer.train`` for ``n_steps`` steps on the HF model at ``model_dir``;
    per-step seconds (``time/step_s`` of metrics.jsonl) and check facts.

    NEEDS rlvr's Hugging Face model support: a ``path`` field in ``rlvr.config.ModelConfig``
    (``model.path = DIR`` loads ``AutoModelForCausalLM`` + tokenizer from DIR via
    ``rlvr.models.hf.load_policy``, fp32). Without it this raises NotImplementedError and only
    ``--only trl`` runs.
    """
    if not rlvr_has_hf():
        raise NotImplementedError(
            "rlvr_steps needs rlvr.config.ModelConfig.path (train an HF model from a local directory, "
            "rlvr.models.hf); this rlvr has none. Run with --only trl, or finish the HF integration.")
    from rlvr import config as config_mod
    from rlvr.trainer import train

    overrides = [
        f"--model.path={model_dir}",
        "--task.path=rlvr.tasks.sort:sort_task", f"--task.options={{n = {SORT_N}}}", "--task.reward=position",
        f"--train.steps={n_steps}", f"--train.prompts_per_step={P}", f"--train.samples_per_prompt={G}",
        "--train.epochs_per_batch=1", "--train.minibatches=1", f"--train.lr={LR}", f"--train.seed={seed}",
        f"--train.threads={threads}", "--train.save_every=0", f"--train.host_memory={host_memory}",
        f"--sampling.max_new_tokens={MAX_NEW}", "--sampling.temperature=1.0", "--sampling.top_p=1.0",
        f"--algorithm.kl_coef={BETA}",
        "--eval.every=0", "--eval.prompts=8", "--eval.pass_k=0",
        "--log.print_every=1000000", "--log.rollouts_per_step=0",
    ]
    mc = {f.name for f in dataclasses.fields(config_mod.ModelConfig)}
    if "dtype" in mc:
        overrides.append("--model.dtype=fp32")
    if "lora_r" in mc:
        overrides.append("--model.lora_r=0")  # full fine-tuning, like TRL here
    cfg = config_mod.load(None, overrides)
    with tempfile.TemporaryDirectory(prefix="vs_trl_rlvr_") as out:
        out = Path(out) / "run"
        train(cfg, out, overwrite=True, log=lambda *a, **k: None)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        resolved = config_mod.load(out / "config.toml")
        price = json.loads((out / "price.json").read_text())
    steps = [r for r in rows if "time/step_s" in r]
    _require(len(steps) == n_steps, f"rlvr wrote {len(steps)} step rows, asked {n_steps}")
    _require(torch.get_num_threads() == threads, f"torch threads after rlvr: {torch.get_num_threads()}")
    facts = {
        "model.path": getattr(resolved.model, "path", None),
        "prompts_per_step": resolved.train.prompts_per_step, "samples_per_prompt": resolved.train.samples_per_prompt,
        "epochs_per_batch": resolved.train.epochs_per_batch, "minibatches": resolved.train.minibatches,
        "kl_coef": resolved.algorithm.kl_coef, "max_new_tokens": resolved.sampling.max_new_tokens,
        "dtype": getattr(resolved.model, "dtype", "fp32 (default)"),
        "mean_completion_len": statistics.fmean(r.get("train/response_len", float("nan")) for r in steps),
        "kl_logged": [r.get("train/kl_ref") for r in steps][:3],
        "lora_r": getattr(resolved.model, "lora_r", 0),
        "n_params_priced": price.get("n_params"),
    }
    if rlvr_has_hf():  # the run trained the HF model from model_dir, not the built-in tiny transformer
        want = model_stats(Path(model_dir))["n_params"]
        _require(facts["n_params_priced"] == want,
                 f"rlvr priced {facts['n_params_priced']} parameters; the HF model at {model_dir} has {want}")
        _require(facts["lora_r"] == 0, "rlvr ran with LoRA")
    _require(not rlvr_has_hf() or facts["model.path"] == str(model_dir),
             f"rlvr model.path {facts['model.path']!r} is not {str(model_dir)!r}")
    _require(facts["epochs_per_batch"] == 1 and facts["minibatches"] == 1, "rlvr mu != 1")
    _require(facts["kl_coef"] == BETA, "rlvr KL off")
    _require(str(facts["dtype"]).startswith(("fp32", "float32")), f"rlvr dtype {facts['dtype']}")
    return [float(r["time/step_s"]) for r in steps], facts


# ----------------------------------------------------------------------------- harness
def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise SystemExit(f"vs_trl: check failed: {msg}")


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(times: list[float]) -> dict:
    return {"median_ms": 1e3 * statistics.median(times), "p25_ms": 1e3 * _q(times, 0.25),
            "p75_ms": 1e3 * _q(times, 0.75), "min_ms": 1e3 * min(times), "n": len(times)}


def bench_size(size: str, a, task, rate: float, log) -> dict:
    runners = {}
    if a.only in ("both", "trl"):
        runners["trl"] = lambda d, n: trl_steps(d, n, threads=a.threads, task=task,
                                                gradient_checkpointing=a.trl_gradient_checkpointing)
    if a.only in ("both", "rlvr"):
        runners["rlvr"] = lambda d, n: rlvr_steps(d, n, threads=a.threads, host_memory=a.host_memory)
    res: dict = {"size": size, "measured": {k: [] for k in runners}, "dropped": {k: [] for k in runners},
                 "blocks": [], "facts": {}}
    with tempfile.TemporaryDirectory(prefix=f"vs_trl_{size}_") as d:
        model_dir = build_model_dir(Path(d) / "model", size)
        stats = model_stats(model_dir)
        res["model"] = stats
        lp = len(build_tokenizer()(task.train[0].prompt)["input_ids"])
        res["tokens"] = {"prompt": lp, "completion": MAX_NEW, "sequences": P * G}
        log(f"[{size}] {stats['layers']} layers, d={stats['hidden']}, {stats['heads']} heads, "
            f"ff={stats['intermediate']}, vocab {stats['vocab']}: N = {stats['n_matmul_params']:,} matmul weights; "
            f"model dir {model_dir}")
        if a.warmup:
            for name, run in runners.items():
                t0 = time.perf_counter()
                times, facts = run(model_dir, a.warmup)
                res["facts"][name] = facts
                log(f"[{size}] warm-up {name}: {len(times)} steps, "
                    f"{', '.join(f'{1e3 * t:.0f}' for t in times)} ms ({time.perf_counter() - t0:.1f} s with setup)")
        for r in range(a.blocks):
            order = list(runners) if r % 2 == 0 else list(runners)[::-1]
            for name in order:
                times, facts = runners[name](model_dir, a.skip + a.block_steps)
                res["facts"][name] = facts
                res["dropped"][name] += times[: a.skip]
                res["measured"][name] += times[a.skip:]
                res["blocks"].append({"round": r, "lib": name, "ms": [1e3 * t for t in times],
                                      "median_ms": 1e3 * statistics.median(times[a.skip:])})
                log(f"[{size}] round {r} {name:>4}: median {1e3 * statistics.median(times[a.skip:]):.1f} ms/step "
                    f"(dropped {', '.join(f'{1e3 * t:.0f}' for t in times[:a.skip])} ms)")
    flops = 10 * stats["n_matmul_params"] * P * G * (lp + MAX_NEW)
    res["flops_per_step"] = flops
    res["summary"] = {}
    for name, times in res["measured"].items():
        s = summarize(times)
        s["gflops"] = flops / (s["median_ms"] / 1e3) / 1e9
        s["pct_of_matmul"] = 100 * flops / (s["median_ms"] / 1e3) / rate
        res["summary"][name] = s
    if "trl" in res["summary"] and "rlvr" in res["summary"]:
        res["speedup_trl_over_rlvr"] = res["summary"]["trl"]["median_ms"] / res["summary"]["rlvr"]["median_ms"]
    return res


def table(results: list[dict], rate: float) -> str:
    lines = [
        f"fp32 matmul rate (1024^3, best of 7 trials, best of the runs before and after each size): "
        f"{rate / 1e9:.0f} GFLOP/s",
        "",
        "| model | N (matmul weights) | GFLOP/step | TRL ms/step (p25-p75) | rlvr ms/step (p25-p75) "
        "| speed-up (TRL / rlvr) | TRL GFLOP/s (% matmul) | rlvr GFLOP/s (% matmul) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r["model"]
        name = f"{m['layers']}L d={m['hidden']} {m['heads']}h ff={m['intermediate']}"

        def ms(lib):
            s = r["summary"].get(lib)
            return f"{s['median_ms']:.1f} ({s['p25_ms']:.0f}-{s['p75_ms']:.0f}), n={s['n']}" if s else "n/a"

        def fl(lib):
            s = r["summary"].get(lib)
            return f"{s['gflops']:.1f} ({s['pct_of_matmul']:.0f}%)" if s else "n/a"

        sp = f"{r['speedup_trl_over_rlvr']:.2f}x" if "speedup_trl_over_rlvr" in r else "n/a"
        lines.append(f"| {name} | {m['n_matmul_params']:,} | {r['flops_per_step'] / 1e9:.2f} | {ms('trl')} | {ms('rlvr')} "
                     f"| {sp} | {fl('trl')} | {fl('rlvr')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small,large", help="comma list of: " + ", ".join(SIZES))
    ap.add_argument("--only", choices=["both", "trl", "rlvr"], default="both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3, help="discarded steps of each library before the blocks")
    ap.add_argument("--blocks", type=int, default=3, help="alternating rounds (one block of each library per round)")
    ap.add_argument("--block-steps", type=int, default=5, help="measured steps per block")
    ap.add_argument("--skip", type=int, default=1, help="steps dropped at the start of every block (fresh run)")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true",
                    help="keep GRPOConfig's default gradient_checkpointing=True (off here by default: same work as rlvr)")
    ap.add_argument("--host-memory", choices=["keep", "system"], default="keep",
                    help="the process's host allocator for both libraries (rlvr's train.host_memory)")
    ap.add_argument("--json", default=None, help="write every measurement and check to this file")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    from rlvr.hostmem import set_host_memory

    print(set_host_memory(a.host_memory), flush=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            ap.error(f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    if a.only in ("both", "rlvr") and not rlvr_has_hf():
        print("vs_trl: this rlvr has no model.path (HF models); rlvr_steps is not available. "
              "Run with --only trl.", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, flush=True)

    rate = matmul_rate(a.threads)
    log(f"fp32 matmul: {rate / 1e9:.0f} GFLOP/s with {a.threads} threads")
    task = sort_examples()
    rates = [rate]
    results = []
    for s in sizes:
        results.append(bench_size(s, a, task, rate, log))
        rates.append(matmul_rate(a.threads))
    if max(rates) > rate:  # the machine's rate is the best seen; rescale the % columns to it
        rate = max(rates)
        for r in results:
            for s in r["summary"].values():
                s["pct_of_matmul"] = 100 * s["gflops"] * 1e9 / rate
    log(f"fp32 matmul measurements: {', '.join(f'{x / 1e9:.0f}' for x in rates)} GFLOP/s (best is used)")
    noisy = [f"matmul rate varied {min(rates) / 1e9:.0f}-{max(rates) / 1e9:.0f} GFLOP/s"] if min(rates) < 0.8 * max(rates) else []
    noisy += [f"{r['size']} {lib}: p75/p25 = {x['p75_ms'] / x['p25_ms']:.2f}" for r in results
              for lib, x in r["summary"].items() if x["p75_ms"] > 1.25 * x["p25_ms"]]
    if noisy:
        log("WARNING: the machine looks busy (other processes compete for the cores; with several torch "
            "threads a busy core stalls every matmul), so these times are unreliable: " + "; ".join(noisy))
    cmd = "python benchmarks/vs_trl.py " + " ".join(sys.argv[1:])
    print()
    print(table(results, rate))
    print()
    print(f"Scheme: per size, {a.warmup} warm-up steps of each, then {a.blocks} alternating rounds of fresh runs of "
          f"{a.skip}+{a.block_steps} steps (first {a.skip} dropped); {P} prompts x {G} samples, <= {MAX_NEW} new "
          f"tokens, beta {BETA}, mu 1, fp32, CPU, {a.threads} threads, TRL gradient checkpointing "
          f"{'on' if a.trl_gradient_checkpointing else 'off'}. FLOPs = 10 N x 64 x (Lp + Lc).")
    print(f"Command: {cmd.strip()}")
    if a.json:
        import transformers
        import trl

        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({
            "command": cmd.strip(), "matmul_flops": rate, "matmul_flops_all": rates, "threads": a.threads,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                         "python": platform.python_version()},
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
            "noise_warnings": noisy, "results": results,
        }, indent=2, default=str))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
