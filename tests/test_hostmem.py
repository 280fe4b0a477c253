"""train.host_memory: a training process keeps freed host memory for reuse (glibc), or takes the C library's defaults."""

from __future__ import annotations

import io
import json
import os
import platform
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from rlvr import config as config_mod, hostmem, trainer
from rlvr.cli import main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sort.toml"
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# In a fresh interpreter: apply a mode, then allocate, touch and free a 64 MiB tensor ten times (the first ones
# grow the heap until its blocks settle), then three windows of five more; print each window's minor page faults
# and the mode's line. The test reads the quietest window: in about one full test run of three here, one window
# of a kept process faulted pages in again (three blocks' worth, not reproduced in isolation), something outside
# the allocator; a process under the system defaults faults every block in, in every window.
CHILD = """
import json, resource, sys, torch
from rlvr.hostmem import set_host_memory
line = set_host_memory(sys.argv[1], sys.argv[2] == "checkpointing")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(16 * 2**20).sum()
windows = []
for _ in range(3):
    before = faults()
    for _ in range(5):
        torch.ones(16 * 2**20).sum()
    windows.append(faults() - before)
print(json.dumps({"faults": windows, "line": line}))
"""


def child(mode: str, checkpointing: bool = False) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, "checkpointing" if checkpointing else "-"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the allocator setting is glibc's (mallopt)")
def test_keep_reuses_freed_blocks_and_system_faults_them_in_again():
    kept, system = child("keep"), child("system")
    pages = 5 * 64 * 2**20 // 4096                        # a window's five rounds' pages: 81,920
    assert min(system["faults"]) > pages // 2, system     # glibc maps each 64 MiB block afresh and unmaps it
    assert min(kept["faults"]) < 200, kept                # the freed block is reused: no new pages
    assert kept["line"] == "host memory: kept (glibc: no mmap, no trim)"
    assert "defaults" in system["line"]


@pytest.mark.skipif(not GLIBC, reason="the allocator setting is glibc's (mallopt)")
def test_auto_keeps_freed_blocks_except_in_a_run_with_gradient_checkpointing():
    assert hostmem.resolve("auto", False) == "keep" and hostmem.resolve("auto", True) == "system"
    assert hostmem.resolve("keep", True) == "keep" and hostmem.resolve("system", False) == "system"
    kept, returned = child("auto"), child("auto", checkpointing=True)
    pages = 5 * 64 * 2**20 // 4096
    assert min(kept["faults"]) < 200 and kept["line"] == "host memory: kept (glibc: no mmap, no trim)"
    assert min(returned["faults"]) > pages // 2, returned
    assert returned["line"] == ("host memory: the C library's defaults (train.host_memory = auto with "
                                "model.gradient_checkpointing: memory goes back between steps)")
    assert config_mod.Config().train.host_memory == "auto"                        # the default


def test_a_mode_not_known_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="train.host_memory"):
        hostmem.set_host_memory("never")
    with pytest.raises(config_mod.ConfigError, match=r"train\.host_memory = 'never' \(command line\)"):
        config_mod.load(EXAMPLE, ["--train.host_memory=never"])
    bad = tmp_path / "bad.toml"
    bad.write_text('[train]\nhost_memory = "kep"\n')
    with pytest.raises(config_mod.ConfigError, match=r"host_memory.*bad\.toml.*did you mean 'keep'"):
        config_mod.load(bad, [])


def stub(got: list):
    """A set_host_memory that records the (mode, checkpointing) it was given."""
    return lambda m, checkpointing=False: got.append((m, checkpointing)) or f"host memory: {m} (stub)"


@pytest.mark.parametrize("mode", ["auto", "keep", "system"])
def test_the_trainer_applies_the_configured_mode_and_says_so(tmp_path, monkeypatch, mode):
    got = []
    monkeypatch.setattr(trainer, "set_host_memory", stub(got))
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["train", str(EXAMPLE), "--out", str(tmp_path / "run"), "--model.init=", "--model.n_embd=16",
                   "--model.n_layer=1", "--model.n_head=2", "--train.steps=1", "--train.prompts_per_step=2",
                   "--train.samples_per_prompt=2", "--eval.every=0", "--eval.at_start=false", "--eval.prompts=4",
                   "--eval.pass_k=0", "--task.options={n = 3, heldout = 10}", f"--train.host_memory={mode}"])
    assert rc == 0 and got == [(mode, False)]
    assert f"host memory: {mode} (stub)" in out.getvalue()
    assert f'host_memory = "{mode}"' in (tmp_path / "run" / "config.toml").read_text()
    # rlvr eval and rlvr probe of the finished run sample as its training did: the same allocator setting
    monkeypatch.setattr(hostmem, "set_host_memory", stub(got))
    with redirect_stdout(io.StringIO()):
        assert main(["eval", str(tmp_path / "run"), "--prompts", "2"]) == 0
        assert main(["probe", str(tmp_path / "run" / "config.toml"), "--checkpoint", str(tmp_path / "run"),
                     "--prompts", "2", "--samples", "2"]) == 0
    assert got == [(mode, False)] * 3


def test_a_run_with_gradient_checkpointing_hands_it_to_the_setting(tmp_path, monkeypatch):
    """auto reads model.gradient_checkpointing: the trainer and rlvr eval pass the run's."""
    pytest.importorskip("transformers")
    from hf_models import make_model_dir

    got = []
    monkeypatch.setattr(trainer, "set_host_memory", stub(got))
    monkeypatch.setattr(hostmem, "set_host_memory", stub(got))
    with redirect_stdout(io.StringIO()):
        rc = main(["train", str(EXAMPLE), "--out", str(tmp_path / "run"), f"--model.path={make_model_dir(tmp_path / 'm')}",
                   "--model.gradient_checkpointing=true", "--train.steps=1", "--train.prompts_per_step=2",
                   "--train.samples_per_prompt=2", "--eval.every=0", "--eval.at_start=false", "--eval.prompts=4",
                   "--eval.pass_k=0", "--task.options={n = 3, heldout = 10}"])
        assert rc == 0
        assert main(["eval", str(tmp_path / "run"), "--prompts", "2"]) == 0
    assert got == [("auto", True)] * 2


def test_jemalloc_is_preloaded_by_running_the_command_again_once(monkeypatch):
    monkeypatch.setattr(hostmem, "allocator_library", lambda: "/opt/lib/libjemalloc.so.2")
    monkeypatch.setattr(hostmem.platform, "system", lambda: "Linux")
    env = hostmem.preload_env("jemalloc", {"LD_PRELOAD": "libother.so", "HOME": "/h"})
    assert env == {"LD_PRELOAD": "/opt/lib/libjemalloc.so.2:libother.so", "HOME": "/h",
                   hostmem.PRELOADED: "/opt/lib/libjemalloc.so.2"}
    assert hostmem.preload_env("jemalloc", env) is None                 # the process started so: not again
    assert all(hostmem.preload_env(m, {}) is None for m in ("auto", "keep", "system"))
    assert hostmem.resolve("jemalloc", True) == "jemalloc"
    monkeypatch.setattr(hostmem, "allocator_library", lambda: None)
    with pytest.raises(ValueError, match="train.host_memory = jemalloc: no jemalloc library found"):
        hostmem.preload_env("jemalloc", {})
    monkeypatch.setattr(hostmem.platform, "system", lambda: "Darwin")
    with pytest.raises(ValueError, match="train.host_memory = jemalloc needs Linux"):
        hostmem.preload_env("jemalloc", {})
    # a process not started so says what holds: glibc's allocator
    assert "this process was not started so" in hostmem.set_host_memory("jemalloc")


def test_rlvr_train_runs_itself_again_with_jemalloc_before_it_builds_anything(tmp_path, monkeypatch):
    import rlvr.cli

    monkeypatch.setattr(hostmem, "allocator_library", lambda: "/opt/lib/libjemalloc.so.2")
    monkeypatch.delenv(hostmem.PRELOADED, raising=False)
    calls = []

    def execve(path, argv, env):
        calls.append((path, argv, env))
        raise SystemExit(0)
    monkeypatch.setattr(rlvr.cli.os, "execve", execve)
    argv = ["train", str(EXAMPLE), "--out", str(tmp_path / "run"), "--train.steps=1", "--train.host_memory=jemalloc"]
    with pytest.raises(SystemExit):
        main(argv)
    [(path, args, env)] = calls
    assert path == sys.executable and args == [sys.executable, "-m", "rlvr", *argv]
    assert env["LD_PRELOAD"].split(":")[0] == "/opt/lib/libjemalloc.so.2" and env[hostmem.PRELOADED]
    assert not (tmp_path / "run").exists()                               # nothing built or written before
    # none found: a clear error, nothing written
    monkeypatch.setattr(hostmem, "allocator_library", lambda: None)
    err = io.StringIO()
    from contextlib import redirect_stderr
    with redirect_stderr(err):
        assert main(argv) == 2
    assert "train.host_memory = jemalloc: no jemalloc library found" in err.getvalue()
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD is the Linux loader's")
def test_a_run_with_jemalloc_runs_with_it_mapped(tmp_path):
    """The real command in a fresh process: it starts itself again with jemalloc preloaded where
    this machine has one (the test extra installs Ray, whose wheel ships it) and says so; where
    none is found it stops with the error before writing anything."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlvr", "train", str(EXAMPLE), "--out", str(out), "--model.init=",
                           "--model.n_embd=16", "--model.n_layer=1", "--model.n_head=2", "--train.steps=1",
                           "--train.prompts_per_step=2", "--train.samples_per_prompt=2", "--eval.every=0",
                           "--eval.at_start=false", "--eval.prompts=4", "--eval.pass_k=0",
                           "--task.options={n = 3, heldout = 10}", "--train.host_memory=jemalloc"],
                          capture_output=True, text=True)
    if hostmem.allocator_library() is None:
        assert proc.returncode == 2 and "no jemalloc library found" in proc.stderr and not out.exists()
        return
    assert proc.returncode == 0, proc.stderr
    assert "host memory: jemalloc (preloaded: " in proc.stdout
    assert (out / "summary.json").is_file()


def test_an_allocator_preloaded_from_outside_is_named_instead_of_glibcs_settings():
    """A process started with a malloc replacement in LD_PRELOAD (not by rlvr): glibc's mallopt still
    answers, but the line names the library that serves the allocations instead of claiming glibc's
    settings. Where no jemalloc is found, a name in LD_PRELOAD that is not mapped changes nothing."""
    script = "import sys; from rlvr.hostmem import set_host_memory; print(set_host_memory(sys.argv[1]))"
    env = {k: v for k, v in os.environ.items() if k != hostmem.PRELOADED}
    lib = hostmem.allocator_library()
    if lib is not None:
        for mode in ("keep", "system"):
            got = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True,
                                 env=env | {"LD_PRELOAD": lib}).stdout.strip().splitlines()[-1]
            assert got == (f"host memory: {Path(lib).name} (preloaded from outside rlvr, LD_PRELOAD); "
                           f"train.host_memory = {mode}'s glibc settings do not reach it")
    if GLIBC:      # a replacement's name that the loader cannot map (it warns and goes on): glibc's settings hold
        got = subprocess.run([sys.executable, "-c", script, "keep"], capture_output=True, text=True, check=True,
                             env=env | {"LD_PRELOAD": "/nonexistent/libjemalloc.so.2"}).stdout.strip().splitlines()[-1]
        assert got == "host memory: kept (glibc: no mmap, no trim)"


def test_auto_asks_for_jemalloc_for_a_hugging_face_model_on_the_cpu_where_it_can_be_had(monkeypatch):
    """auto's rule (auto_takes_jemalloc) and what preload_env makes of it: the environment to run again
    with where the library is found on Linux; nothing, and never an error, where it cannot be had or
    another malloc replacement is preloaded already; and auto in the process started so is jemalloc."""
    assert hostmem.auto_takes_jemalloc(True, "cpu")
    assert not hostmem.auto_takes_jemalloc(False, "cpu")                 # the built-in tiny model: keep
    assert not hostmem.auto_takes_jemalloc(True, "cuda")
    monkeypatch.setattr(hostmem, "allocator_library", lambda: "/opt/lib/libjemalloc.so.2")
    monkeypatch.setattr(hostmem.platform, "system", lambda: "Linux")
    env = hostmem.preload_env("auto", {"HOME": "/h"}, auto_jemalloc=True)
    assert env == {"LD_PRELOAD": "/opt/lib/libjemalloc.so.2", "HOME": "/h", hostmem.PRELOADED: "/opt/lib/libjemalloc.so.2"}
    assert hostmem.preload_env("auto", env, auto_jemalloc=True) is None             # started so: not again
    assert hostmem.preload_env("auto", {"HOME": "/h"}) is None                       # the rule said no
    assert hostmem.preload_env("auto", {"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, auto_jemalloc=True) is None
    monkeypatch.setattr(hostmem, "allocator_library", lambda: None)
    assert hostmem.preload_env("auto", {}, auto_jemalloc=True) is None               # none found: keep, no error
    monkeypatch.setattr(hostmem, "allocator_library", lambda: "/opt/lib/libjemalloc.so.2")
    monkeypatch.setattr(hostmem.platform, "system", lambda: "Darwin")
    assert hostmem.preload_env("auto", {}, auto_jemalloc=True) is None
    # in the process started so (PRELOADED set and the library mapped), auto is jemalloc and says why
    monkeypatch.setenv(hostmem.PRELOADED, "/opt/lib/libjemalloc.so.2")
    monkeypatch.setattr(hostmem, "_mapped", lambda name: name == "libjemalloc.so.2")
    assert hostmem.resolve("auto", False) == "jemalloc" and hostmem.resolve("auto", True) == "jemalloc"
    for checkpointing in (False, True):                            # gradient checkpointing or not
        assert hostmem.set_host_memory("auto", checkpointing) == (
            "host memory: jemalloc (preloaded: /opt/lib/libjemalloc.so.2; "
            "train.host_memory = auto: a Hugging Face model on the CPU)")
    assert hostmem.set_host_memory("jemalloc") == "host memory: jemalloc (preloaded: /opt/lib/libjemalloc.so.2)"
    monkeypatch.setattr(hostmem, "_mapped", lambda name: False)     # the variable inherited, the library not mapped
    assert hostmem.resolve("auto", False) == "keep" and hostmem.resolve("auto", True) == "system"


def test_auto_runs_the_command_again_with_jemalloc_only_where_it_owns_its_process(tmp_path, monkeypatch):
    """`rlvr train` from the command line (main() reading sys.argv) with a Hugging Face model and auto
    runs itself again with jemalloc before it builds anything; the same call from Python (main(argv), as
    a notebook or a test makes it) never replaces its caller's process, and the tiny model stays."""
    pytest.importorskip("transformers")
    import rlvr.cli
    from hf_models import make_model_dir

    monkeypatch.setattr(hostmem, "allocator_library", lambda: "/opt/lib/libjemalloc.so.2")
    monkeypatch.setattr(hostmem.platform, "system", lambda: "Linux")
    monkeypatch.delenv(hostmem.PRELOADED, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    calls = []

    def execve(path, argv, env):
        calls.append((argv, env))
        raise SystemExit(0)
    monkeypatch.setattr(rlvr.cli.os, "execve", execve)
    mdir = make_model_dir(tmp_path / "m")
    argv = ["train", str(EXAMPLE), "--out", str(tmp_path / "run"), f"--model.path={mdir}", "--train.steps=1"]
    for run_argv in (argv, [*argv, "--model.gradient_checkpointing=true"]):     # checkpointing or not
        monkeypatch.setattr(sys, "argv", ["rlvr", *run_argv])
        with pytest.raises(SystemExit):
            main()
        args, env = calls.pop()
        assert args == [sys.executable, "-m", "rlvr", *run_argv] and env["LD_PRELOAD"] == "/opt/lib/libjemalloc.so.2"
        assert not (tmp_path / "run").exists()                           # nothing built or written before
    def train(*a, **k):                                                  # past the preload: the trainer was called
        raise RuntimeError("built")
    monkeypatch.setattr(trainer, "train", train)
    monkeypatch.setattr(sys, "argv", ["rlvr", *argv, "--model.path="])           # the tiny model
    with pytest.raises(RuntimeError, match="built"):
        main()
    with pytest.raises(RuntimeError, match="built"):
        main(argv)                                                       # called from Python: no exec
    assert calls == []


@pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD is the Linux loader's")
def test_the_command_with_a_hugging_face_model_runs_under_jemalloc_by_default(tmp_path):
    """The real command in a fresh process, train.host_memory left at auto: a Hugging Face model trains
    under jemalloc where this machine has one (the test extra installs Ray, whose wheel ships it), and
    the built-in tiny model under glibc's kept heap."""
    pytest.importorskip("transformers")
    from hf_models import make_model_dir

    env = {k: v for k, v in os.environ.items() if k not in (hostmem.PRELOADED, "LD_PRELOAD")}
    common = ["--train.steps=1", "--train.prompts_per_step=2", "--train.samples_per_prompt=2", "--eval.every=0",
              "--eval.at_start=false", "--eval.prompts=4", "--eval.pass_k=0", "--task.options={n = 3, heldout = 10}"]
    hf = subprocess.run([sys.executable, "-m", "rlvr", "train", str(EXAMPLE), "--out", str(tmp_path / "hf"),
                         f"--model.path={make_model_dir(tmp_path / 'm')}", *common],
                        capture_output=True, text=True, env=env)
    assert hf.returncode == 0, hf.stderr
    if hostmem.allocator_library() is not None:
        assert "host memory: jemalloc (preloaded: " in hf.stdout and "train.host_memory = auto" in hf.stdout
    else:
        assert "host memory: jemalloc" not in hf.stdout
    tiny = subprocess.run([sys.executable, "-m", "rlvr", "train", str(EXAMPLE), "--out", str(tmp_path / "tiny"),
                           "--model.init=", "--model.n_embd=16", "--model.n_layer=1", "--model.n_head=2", *common],
                          capture_output=True, text=True, env=env)
    assert tiny.returncode == 0, tiny.stderr
    assert "host memory: jemalloc" not in tiny.stdout
    if GLIBC:
        assert "host memory: kept (glibc: no mmap, no trim)" in tiny.stdout
