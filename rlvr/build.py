"""Building a run before any compute, and reloading a finished one.

`build(cfg)` loads the task, the tokenizer and the policy, derives the generation limits (the
response bound, the end token, the longest prompt) and checks them against the model's context,
all before a single token is sampled; `load_run(run_dir)` reloads a run's checkpoint for
`rlvr eval` and `rlvr probe` (a run cut off before its end: its best/ or its last state), a task
file imported only under rlvr.trust's rule. The stages (rollout, learn, evaluation, the
distributed workers) never import this module: what they need of a built run is rlvr.setup_types.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Sequence

import torch

from rlvr import config as config_mod, costs
from rlvr.checkpoint import load_built_in, load_checkpoint
from rlvr.models.tiny import TinyConfig, TinyTransformer
from rlvr.numerics import choose_numerics, probe_shape
from rlvr.policy import Policy, Tokenizer
from rlvr.setup_types import Limits, RunError, Setup
from rlvr.state import StateError, find_complete, find_state, load_policy_weights
from rlvr.tasks import Task, load_task, resolve_weights
from rlvr.tokenizer import CharTokenizer, PromptFormat, encode_examples
from rlvr.tool_calls import JsonTools, takes_tools
from rlvr.trust import refuse_links_out, refuse_run_task, run_config_guard


def check_group_by(cfg: config_mod.Config, task: Task) -> None:
    """RunError when eval.group_by names a key no held-out example's meta has (listing those it has)."""
    key = cfg.eval.group_by
    metas = [ex.meta for ex in task.heldout if isinstance(ex.meta, dict)]
    if key and not any(key in m for m in metas):
        keys = sorted({k for m in metas for k in m})
        raise RunError(f"eval.group_by = {key!r}: no held-out example of the task {task.name!r} has it in its meta "
                       f"(their keys: {', '.join(keys[:20]) or 'none'})")


def reward_weights(cfg: config_mod.Config, task: Task) -> dict[str, float]:
    """{reward name: weight} the run optimises; names checked against the task."""
    return resolve_weights(task, cfg.task.reward, cfg.task.reward_weights)


def resolve_device(name: str) -> torch.device:
    """`train.device`: cpu, cuda, cuda:N, mps, or auto (cuda when available, else cpu)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise RunError(f"train.device = {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RunError(f"train.device = {name!r}, but this torch sees no CUDA device (use cpu or auto)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise RunError(f"train.device = {name!r}, but MPS is not available here")
    return device


def limits(cfg: config_mod.Config, task: Task, tok: Tokenizer, model: Policy | None = None,
           examples: list | None = None) -> Limits:
    """The generation limits of `task` on `tok`, checked against `model`'s context when given.

    `examples` (default: every train and held-out example) are the prompts measured. Raises
    RunError naming the longest prompt when prompt + response cannot fit the model."""
    examples = list(task.heldout) + list(task.train) if examples is None else examples
    max_new = cfg.sampling.max_new_tokens or task.max_new_tokens
    try:
        lengths = [len(ids) for ids in encode_examples(tok, examples)]
    except ValueError as e:
        raise RunError(f"the model's tokenizer cannot encode the task's prompts: {e}") from None
    n = max(lengths)
    block = model.config.block_size if model is not None else None
    if block and n + max_new > block:
        longest = examples[lengths.index(n)]
        raise RunError(f"task prompt {longest.prompt[:60]!r} has {n} tokens; with max_new_tokens = {max_new} that "
                       f"exceeds the model's context of {block} tokens ({cfg.model.path or cfg.model.init or 'built-in'})")
    if cfg.sampling.stop and task.fixed_length:
        raise RunError(f"sampling.stop = {cfg.sampling.stop!r}, but the task's responses have a fixed length "
                       f"({max_new} tokens, no end token): there is nothing to stop early")
    if cfg.sampling.tool_on_end and task.fixed_length:
        raise RunError("sampling.tool_on_end = true, but the task's responses have a fixed length (no end token)")
    if cfg.sampling.max_tool_calls and task.tool is None and task.environment is None:
        raise RunError(f"sampling.max_tool_calls = {cfg.sampling.max_tool_calls}, but the task {task.name!r} has no "
                       "tool (Task.tool) to call and no environment (Task.environment) to step")
    check_call_stop(cfg, task)
    role = cfg.sampling.tool_role
    if role and cfg.sampling.max_tool_calls:
        why = "" if tok.has_chat_template else "the tokenizer has no chat template"
        if not why:
            try:
                tok.turn_text(role, "42")
            except Exception as e:  # noqa: BLE001 - a template that cannot render the turn (jinja's errors too)
                why = f"{type(e).__name__}: {e}"
        if why:
            raise RunError(f"sampling.tool_role = {role!r} needs a chat template that renders a {role!r} turn after "
                           f"the assistant's: {why} (tool_role = \"\" inserts the tool's text as it is)")
    return Limits(max_new, None if task.fixed_length else tok.eos_id, n, tuple(cfg.sampling.stop),
                  cfg.sampling.max_tool_calls, role, cfg.sampling.tool_on_end)


def check_call_stop(cfg: config_mod.Config, task: Task) -> None:
    """RunError when the task's JSON tools are called (sampling.max_tool_calls) but no stop string ends a
    call: the closing marker (``</tool_call>``) must be among `sampling.stop`, unless the tool is called
    at the end token (`sampling.tool_on_end`, for a model that writes its call as its whole turn)."""
    tool, s = task.tool, cfg.sampling
    if not (s.max_tool_calls and isinstance(tool, JsonTools) and tool.markers) or s.tool_on_end:
        return
    close = tool.markers[1]
    if close not in s.stop:
        raise RunError(f"the task's tools are called with JSON between {tool.markers[0]} and {close}, and no "
                       f"sampling.stop string ends a call there: add {close!r} to sampling.stop = {list(s.stop)!r}")


def _hf_policy(cfg: config_mod.Config, device: torch.device, log) -> tuple[Policy, Tokenizer]:
    from rlvr.models.hf import LoraSpec, load_policy

    from rlvr.models.hf_source import LoraTargetsError

    mc = cfg.model
    targets = list(mc.lora_target_modules)
    lora = LoraSpec(r=mc.lora_r, alpha=mc.lora_alpha, dropout=mc.lora_dropout,
                    target_modules="all-linear" if targets == ["all-linear"] else targets or None) if mc.lora_r else None
    try:  # a new adapter's random init drawn from train.seed, not from whatever ran before in this process
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.train.seed)
            model, tokenizer = load_policy(mc.path, dtype=mc.dtype, lora=lora, device=device)
    except LoraTargetsError as e:
        raise RunError(f"model.lora_target_modules = {targets!r} (model.path = {mc.path!r}): {e}; "
                       f"e.g. --model.lora_target_modules='[\"all-linear\"]'") from None
    except ValueError as e:
        raise RunError(f"model.path = {mc.path!r}: {e}") from None
    if model.load_note:
        log(f"note: {model.load_note}")
    if mc.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.cuda_graphs = mc.cuda_graphs
    model.compile_layers = mc.compile
    if mc.compile:
        log(f"note: {compile_note(model)}")
    return model, tokenizer


def compile_note(model) -> str:
    """What model.compile acts on for ``model`` (an HFPolicy): how many decoder layers it compiles,
    or why none (the transformers forward, layers not of the Llama type, gradient checkpointing)."""
    from rlvr.models.lean_llama import compiled_plan

    if model.fast_unsupported is not None:
        return f"model.compile: this model runs transformers' forward ({model.fast_unsupported}); nothing is compiled"
    if model.gradient_checkpointing:
        return "model.compile: with model.gradient_checkpointing the layers run eagerly; nothing is compiled"
    layers = model._hf_model().model.layers
    n = sum(compiled_plan(layer) is not None for layer in layers)
    if n == 0:
        return (f"model.compile: none of the {len(layers)} decoder layers is of the Llama type the compiled "
                f"layers cover; they run eagerly")
    return (f"model.compile: {n} of {len(layers)} decoder layers and the token log-probs run compiled in "
            f"prefills and training and scoring forwards (decode steps eager); compiling takes tens of "
            f"seconds at the first training step and the first prefill, which the price's wall time leaves out")


def prompt_format(cfg: config_mod.Config, task: Task, tok: Tokenizer, log=print) -> PromptFormat:
    """`task.chat` and `task.system` as the run's PromptFormat (rlvr.tokenizer.encode_example), checked
    against the tokenizer: RunError for `user` or a system message without a chat template (a system
    message under `off` is refused with the config); a note when plain prompts go past a chat
    template (`messages`). The task's JSON tools go with it (`tool_format`)."""
    tc = cfg.task
    where = f"model.path = {cfg.model.path!r}" if cfg.model.path else "the built-in model"
    if not tok.has_chat_template and (tc.chat == "user" or tc.system):
        key = "task.chat = 'user'" if tc.chat == "user" else "task.system"
        raise RunError(f"{key} needs a tokenizer with a chat template; {where}'s has none")
    first = task.train[0] if len(task.train) else task.heldout[0]
    plain = not (isinstance(first.meta, dict) and first.meta.get("messages"))
    templated = tok.has_chat_template and (tc.chat == "user" or tc.chat == "messages" and not plain)
    if tc.chat == "messages" and tok.has_chat_template and plain:
        log("note: the task's prompts are plain text and go to the model as they are, without its chat "
            "template; --task.chat=user sends each as a user turn through the template")
    return PromptFormat(chat=tc.chat, system=tc.system, **tool_format(task, tok, templated, log))


def tool_format(task: Task, tok: Tokenizer, templated: bool, log=print) -> dict:
    """The PromptFormat fields that declare a task's JSON tools (rlvr.tool_calls.JsonTools): their schemas
    for the chat template's ``tools=`` where it renders them (takes_tools), else their system message; a
    note, and neither, when the prompts do not go through a chat template (`templated` False): the
    task's own prompt text must then describe its tools."""
    if not isinstance(task.tool, JsonTools):
        return {}
    if not templated:
        log(f"note: the task's tools ({', '.join(task.tool.tools)}) reach the model only through a chat "
            "template, and its prompts go without one; the prompt text must describe them")
        return {}
    if takes_tools(tok):
        return {"tools": tuple(task.tool.schemas())}
    return {"tools_text": task.tool.system_text()}


def _built_in(cfg: config_mod.Config, task: Task) -> tuple[Policy, Tokenizer]:
    """The built-in model: from `model.init`, or random with a block sized to the task."""
    if cfg.model.init:
        init = Path(cfg.model.init)
        if not (init / "model.safetensors").is_file() or not (init / "tokenizer.json").is_file():
            raise RunError(f"model.init = {cfg.model.init!r}: expected model.safetensors and tokenizer.json there")
        return load_built_in(init, prefix="model.init: ")
    examples = list(task.train) + list(task.heldout)
    alphabet = task.alphabet or "".join(sorted({c for ex in examples for c in ex.prompt + str(ex.answer)}))
    tokenizer = CharTokenizer(alphabet)
    n = max(len(tokenizer.encode(ex.prompt)) for ex in examples)
    config_mod.check_against_task(cfg, train_prompts=len(task.train), prompt_tokens=n,
                                  max_new_tokens=cfg.sampling.max_new_tokens or task.max_new_tokens)
    torch.manual_seed(cfg.train.seed)
    model = TinyTransformer(TinyConfig(
        vocab_size=tokenizer.vocab_size, n_layer=cfg.model.n_layer, n_head=cfg.model.n_head,
        n_embd=cfg.model.n_embd, block_size=n + (cfg.sampling.max_new_tokens or task.max_new_tokens) + 1,
    ))
    return model, tokenizer


def _import_optimizer_modules() -> None:
    """Construct a throwaway AdamW: its constructor imports torch._dynamo and friends (about 800
    modules, some 70 MB resident), which every run loads when it builds its optimizer; done before
    the memory baseline is read, so the baseline counts them."""
    with contextlib.suppress(Exception):
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)


def build(cfg: config_mod.Config, log=print, autocast: str | None = None, time_bf16: bool = False) -> Setup:
    """Load the task, build tokenizer and model; every error here comes before any compute.
    `autocast` ("bf16" or "off") replaces model.autocast's choice (a resumed run keeps its first decision).
    `time_bf16`: a model.autocast = bf16 is timed against fp32 too (a fresh run's price, `rlvr price`)."""
    device = resolve_device(cfg.train.device)
    task = load_task(cfg.task.path, **cfg.task.options)
    config_mod.check_against_task(cfg, train_prompts=len(task.train), prompt_tokens=0,
                                  max_new_tokens=cfg.sampling.max_new_tokens or task.max_new_tokens,
                                  fixed_length=task.fixed_length)
    weights = reward_weights(cfg, task)
    check_group_by(cfg, task)
    if cfg.model.path:  # their import is part of the process's baseline, not of the model
        with contextlib.suppress(ImportError):
            import peft  # noqa: F401
            import transformers  # noqa: F401
    _import_optimizer_modules()
    baseline = costs.resident_bytes()
    model, tokenizer = _hf_policy(cfg, device, log) if cfg.model.path else _built_in(cfg, task)
    tokenizer.prompt_format = prompt_format(cfg, task, tokenizer, log)
    lim = limits(cfg, task, tokenizer, model)
    numerics = choose_numerics(autocast or cfg.model.autocast, device, probe_shape(model, device),
                               time_bf16=time_bf16 and autocast is None)
    return Setup(cfg, task, tokenizer, model.to(device), weights, lim, device, baseline, numerics)


def load_run(run_dir: Path, overrides: Sequence[str] = (), *, trusted: bool = False,
             note=lambda msg: None) -> tuple[config_mod.Config, Policy, Tokenizer]:
    """Reload a run: (resolved config, model, tokenizer). The final checkpoint/ or hf/; for a run cut
    off before its end, best/ (the best held-out goal so far) or else the last saved state/ (which
    rebuilds the model from the config, so a task file is imported only under `refuse_run_task`'s
    rule); `note` is told which. `overrides` are --section.key=value applied to the run's config."""
    run_dir = Path(run_dir)
    refuse_links_out(run_dir, trusted=trusted)          # nothing read outside it through a link
    if not (run_dir / "config.toml").is_file():
        raise RunError(f"{run_dir} is not a finished run: {run_dir / 'config.toml'} is missing")
    cfg = config_mod.load(run_dir / "config.toml", list(overrides))
    name = "hf" if cfg.model.path else "checkpoint"
    final = find_complete(run_dir, name)
    if final is not None:
        return (cfg, *load_checkpoint(final, cfg))
    best = find_complete(run_dir, "best")
    if best is not None and find_complete(best, name) is not None:
        try:
            info = json.loads((best / "best.json").read_text())
            what = f" (step {info['step']}, eval/goal {info['eval/goal']:.4g})"
        except (OSError, ValueError, KeyError, TypeError):
            what = ""
        note(f"{run_dir} has no final {name}/ (the run was cut off); loading best/{what}")
        return (cfg, *load_checkpoint(find_complete(best, name), cfg))
    if find_state(run_dir) is None:
        need = run_dir / name / ("config.json" if cfg.model.path else "model.safetensors")
        raise RunError(f"{run_dir} is not a finished run and holds nothing to load: {need} is missing, and there "
                       f"is no best/ or state/ (the run stopped before its first save)")
    refuse_run_task(cfg, run_dir / "config.toml", overrides=overrides, trusted=trusted)
    with run_config_guard(cfg, run_dir / "config.toml", overrides=overrides, trusted=trusted):
        setup = build(cfg)
    try:
        step = load_policy_weights(run_dir, setup.model)
    except StateError as e:
        raise RunError(str(e)) from None
    note(f"{run_dir} has no final {name}/ or best/ (the run was cut off); loading the last saved state (step {step})")
    return cfg, setup.model, setup.tokenizer
