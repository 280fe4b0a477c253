"""Resumable training state, without pickle: tensors in safetensors, everything else in JSON.

`run_dir/state/` holds `tensors.safetensors` (policy, reference when held, AdamW moments, the
sampling generator's state) and `state.json` (step, optimizer hyper-parameters, scheduler
counters, the prompt-order RNG, the cost counters, training seconds so far). Written to a
temporary directory and renamed into place, so a run killed mid-write keeps its previous state.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

STATE_DIR = "state"


def save_state(run_dir: Path, *, step: int, model, opt: torch.optim.Optimizer, sched, ref, rng: random.Random,
               gen: torch.Generator, cost: dict, wall: float, learn_gen: torch.Generator | None = None,
               extra: dict | None = None) -> None:
    """Write everything a resumed run needs; `extra` is any further JSON state (policy version,
    warning-rule history)."""
    tensors: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        tensors[f"model.{k}"] = v.detach().contiguous().cpu()
    if ref is not None:
        for k, v in ref.state_dict().items():
            tensors[f"ref.{k}"] = v.detach().contiguous().cpu()
    opt_sd = opt.state_dict()
    for idx, st in opt_sd["state"].items():
        for name, v in st.items():
            tensors[f"opt.{idx}.{name}"] = torch.as_tensor(v).detach().contiguous().cpu()
    tensors["generator"] = gen.get_state()
    if learn_gen is not None:
        tensors["learn_generator"] = learn_gen.get_state()
    meta = {
        "step": step,
        "param_groups": opt_sd["param_groups"],
        "sched": {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"},
        "rng": _jsonable(rng.getstate()),
        "cost": cost,
        "wall": wall,
        "extra": extra or {},
    }
    final = Path(run_dir) / STATE_DIR
    tmp = Path(run_dir) / (STATE_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "tensors.safetensors"))
    (tmp / "state.json").write_text(json.dumps(meta))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def load_state(run_dir: Path, *, model, opt: torch.optim.Optimizer, sched, ref, rng: random.Random,
               gen: torch.Generator, learn_gen: torch.Generator | None = None) -> dict:
    """Restore everything `save_state` wrote; returns {"step", "cost", "wall", "extra"}."""
    d = Path(run_dir) / STATE_DIR
    tensors = load_file(str(d / "tensors.safetensors"))
    meta = json.loads((d / "state.json").read_text())
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    if ref is not None:
        ref.load_state_dict({k[len("ref."):]: v for k, v in tensors.items() if k.startswith("ref.")})
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, idx, name = k.split(".", 2)
            state.setdefault(int(idx), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    sched.load_state_dict({**meta["sched"], "lr_lambdas": [None] * len(opt.param_groups)})
    rng.setstate(_tuples(meta["rng"]))
    gen.set_state(tensors["generator"])
    if learn_gen is not None and "learn_generator" in tensors:
        learn_gen.set_state(tensors["learn_generator"])
    return {"step": meta["step"], "cost": meta["cost"], "wall": meta["wall"], "extra": meta.get("extra", {})}


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x
