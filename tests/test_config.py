"""Config: TOML + overrides, strict errors that name the key, file and line; round trip."""

import pytest

from rlvr import config
from rlvr.config import ConfigError


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_file_then_overrides(tmp_path):
    p = write(tmp_path, "[train]\nsteps = 7\nlr = 0.01\n[algorithm]\nscheme = \"loo\"\n")
    cfg = config.load(p, ["--train.steps=9", "--sampling.temperature=0.5", "--task.options={n = 4}"])
    assert cfg.train.steps == 9 and cfg.train.lr == 0.01 and cfg.algorithm.scheme == "loo"
    assert cfg.sampling.temperature == 0.5 and cfg.task.options == {"n": 4}


def test_round_trip(tmp_path):
    cfg = config.load(None, ["--train.seed=3", "--task.reward_weights={position = 1.0, exact = 2.0}"])
    p = write(tmp_path, config.to_toml(cfg))
    assert config.load(p) == cfg


def test_unknown_key_names_key_file_and_line(tmp_path):
    p = write(tmp_path, "[train]\nsteps = 5\n\nstepz = 3\n")
    with pytest.raises(ConfigError, match=r"train\.stepz.*c\.toml:4"):
        config.load(p)


def test_unknown_section(tmp_path):
    p = write(tmp_path, "[trian]\nsteps = 5\n")
    with pytest.raises(ConfigError, match=r"unknown section \[trian\]"):
        config.load(p)


@pytest.mark.parametrize("text,match", [
    ("[train]\nsteps = \"ten\"\n", r"train\.steps.*c\.toml:2.*integer"),
    ("[train]\nsteps = 1.5\n", r"train\.steps.*integer"),
    ("[algorithm]\nscheme = \"grpo\"\n", r"algorithm\.scheme.*must be one of"),
    ("[train]\nsteps = 0\n", r"train\.steps: must be >= 1"),
    ("[sampling]\ntop_p = 1.5\n", r"sampling\.top_p"),
    ("[sampling]\ntemperature = 0.0\n", r"sampling\.temperature"),
    ("[algorithm]\nscheme = \"loo\"\n[train]\nsamples_per_prompt = 1\n", r"loo"),
    ("[algorithm]\ntop_k = 9\n", r"algorithm\.top_k"),
    ("[model]\nn_head = 3\n", r"model\.n_head"),
    ("steps = 3\n", r"steps.*c\.toml:1.*sections"),
])
def test_bad_values(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        config.load(write(tmp_path, text))


def test_bad_override():
    with pytest.raises(ConfigError, match=r"train\.lr.*command line.*number"):
        config.load(None, ["--train.lr=fast"])
    with pytest.raises(ConfigError, match="expected --section.key=value"):
        config.load(None, ["--steps=3"])


def test_every_field_has_a_docstring():
    for section, cls in config.SECTIONS.items():
        docs = config.field_docs(cls)
        for f in config.dataclasses.fields(cls):
            assert docs.get(f.name), f"{section}.{f.name} has no docstring"
    assert "--train.samples_per_prompt" in config.help_text()
