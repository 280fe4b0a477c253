"""Config: TOML + overrides, strict errors that name the key, file and line; round trip."""

import dataclasses

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
    ("[algorithm]\nscheme = \"ppo\"\n", r"algorithm\.scheme.*c\.toml:2.*must be one of"),
    ("[train]\nsteps = 0\n", r"train\.steps: must be >= 1, got 0 \(.*c\.toml:2\)"),
    ("[train]\nseed = 1\n\nlr = -1.0\n", r"train\.lr: must be > 0, got -1\.0 \(.*c\.toml:4\)"),
    ("[sampling]\n# nucleus\ntop_p = 1.5\n", r"sampling\.top_p: must be in \(0, 1\], got 1\.5 \(.*c\.toml:3\)"),
    ("[sampling]\ntop_p = 1.5\n", r"sampling\.top_p"),
    ("[sampling]\ntop_k = -1\n", r"sampling\.top_k: must be >= 0 \(0 = off\), got -1 \(.*c\.toml:2\)"),
    ("[sampling]\nmin_p = 1.0\n", r"sampling\.min_p: must be in \[0, 1\) \(0 = off\), got 1\.0 \(.*c\.toml:2\)"),
    ("[sampling]\ntemperature = 0.0\n", r"sampling\.temperature"),
    ("[algorithm]\nscheme = \"loo\"\n[train]\nsamples_per_prompt = 1\n", r"loo"),
    ("[algorithm]\ntop_k = 9\n", r"algorithm\.top_k"),
    ("[model]\nn_head = 3\n", r"model\.n_head"),
    ("steps = 3\n", r"steps.*c\.toml:1.*sections"),
    ("[algorithm]\nobjective = \"grpo\"\n", r"algorithm\.objective.*c\.toml:2.*'ppo_clip', 'cispo'"),
    ("[algorithm]\ndual_clip_c = 0.5\n", r"algorithm\.dual_clip_c: must be > 1"),
    ("[algorithm]\ndual_clip_c = -3.0\n", r"algorithm\.dual_clip_c: must be >= 0"),
    ("[algorithm]\ndual_clip_c = 3.0\nobjective = \"cispo\"\n", r"algorithm\.dual_clip_c.*ppo_clip"),
    ("[algorithm]\nkl_in = \"reward\"\n", r"algorithm\.kl_in.*kl_coef"),
    ("[algorithm]\nkl_in = \"both\"\n", r"algorithm\.kl_in.*'loss', 'reward'"),
    ("[algorithm]\nentropy_coef = -0.01\n", r"algorithm\.entropy_coef"),
    ("[algorithm]\noverlong_buffer = -1\n", r"algorithm\.overlong_buffer"),
    ("[algorithm]\noverlong_buffer = 9\n[sampling]\nmax_new_tokens = 8\n", r"algorithm\.overlong_buffer.*max_new_tokens"),
    ("[algorithm]\noverlong_penalty = 0.0\n", r"algorithm\.overlong_penalty"),
    ("[algorithm]\nprocess_delta = \"sum\"\n", r"algorithm\.process_delta.*'per_step_centered', 'return_to_go'"),
    ("[algorithm]\nvalue_lr = 0.0\n", r"algorithm\.value_lr: must be > 0"),
    ("[algorithm]\nscheme = \"baseline\"\n", r"algorithm\.scheme.*learned"),
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
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{section}.{f.name} has no docstring"
    assert "--train.samples_per_prompt" in config.help_text()


def test_algorithm_menu_loads_and_shows_in_help():
    cfg = config.load(None, ["--algorithm.objective=cispo", "--algorithm.clip_eps_high=4.0", "--algorithm.kl_coef=0.05",
                             "--algorithm.kl_in=reward", "--algorithm.scheme=batch_normalized",
                             "--algorithm.entropy_coef=0.001", "--algorithm.overlong_buffer=2",
                             "--algorithm.overlong_penalty=0.5"])
    a = cfg.algorithm
    assert (a.objective, a.kl_in, a.entropy_coef, a.overlong_buffer, a.overlong_penalty) == ("cispo", "reward", 0.001, 2, 0.5)
    assert config.load(None, ["--algorithm.dual_clip_c=3"]).algorithm.dual_clip_c == 3.0
    text = config.help_text()
    for key in ("objective", "dual_clip_c", "kl_in", "entropy_coef", "overlong_buffer", "overlong_penalty",
                "process_delta", "value_lr"):
        assert f"--algorithm.{key}=" in text, key


def test_learned_scheme_works_with_one_sample_per_prompt():
    cfg = config.load(None, ["--algorithm.scheme=learned", "--train.samples_per_prompt=1", "--algorithm.value_lr=0.01"])
    assert cfg.algorithm.scheme == "learned" and cfg.algorithm.value_lr == 0.01
    assert "'learned'" in config.help_text()


def test_range_error_from_the_command_line_says_so(tmp_path):
    p = write(tmp_path, "[train]\nsteps = 5\n")
    with pytest.raises(ConfigError, match=r"train\.steps: must be >= 1, got 0 \(command line\)"):
        config.load(p, ["--train.steps=0"])
    cfg = config.Config()
    cfg.train.steps = 0
    with pytest.raises(ConfigError, match=r"in .*c\.toml or the command line"):  # validate() without origins
        config.validate(cfg, source=str(p))


def test_one_option_is_set_and_the_others_kept(tmp_path):
    p = write(tmp_path, "[task]\noptions = { n = 5, low = 0, high = 9 }\n")
    cfg = config.load(p, ["--task.options.n=6"])
    assert cfg.task.options == {"n": 6, "low": 0, "high": 9}
    # TOML values keep their type; a bare word is a string; dotted names reach nested tables
    cfg = config.load(p, ["--task.options.high=9.5", "--task.options.name=leg_counting",
                          "--task.options.name2=\"6\"", "--task.options.extra.depth=2"])
    assert cfg.task.options == {"n": 5, "low": 0, "high": 9.5, "name": "leg_counting", "name2": "6",
                                "extra": {"depth": 2}}
    # the whole table is still replaced by the table form, and later overrides merge into it
    assert config.load(p, ["--task.options={n = 3}", "--task.options.low=1"]).task.options == {"n": 3, "low": 1}
    # other table fields merge the same way; the result is validated like any value
    assert config.load(p, ["--task.reward_weights.exact=2"]).task.reward_weights == {"exact": 2}
    with pytest.raises(ConfigError, match=r"task\.reward_weights\.exact: must be a finite number.*command line"):
        config.load(p, ["--task.reward_weights.exact=lots"])


def test_entry_of_a_field_that_is_not_a_table_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.steps\.x \(command line\): train\.steps is not a table"):
        config.load(None, ["--train.steps.x=1"])
    with pytest.raises(ConfigError, match=r"task\.options\.n = 5 is not a table"):
        config.load(None, ["--task.options.n=5", "--task.options.n.deep=1"])
    with pytest.raises(ConfigError, match="empty name"):
        config.load(None, ["--task.options..n=1"])


@pytest.mark.parametrize("alias,canonical", [("grpo", "normalized"), ("rloo", "loo")])
def test_scheme_aliases_are_stored_under_the_canonical_name(tmp_path, alias, canonical):
    p = write(tmp_path, f"[algorithm]\nscheme = \"{alias}\"\n")
    assert config.load(p).algorithm.scheme == canonical
    assert config.load(None, [f"--algorithm.scheme={alias}"]).algorithm.scheme == canonical
    assert f'scheme = "{canonical}"' in config.to_toml(config.load(p))
    assert alias in config.field_docs(config.AlgorithmConfig)["scheme"]


@pytest.mark.parametrize("override,match", [
    ("--train.stepz=3", r"unknown key train\.stepz \(command line\); did you mean 'steps'\? \[train\] has: steps"),
    ("--trian.steps=3", r"unknown section \[trian\] \(command line\); did you mean 'train'\? known: model"),
    ("--algorithm.scheme=normalised", r"must be one of .*; did you mean 'normalized'\?"),
    ("--algorithm.scheme=grp", r"did you mean 'grpo'\?"),
    ("--train.qqq=3", r"unknown key train\.qqq \(command line\); \[train\] has:"),  # nothing close: no guess
])
def test_did_you_mean(override, match):
    with pytest.raises(ConfigError, match=match):
        config.load(None, [override])


def test_did_you_mean_in_a_file_names_the_line(tmp_path):
    p = write(tmp_path, "[sampling]\ntemprature = 0.7\n")
    with pytest.raises(ConfigError, match=r"sampling\.temprature \(.*c\.toml:2\); did you mean 'temperature'\?"):
        config.load(p)
