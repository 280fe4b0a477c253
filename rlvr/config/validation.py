"""Range and consistency checks on a loaded configuration that the types alone do not express,
and the checks that need the loaded task (`check_against_task`)."""

from __future__ import annotations

import math

from rlvr.config.schema import (ENV_NAME, GROUP_SCHEMES, MAX_BUILTIN_CONTEXT, MAX_REWARD_CPU_S, MAX_REWARD_FILE_MB,
                                MAX_REWARD_MEMORY_MB, MAX_REWARD_PROCESSES, MAX_REWARD_TIMEOUT_S, MAX_SEED,
                                MIN_TEMPERATURE, Config, ConfigError, SamplingConfig, TaskConfig)


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
    if cfg.sampling.expected_response_tokens > max_new_tokens:
        raise ConfigError(f"sampling.expected_response_tokens: {cfg.sampling.expected_response_tokens} exceeds the "
                          f"response bound of {max_new_tokens} tokens (sampling.max_new_tokens, or the task's bound); "
                          f"a mean response length is at most the bound "
                          f"({where(cfg, 'sampling.expected_response_tokens')})")
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
    """Range and consistency checks that the types alone do not express: ConfigError naming the first
    key that fails, and where its value came from."""

    def bad(key: str, msg: str) -> None:
        origin = where(cfg, key)
        if origin == "default" and source and not hasattr(cfg, "_origins"):
            origin = f"in {source} or the command line"
        raise ConfigError(f"{key}: {msg} ({origin})")

    _check_counts(cfg, bad)
    _check_model(cfg, bad)
    _check_batch_and_optimizer(cfg, bad)
    _check_non_negative(cfg, bad)
    t, s = cfg.train, cfg.sampling
    if t.seed > MAX_SEED:
        bad("train.seed", f"{t.seed} exceeds the largest seed, 2**62 = {MAX_SEED}")
    if s.temperature <= 0:
        bad("sampling.temperature", f"must be > 0 for training (greedy decoding has no usable logp), got {s.temperature}")
    _check_learnable(cfg, bad)
    _check_task_settings(cfg.task, bad)
    _check_distributed(cfg, bad)
    _check_sampling(s, bad)
    _check_algorithm(cfg, bad)
    _check_sft(cfg, bad)
    for name, w in cfg.task.reward_weights.items():
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w):
            bad(f"task.reward_weights.{name}", f"must be a finite number, got {w!r}")


def _check_counts(cfg: Config, bad) -> None:
    """Keys that count something a run needs at least one of."""
    t, a = cfg.train, cfg.algorithm
    for key, v in [("train.steps", t.steps), ("train.prompts_per_step", t.prompts_per_step),
                   ("train.samples_per_prompt", t.samples_per_prompt),
                   ("train.epochs_per_batch", t.epochs_per_batch), ("train.minibatches", t.minibatches),
                   ("train.micro_batches", t.micro_batches),
                   ("model.n_layer", cfg.model.n_layer), ("model.n_head", cfg.model.n_head),
                   ("model.n_embd", cfg.model.n_embd), ("eval.batch_size", cfg.eval.batch_size),
                   ("algorithm.dynamic_sampling_rounds", a.dynamic_sampling_rounds)]:
        if v < 1:
            bad(key, f"must be >= 1, got {v}")


def _check_model(cfg: Config, bad) -> None:
    """The [model] keys, and the reference keys that depend on the model's kind."""
    m, a = cfg.model, cfg.algorithm
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


def _check_batch_and_optimizer(cfg: Config, bad) -> None:
    """How a batch splits into minibatches and parts, and the optimizer's settings."""
    t = cfg.train
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


def _check_non_negative(cfg: Config, bad) -> None:
    """Keys where 0 means off (or none) and only a negative value is wrong."""
    t, a, s = cfg.train, cfg.algorithm, cfg.sampling
    for key, v in [("train.warmup_steps", t.warmup_steps), ("train.weight_decay", t.weight_decay),
                   ("train.grad_clip", t.grad_clip), ("train.seed", t.seed), ("train.threads", t.threads),
                   ("train.save_every", t.save_every), ("train.snapshot_every", t.snapshot_every),
                   ("train.snapshots_keep", t.snapshots_keep),
                   ("sampling.max_new_tokens", s.max_new_tokens),
                   ("sampling.expected_response_tokens", s.expected_response_tokens), ("algorithm.top_k", a.top_k),
                   ("algorithm.kl_coef", a.kl_coef), ("algorithm.clip_eps_high", a.clip_eps_high),
                   ("algorithm.ref_refresh_every", a.ref_refresh_every), ("algorithm.dual_clip_c", a.dual_clip_c),
                   ("algorithm.entropy_coef", a.entropy_coef), ("algorithm.overlong_buffer", a.overlong_buffer),
                   ("eval.every", cfg.eval.every),
                   ("eval.prompts", cfg.eval.prompts), ("eval.pass_k", cfg.eval.pass_k),
                   ("eval.pass_k_prompts", cfg.eval.pass_k_prompts),
                   ("log.rollouts_per_step", cfg.log.rollouts_per_step), ("log.print_every", cfg.log.print_every)]:
        if v < 0:
            bad(key, f"must be >= 0, got {v}")


def _check_sampling(s: SamplingConfig, bad) -> None:
    """The [sampling] filters, stop strings and tool calls."""
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
    if s.max_new_tokens and s.expected_response_tokens > s.max_new_tokens:
        bad("sampling.expected_response_tokens", f"{s.expected_response_tokens} exceeds sampling.max_new_tokens = "
            f"{s.max_new_tokens}; a mean response length is at most the bound (0 = price at the bound)")
    if s.tool_on_end and not s.max_tool_calls:
        bad("sampling.tool_on_end", "calls the tool at a response's end, so it needs sampling.max_tool_calls >= 1")


def _check_sft(cfg: Config, bad) -> None:
    """The [sft] keys."""
    for key, v in [("sft.epochs", cfg.sft.epochs), ("sft.batch_size", cfg.sft.batch_size)]:
        if v < 1:
            bad(key, f"must be >= 1, got {v}")
    for key, v in [("sft.steps", cfg.sft.steps), ("sft.examples", cfg.sft.examples),
                   ("sft.eval_every", cfg.sft.eval_every)]:
        if v < 0:
            bad(key, f"must be >= 0 (0 = off), got {v}")
    if cfg.sft.lr <= 0:
        bad("sft.lr", f"must be > 0, got {cfg.sft.lr}")


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
