"""`rlvr sft`: a supervised warm start on demonstrations, before RL.

A model that never writes the answer's format (or a tool call) gives every response of a group the
same reward, so RL has nothing to learn from. A few hundred worked examples fix that: `rlvr sft
CONFIG.toml` trains the run's model on demonstrations and writes a run directory whose checkpoint
`rlvr train` starts from (``--model.init=RUN/checkpoint`` for the built-in model, ``--model.path=RUN/hf``
for a Hugging Face model, LoRA merged in).

Demonstrations come from ``sft.data`` (a JSONL file, one ``{"messages": [...]}`` object a line) or, when it
is empty, from the task's ``demonstrate(example)`` for its training examples (rlvr.tasks.Task). Each is
laid out as the RL run lays out a response (rlvr.tools)::

    [left-padded prompt | assistant ... (eos) | inserted turn | assistant ... eos | pad]

* The prompt is the turns before the first assistant turn, encoded as `rlvr train` encodes a task
  prompt (rlvr.tokenizer.encode_example: the chat template with task.chat and task.system, or the
  plain text); a task demonstration uses its example's own prompt.
* An assistant turn is its text's tokens, then the end token, unless it ends with one of
  ``sampling.stop`` (a tool call, which stops there) or the task has fixed-length responses.
* A later turn of another role (a tool result, user feedback) is inserted as the tool loop inserts it:
  through the chat template as a turn of that role (``HFTokenizer.turn_text``) when
  ``sampling.tool_role`` is set, else its text as it is.
* The loss is the cross-entropy of the assistant tokens only (``mask``: 1 on them, 0 on the prompt,
  the inserted turns and padding), averaged over the batch's assistant tokens.

The run directory holds config.toml (with its ``[sft]`` section), metrics.jsonl (one row a step:
``sft/loss``, ``sft/tokens``, ``sft/grad_norm``; ``eval/...`` rows at the start, every
``sft.eval_every`` steps and at the end), checkpoint/ or hf/, and summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlvr import config as config_mod, scoring
from rlvr.learn import make_optimizer
from rlvr.tasks import Example
from rlvr.tokenizer import encode_example

ROLES = ("system", "user", "assistant", "tool")
"""The roles a demonstration's turns may have."""


class SftError(ValueError):
    """Demonstrations that cannot be read or encoded; the message names the file and line (or example)."""


@dataclass
class Demo:
    """One demonstration as token ids: the prompt, then the response, each response token trained on or not."""

    prompt: list[int]
    tokens: list[int]
    """The response's ids: assistant turns and inserted turns, in order."""
    trained: list[bool]
    """Per response token: True on an assistant token (it gets a loss), False on inserted text."""
    source: str
    """Where it came from: "file:line" or "train[i]"."""


# ------------------------------------------------------------------------------------------- reading


def check_messages(messages, where: str) -> list[dict]:
    """The ``{"role", "content"}`` turns of one demonstration, checked: SftError naming `where` unless
    they are a list of such dicts (str role in ROLES, str content) with at least one turn before the
    first assistant turn (the prompt) and an assistant turn last."""
    if not isinstance(messages, list) or not messages:
        raise SftError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects, "
                       f"got {json.dumps(messages)[:80]}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SftError(f"{where}: messages[{i}] must be an object with string \"role\" and \"content\", "
                           f"got {json.dumps(m)[:80]}")
        if m["role"] not in ROLES:
            raise SftError(f"{where}: messages[{i}] has role {m['role']!r}; roles are {', '.join(ROLES)}")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise SftError(f"{where}: no assistant turn, so nothing to train on")
    if roles.index("assistant") == 0:
        raise SftError(f"{where}: the first turn is the assistant's; a prompt (a user or system turn) must come first")
    if roles[-1] != "assistant":
        raise SftError(f"{where}: the last turn is a {roles[-1]!r} turn; a demonstration ends with the assistant's")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_jsonl(path: str | Path, limit: int = 0) -> list[tuple[str, list[dict]]]:
    """("file:line", messages) for each demonstration in the JSONL file `path` (blank lines skipped; the
    first `limit` when > 0); SftError naming the file and line of the first bad one."""
    path = Path(path)
    try:
        text = config_mod.read_text(path, "sft.data")
    except config_mod.ConfigError as e:
        raise SftError(str(e)) from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SftError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or "messages" not in obj:
            raise SftError(f"{where}: expected an object {{\"messages\": [...]}}, got {line.strip()[:80]}")
        out.append((where, check_messages(obj["messages"], where)))
        if limit and len(out) >= limit:
            break
    if not out:
        raise SftError(f"{path}: no demonstrations (the file holds no JSON lines)")
    return out


def prompt_example(turns: list[dict]) -> Example:
    """The prompt turns as a task Example: the chat turns in ``meta["messages"]`` (templated as a task's
    messages are), their contents joined by newlines as the plain-text prompt."""
    return Example(prompt="\n".join(m["content"] for m in turns), answer=None, meta={"messages": turns})


def split_prompt(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the turns before the first assistant turn, the rest)."""
    k = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:k], messages[k:]


# ------------------------------------------------------------------------------------------- encoding


def encode_turns(tok, turns: list[dict], *, stop: tuple[str, ...], templated: bool, eos: bool
                 ) -> tuple[list[int], list[bool]]:
    """The response ids of `turns` (the turns after the prompt) and which are trained on: an assistant
    turn's text, then the end token (`eos`: the task's responses end at one) unless it ends with a stop
    string; any other turn inserted (never trained on) through the template as that role's turn
    (`templated`: sampling.tool_role is set) or as its text. ValueError when the tokenizer cannot encode one."""
    ids: list[int] = []
    trained: list[bool] = []
    at_eos = False
    for m in turns:
        if m["role"] == "assistant":
            piece = tok.encode(m["content"], bos=False)
            at_eos = eos and not any(m["content"].endswith(s) for s in stop)
            piece = piece + [tok.eos_id] if at_eos else piece
            ids += piece
            trained += [True] * len(piece)
        else:
            text = tok.turn_text(m["role"], m["content"], after_end=at_eos) if templated else m["content"]
            piece = tok.encode(text, bos=False)
            ids += piece
            trained += [False] * len(piece)
            at_eos = False
    return ids, trained


def encode_demo(tok, example: Example, turns: list[dict], source: str, *, stop: tuple[str, ...], templated: bool,
                eos: bool, max_new_tokens: int) -> Demo:
    """One demonstration as a Demo: `example`'s prompt ids (encode_example), then `encode_turns`;
    SftError naming `source` when it cannot be encoded or its response exceeds `max_new_tokens`."""
    try:
        prompt = encode_example(tok, example)
        ids, trained = encode_turns(tok, turns, stop=stop, templated=templated, eos=eos)
    except ValueError as e:
        raise SftError(f"{source}: the model's tokenizer cannot encode it: {e}") from None
    if len(ids) > max_new_tokens:
        raise SftError(f"{source}: the response has {len(ids)} tokens, more than the run's max_new_tokens = "
                       f"{max_new_tokens} (sampling.max_new_tokens, or the task's bound)")
    if not prompt:
        raise SftError(f"{source}: the prompt encodes to no tokens")
    return Demo(prompt, ids, trained, source)


def task_turns(task, example: Example, where: str) -> list[dict] | None:
    """The turns after the prompt that the task's ``demonstrate(example)`` gives (a str is one assistant
    turn; None skips the example); SftError naming `where` when it gives something else."""
    got = task.demonstrate(example)
    if got is None:
        return None
    if isinstance(got, str):
        return [{"role": "assistant", "content": got}]
    turns = check_messages([{"role": "user", "content": ""}] + list(got) if isinstance(got, list) else got, where)
    return turns[1:]


def load_demos(cfg: config_mod.Config, task, tok, max_new_tokens: int, eos: bool) -> list[Demo]:
    """Every demonstration of the run, encoded: ``sft.data``'s lines, or the task's ``demonstrate`` over its
    training examples (the first ``sft.examples`` of either when > 0)."""
    kw = dict(stop=tuple(cfg.sampling.stop), templated=bool(cfg.sampling.tool_role), eos=eos,
              max_new_tokens=max_new_tokens)
    limit = cfg.sft.examples
    if kw["templated"] and not tok.has_chat_template:
        raise SftError(f"sampling.tool_role = {cfg.sampling.tool_role!r} inserts turns through a chat template, "
                       "and the model's tokenizer has none (tool_role = \"\" inserts their text as it is)")
    if cfg.sft.data:
        demos = []
        for where, messages in read_jsonl(cfg.sft.data, limit):
            prompt, rest = split_prompt(messages)
            demos.append(encode_demo(tok, prompt_example(prompt), rest, where, **kw))
        return demos
    if task.demonstrate is None:
        raise SftError(f"sft.data is empty and the task {task.name!r} has no demonstrate(); give a JSONL of "
                       "demonstrations (--sft.data=FILE)")
    demos = []
    for i, ex in enumerate(task.train):
        if limit and len(demos) >= limit:
            break
        where = f"task {task.name!r} train[{i}] (demonstrate)"
        turns = task_turns(task, ex, where)
        if turns is not None:
            demos.append(encode_demo(tok, ex, turns, where, **kw))
    if not demos:
        raise SftError(f"the task {task.name!r}'s demonstrate() gave no demonstration")
    return demos


# ------------------------------------------------------------------------------------------- the loss


def collate(demos: list[Demo], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(ids (B, Lp + T), attention_mask (B, Lp + T), Lp, mask (B, T)) of `demos` in the Rollout layout:
    prompts left-padded to Lp, responses right-padded to T; mask 1 on the trained (assistant) tokens."""
    Lp = max(len(d.prompt) for d in demos)
    T = max(1, max(len(d.tokens) for d in demos))
    B = len(demos)
    ids = torch.full((B, Lp + T), pad_id, dtype=torch.long)
    am = torch.zeros((B, Lp + T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    for b, d in enumerate(demos):
        p, n = len(d.prompt), len(d.tokens)
        ids[b, Lp - p:Lp] = torch.tensor(d.prompt, dtype=torch.long)
        am[b, Lp - p:Lp + n] = 1
        if n:
            ids[b, Lp:Lp + n] = torch.tensor(d.tokens, dtype=torch.long)
            mask[b, :n] = torch.tensor(d.trained, dtype=torch.float32)
    return ids, am, Lp, mask


def masked_nll(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over the trained tokens: (B, T) log-probs, (B, T) mask -> scalar."""
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def sft_loss(model, ids: torch.Tensor, am: torch.Tensor, Lp: int, mask: torch.Tensor,
             chunk_rows=None) -> torch.Tensor:
    """The cross-entropy of the trained tokens under `model` (temperature 1), with gradient."""
    logp = scoring.sequence_token_logprobs(model, (ids, am, Lp), temperature=1.0, top_p=1.0,
                                            chunk_rows=chunk_rows)                               # (B, T)
    return masked_nll(logp, mask.to(logp.device))


def batches(n: int, batch_size: int, epochs: int, seed: int) -> list[list[int]]:
    """Indices of each step's demonstrations: every epoch a fresh shuffle (random.Random(seed)) cut into
    batches of `batch_size` (the last of an epoch may be smaller)."""
    rng = random.Random(seed)
    out = []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        out += [order[k:k + batch_size] for k in range(0, n, batch_size)]
    return out


# ------------------------------------------------------------------------------------------- the run


def _eval(setup, pool, step: int) -> dict:
    from rlvr.evaluate import evaluate

    cfg = setup.cfg
    res = evaluate(setup.model, setup.tokenizer, setup.task, reward_weights=setup.reward_weights,
                   limits=setup.limits, prompts=cfg.eval.prompts, batch_size=cfg.eval.batch_size, pass_k=0,
                   seed=cfg.train.seed, pool=pool, autocast=setup.numerics.context)
    return {"step": step, **{f"eval/{k}": v for k, v in res.items()}}


def train_sft(cfg: config_mod.Config, out: Path, *, overwrite: bool = False, log=print) -> dict:
    """Train the run's model on its demonstrations and write the run directory `out` (module docstring).
    Every error about the config, the task or the demonstrations comes before anything is written."""
    from rlvr import logprobs
    from rlvr.reward_pool import open_pool
    from rlvr.rundir import RunDir, replace_file
    from rlvr.build import build
    from rlvr.checkpoint import save_checkpoint
    from rlvr.machine import set_threads

    t0 = time.perf_counter()
    _, busy = set_threads(cfg)
    if busy:
        log(f"warning: {busy}")
    run_dir = RunDir(out, log=log)
    run_dir.check_out(overwrite=overwrite)
    setup = build(cfg, log)
    model, tok, task = setup.model, setup.tokenizer, setup.task
    demos = load_demos(cfg, task, tok, setup.limits.max_new_tokens, eos=setup.limits.eos_id is not None)
    plan = batches(len(demos), cfg.sft.batch_size, cfg.sft.epochs, cfg.train.seed)
    if cfg.sft.steps:
        plan = plan[:cfg.sft.steps]
    trained = sum(sum(d.trained) for d in demos)
    log(f"sft: {len(demos)} demonstrations ({trained} trained tokens), {len(plan)} steps of up to "
        f"{cfg.sft.batch_size}, lr {cfg.sft.lr:g}")
    run_dir.prepare(overwrite=overwrite)
    replace_file(run_dir.path / "config.toml", config_mod.to_toml(cfg).encode())
    run_dir.open_logs(cfg, resume_after=None)
    params = model.trainable_params()
    opt = make_optimizer(params, dataclasses.replace(cfg.train, lr=cfg.sft.lr))
    chunk = logprobs.chunk_setting(cfg.model.logprob_chunk_rows)
    first = last = None
    with open_pool(cfg.task, task) as pool:
        if cfg.eval.at_start:
            first = _eval(setup, pool, 0)
            run_dir.metrics(first)
            log(f"step 0: eval/goal {first['eval/goal']:.3f}")
        model.train()
        for step, idx in enumerate(plan, start=1):
            ts = time.perf_counter()
            ids, am, Lp, mask = collate([demos[i] for i in idx], tok.pad_id)
            device = setup.device
            with setup.numerics.context():
                loss = sft_loss(model, ids.to(device), am.to(device), Lp, mask.to(device), chunk)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip if cfg.train.grad_clip else math.inf)
            opt.step()
            row = {"step": step, "sft/loss": float(loss.detach()), "sft/tokens": int(mask.sum()),
                   "sft/grad_norm": float(norm), "sft/epoch": (step - 1) * cfg.sft.batch_size // len(demos),
                   "time/step_s": time.perf_counter() - ts}
            run_dir.metrics(row)
            if step == 1 or step % max(1, cfg.log.print_every) == 0 or step == len(plan):
                log(f"step {step}/{len(plan)}: sft/loss {row['sft/loss']:.4f}")
            if cfg.sft.eval_every and step % cfg.sft.eval_every == 0 and step < len(plan):
                run_dir.metrics(_eval(setup, pool, step))
                model.train()
        last = _eval(setup, pool, len(plan))
        run_dir.metrics(last)
    model.eval()
    save_checkpoint(run_dir.path, model, tok, tag=len(plan))
    summary = {"steps": len(plan), "demonstrations": len(demos), "trained_tokens": trained,
               "final_loss": row["sft/loss"] if plan else None,
               **({"start_eval/goal": first["eval/goal"]} if first else {}),
               **{k: v for k, v in last.items() if k != "step"},
               "wall_s": time.perf_counter() - t0,
               "checkpoint": str(run_dir.path / ("hf" if cfg.model.path else "checkpoint"))}
    run_dir.write_summary(summary)
    log(f"step {len(plan)}: eval/goal {last['eval/goal']:.3f}; start RL with rlvr train CONFIG "
        + (f"--model.path={summary['checkpoint']}" if cfg.model.path else f"--model.init={summary['checkpoint']}"))
    return summary
