"""Loading a run's configuration: TOML files, `--section.key=value` overrides, type checks with
did-you-mean errors that name the file and line, `--help` text, and writing the resolved config back.
"""

from __future__ import annotations

import ast
import codecs
import dataclasses
import difflib
import inspect
import math
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from rlvr.config.schema import SECTIONS, Config, ConfigError
from rlvr.config.validation import validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# ---------------------------------------------------------------------------------------------
# field docs (for --help) and types


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source with `ast`."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def help_text() -> str:
    """Every key, its type, default and docstring: the body of `rlvr train --help`."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]  {cls.__doc__}")
        docs = field_docs(cls)
        types = _field_types(cls)
        default = cls()
        for f in dataclasses.fields(cls):
            t = types[f.name]
            tname = "|".join(map(repr, typing.get_args(t))) if typing.get_origin(t) is Literal else getattr(t, "__name__", str(t))
            lines.append(f"  --{section}.{f.name}={getattr(default, f.name)!r}  ({tname})")
            lines.append(f"      {docs.get(f.name, '')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# loading


def _where(source: str | None, line: int | None) -> str:
    if source is None:
        return "command line"
    return f"{source}:{line}" if line else source


def _line_of(text: str, section: str, key: str | None) -> int | None:
    """1-based line of `key` in `[section]` of a TOML text (or of the section header)."""
    current = ""
    for i, raw in enumerate(text.splitlines(), start=1):
        s = raw.strip()
        if s.startswith("[") and not s.startswith("[["):
            current = s.strip("[]").strip()
            if key is None and current == section:
                return i
            continue
        if current == section and key is not None:
            name = s.split("=", 1)[0].strip().strip('"')
            if "=" in s and name == key:
                return i
        if current == "" and key is not None and section == "" and s.split("=", 1)[0].strip() == key:
            return i
    return None


ALIASES: dict[str, dict[str, str]] = {
    "algorithm.scheme": {"grpo": "normalized", "rloo": "loo"},
}
"""Other names users know for a choice: key -> {alias: canonical value}; replaced when loaded."""


def _did_you_mean(word: Any, choices: Any) -> str:
    """" did you mean 'x'?" for the closest of `choices`, or "" when none is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" did you mean {close[0]!r}?" if close else ""


def _coerce(value: Any, t: Any, key: str, where: str) -> Any:
    """Check (TOML) or parse (command-line string) `value` as type `t`."""
    from_cli = where == "command line" and isinstance(value, str)
    origin = typing.get_origin(t)
    if origin is Literal:
        choices = typing.get_args(t)
        aliases = ALIASES.get(key, {})
        value = aliases.get(value, value) if isinstance(value, str) else value
        if value not in choices:
            hint = _did_you_mean(value, [*choices, *aliases])
            raise ConfigError(f"{key} = {value!r} ({where}): must be one of {', '.join(map(repr, choices))}"
                              + (f";{hint}" if hint else ""))
        return value
    if t is bool:
        if from_cli:
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} ({where}): expected true or false")
    if t is int:
        if from_cli:
            try:
                return int(value)
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} ({where}): expected an integer")
    if t is float:
        if from_cli:
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key} = {value!r} ({where}): expected a number") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{key} = {value!r} ({where}): must be finite")
            return float(value)
        raise ConfigError(f"{key} = {value!r} ({where}): expected a number")
    if t is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} = {value!r} ({where}): expected a string")
    if t in (dict, list):
        if from_cli:
            try:
                value = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{key} = {value!r} ({where}): not a TOML {t.__name__}: {e}") from None
        if isinstance(value, t):
            return value
        raise ConfigError(f"{key} = {value!r} ({where}): expected a {'table' if t is dict else 'list'}")
    raise ConfigError(f"{key}: unsupported field type {t}")  # pragma: no cover


def _field_type(section: str, key: str, where: str) -> Any:
    """The type of `section.key`, or a ConfigError naming the closest known section or key."""
    if section not in SECTIONS:
        raise ConfigError(f"unknown section [{section}] ({where});{_did_you_mean(section, SECTIONS)} "
                          f"known: {', '.join(SECTIONS)}")
    types = _field_types(SECTIONS[section])
    if key not in types:
        raise ConfigError(f"unknown key {section}.{key} ({where});{_did_you_mean(key, types)} "
                          f"[{section}] has: {', '.join(types)}")
    return types[key]


def _set(cfg: Config, section: str, key: str, value: Any, where: str) -> None:
    t = _field_type(section, key, where)
    setattr(getattr(cfg, section), key, _coerce(value, t, f"{section}.{key}", where))


def _set_item(cfg: Config, section: str, key: str, path: list[str], value: str, where: str) -> None:
    """`--section.key.a.b=value` on a table field: set one entry and keep the others (merging).

    The value is parsed as a TOML value, or kept as a plain string when it is not one.
    """
    t = _field_type(section, key, where)
    dotted = ".".join([section, key, *path])
    if t is not dict:
        raise ConfigError(f"{dotted} ({where}): {section}.{key} is not a table, so it has no entries; "
                          f"use --{section}.{key}=VALUE")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    obj = getattr(cfg, section)
    table = dict(getattr(obj, key))
    setattr(obj, key, table)
    for i, name in enumerate(path[:-1]):
        inner = table.get(name, {})
        if not isinstance(inner, dict):
            raise ConfigError(f"{dotted} ({where}): {'.'.join([section, key, *path[:i + 1]])} = {inner!r} "
                              f"is not a table")
        table[name] = dict(inner)
        table = table[name]
    table[path[-1]] = parsed


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then `--section.key=value` overrides; then `validate`.

    `--section.key.name=value` sets one entry of a table field (task.options, task.reward_weights)
    and keeps the others; `--section.key={...}` replaces the table.
    """
    cfg = Config()
    origins: dict[str, str] = {}  # "section.key" -> where its value was set (file:line or command line)
    if path is not None:
        path = Path(path)
        text = read_text(path, "config file")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{section} = {table!r} ({_where(str(path), _line_of(text, '', section))}): "
                    f"top-level keys must be sections like [train]"
                )
            for key, value in table.items():
                where = _where(str(path), _line_of(text, section, key))
                _set(cfg, section, key, value, where)
                origins[f"{section}.{key}"] = where
    for item in overrides or []:
        body = item[2:] if item.startswith("--") else item
        if "=" not in body or "." not in body.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected --section.key=value")
        dotted, value = body.split("=", 1)
        section, key, *in_table = dotted.split(".")
        if not all((section, key, *in_table)):
            raise ConfigError(f"override {item!r}: empty name in {dotted!r}")
        if in_table:
            _set_item(cfg, section, key, in_table, value, "command line")
        else:
            _set(cfg, section, key, value, "command line")
        origins[f"{section}.{key}"] = "command line"
    cfg.__dict__["_origins"] = origins  # not a field: to_toml / to_dict never see it
    validate(cfg, source=str(path) if path else None)
    return cfg


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of a file, a leading UTF-8 byte-order mark (as some editors save) dropped;
    ConfigError naming the file (and the line of a non-UTF-8 byte) when it is missing, a directory,
    unreadable or not UTF-8."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory, not a file")
    if not path.exists():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it: {e.strerror or e}") from None
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {col}); "
                          "save the file as UTF-8") from None


# ---------------------------------------------------------------------------------------------
# writing (the resolved config of a run)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML text that `load` reads back to an equal Config."""
    out = []
    for section in SECTIONS:
        out.append(f"[{section}]")
        for f in dataclasses.fields(getattr(cfg, section)):
            out.append(f"{f.name} = {_toml_value(getattr(getattr(cfg, section), f.name))}")
        out.append("")
    return "\n".join(out)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
