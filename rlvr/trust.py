"""Run directories are data: `refuse_run_task` keeps eval, probe and audit from loading anything but
the project's own task factories (rlvr.tasks.*) when a run directory's config.toml names the task or
a file or module in its options (someone else's run directory would run their code), and
`run_config_guard` holds every import made while the task is built to the same rule, unless the user
names the task again (`--task.path=...`) or passes `--trust-run-config`. `refuse_links_out` keeps
them from reading outside a run directory through a symbolic link in it. Training (rlvr.trainer),
evaluation and the probe share these, so each rule lives in one place.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Sequence

from rlvr import config as config_mod
from rlvr.setup_types import RunError
from rlvr.tasks import foreign_code, names_code, project_task_refusal, split_path, untrusted_config


def is_run_dir(d: Path) -> bool:
    """A folder `rlvr train` wrote (config.toml beside price.json or metrics.jsonl), or its best/."""
    d = Path(d)
    return (d / "config.toml").is_file() and any((d / f).is_file() for f in ("price.json", "metrics.jsonl", "best.json"))


RUN_CONFIG = "config.toml"
"""The name of the config `rlvr train` writes into a run directory."""


def is_run_config(config_file: Path) -> bool:
    """True when a config the user points probe or audit at is to be read as a run directory's (data):
    it is named config.toml (what `rlvr train` writes, and what a copied run directory holds) or sits
    beside a file rlvr writes into a run (price.json, metrics.jsonl, best.json, summary.json)."""
    config_file = Path(config_file)
    beside = ("price.json", "metrics.jsonl", "best.json", "summary.json")
    return config_file.name == RUN_CONFIG or any(os.path.lexists(config_file.parent / f) for f in beside)


def _user_options(overrides: Sequence[str]) -> set[str] | None:
    """The top-level `task.options` keys the command line sets (`--task.options.KEY=...`); None when it
    replaces the whole table (`--task.options=...`)."""
    keys: set[str] = set()
    for o in overrides:
        name = o.split("=", 1)[0]
        if name == "--task.options":
            return None
        if name.startswith("--task.options."):
            keys.add(name[len("--task.options."):].split(".")[0])
    return keys


def _options_key(key: str) -> str:
    """The top-level option of a `foreign_code` key: "task.options.rewards[1].path" -> "rewards"."""
    return key[len("task.options."):].split(".")[0].split("[")[0]


def _user_named(cfg: config_mod.Config, overrides: Sequence[str]) -> tuple[bool, set[str] | None]:
    """(the command line names the task path, the options it sets: see `_user_options`)."""
    return any(o.startswith("--task.path=") for o in overrides), _user_options(overrides)


def refuse_run_task(cfg: config_mod.Config, config_file: Path, *, overrides: Sequence[str] = (),
                    trusted: bool = False) -> None:
    """RunError, before anything is imported, when `cfg` (read from a run directory's `config_file`, or
    any config the user did not pass as their own) names code other than the project's own task
    factories: a run directory is data, and its config could name any module, file or builtin.

    The task path must be `rlvr.tasks.NAME:factory` (a function defined there returning a Task, or a Task
    value: `rlvr.tasks.project_task_refusal`) unless the user names it again (`--task.path=...`); no string
    in `task.options` may name a Python file or a `module:NAME` outside rlvr.tasks
    (`rlvr.tasks.foreign_code`) unless the user sets that option (`--task.options...`). `trusted`
    (`--trust-run-config`) lifts both. The error names the key and the file."""
    if trusted:
        return
    path_given, keys = _user_named(cfg, overrides)
    hint = ("a run directory is data, so its config may name only the project's task factories (rlvr.tasks.*) "
            "unless you say so (a copied run directory could run anything)")
    if not path_given:
        why = project_task_refusal(cfg.task.path)
        if why is not None:
            raise RunError(f"{config_file}: task.path {why}; {hint}. Pass --task.path={cfg.task.path} to load it "
                           f"anyway (or another task), or --trust-run-config")
    for key, value in foreign_code(cfg.task.options):
        top = _options_key(key)
        if keys is None or top in keys:
            continue
        raise RunError(f"{config_file}: {key} = {value!r} names code outside the project's task modules; {hint}. "
                       f"Set --task.options.{top}=... yourself, or pass --trust-run-config")


def run_config_guard(cfg: config_mod.Config, config_file: Path, *, overrides: Sequence[str] = (),
                     trusted: bool = False) -> contextlib.AbstractContextManager:
    """The block in which a run directory's task is loaded (`rlvr.tasks.untrusted_config`): every import by
    name made while the task is built (a mixture's components, a dataset task's rewards) must be a module
    of rlvr.tasks, or what the command line itself named. No restriction when `trusted`."""
    if trusted:
        return contextlib.nullcontext()
    path_given, keys = _user_named(cfg, overrides)
    allow = {split_path(cfg.task.path)[0]} if path_given else set()
    for key, value in foreign_code(cfg.task.options):
        if keys is None or _options_key(key) in keys:
            allow.add(names_code(value))
    return untrusted_config(str(config_file), allow=sorted(allow))


def refuse_links_out(run_dir: Path, *, trusted: bool = False) -> None:
    """RunError naming the first symbolic link under `run_dir` (files and folders, links not followed
    into) whose target lies outside it: someone else's run directory could link its config.toml or
    a weights or tokenizer file to a private file of the user's, and loading the run would read it
    (and a parse error could print part of it). rlvr itself writes no links. `trusted`
    (--trust-run-config) allows them: a user's own directory may link large weights to another disk."""
    if trusted:
        return
    root = Path(run_dir).resolve()
    for where, dirs, files in os.walk(run_dir):
        for name in sorted(dirs + files):
            p = Path(where) / name
            if p.is_symlink() and not p.resolve().is_relative_to(root):
                raise RunError(f"{p} is a symbolic link to {os.readlink(p)}, outside the run directory {run_dir}: "
                               f"loading a run reads only its own files; copy the file in, or pass --trust-run-config "
                               f"if the directory is yours")
