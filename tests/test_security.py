"""Safe with other people's files: a run directory is data, --overwrite deletes only what rlvr wrote,
a reward worker is contained, and nothing listens beyond the loopback interface.

Each crafted run directory carries a marker that its code would write if it ran: under eval, probe,
audit and report the marker must stay unwritten. Each refused --overwrite must leave its directory
byte-identical. A control beside each shows that the crafted code does run when the user says so
(or under the old command line), so a test cannot pass by the code simply not being reached.

The reward pool is a fault boundary: a reward sees only allow-listed environment variables, cannot
raise its own limits, and the processes it starts die with its worker. A local Ray and a learner
group listen on the loopback interface only (docs/security.md).
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from rlvr import config as config_mod
from rlvr.cli import main
from rlvr.isolation import python_argv
from rlvr.reward_pool import WORKER_ENV_NAMES, Limits, RewardPool, env_allowed, worker_env
from rlvr.tasks import TaskError, load_task, untrusted_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "sort.toml")
TINY = ["--model.n_embd=32", "--model.n_layer=1", "--model.n_head=2", "--train.steps=1",
        "--train.prompts_per_step=4", "--train.samples_per_prompt=4", "--eval.every=0", "--eval.prompts=5",
        "--eval.pass_k=0", "--task.options={n = 3, heldout = 50}", "--train.threads=1", "--task.reward_workers=0"]


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def tree(d: Path) -> dict:
    """Every entry under `d` (not followed through links): its bytes, 'dir', or the link's target."""
    out = {}
    for root, dirs, files in os.walk(d):
        for name in dirs + files:
            p = Path(root) / name
            rel = str(p.relative_to(d))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 1-step run of the sort task (built-in tiny model)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    rc, _, err = cli("train", EXAMPLE, *TINY, "--out", run)
    assert rc == 0, err
    return run


def set_task(config: Path, path: str, options: str) -> None:
    """Rewrite the [task] path and options of a config.toml that rlvr wrote."""
    text = config.read_text()
    text = re.sub(r'(\[task\]\n)path = "[^"]*"', lambda m: f"{m.group(1)}path = {json.dumps(path)}", text)
    text = re.sub(r"\noptions = \{[^\n]*\}", lambda m: f"\noptions = {options}", text, count=1)
    config.write_text(text)


def crafted(trained: Path, tmp_path: Path, path: str, options: str) -> Path:
    """A copy of the trained run whose config.toml names `path` with `options`."""
    run = tmp_path / "crafted"
    shutil.copytree(trained, run)
    set_task(run / "config.toml", path, options)
    return run


def only_config(run: Path, tmp_path: Path) -> Path:
    """A crafted directory holding the config alone (no price.json, metrics.jsonl or best.json beside it)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run / "config.toml", bare / "config.toml")
    return bare / "config.toml"


def commands(run: Path, config: Path) -> list[list]:
    return [["eval", run, "--prompts=4"], ["probe", run / "config.toml", "--prompts=2", "--samples=2"],
            ["audit", run / "config.toml", "--prompts=4"], ["probe", config, "--prompts=2", "--samples=2"],
            ["audit", config, "--prompts=4"]]


# --------------------------------------------------------------------------- code named by a run's config


def test_a_builtin_named_as_the_task_never_runs(trained, tmp_path):
    mark = tmp_path / "MARK"
    run = crafted(trained, tmp_path, "os:system", f'{{ command = "touch {mark}" }}')
    for argv in commands(run, only_config(run, tmp_path)):
        rc, _, err = cli(*argv)
        assert rc == 2, (argv, err)
        assert "task.path 'os:system'" in err and "config.toml" in err and "a run directory is data" in err, err
        assert "Traceback" not in err and not mark.exists(), argv
    # not a task factory defined in the module it names: refused even when the config is trusted
    rc, _, err = cli("eval", run, "--trust-run-config", "--prompts=4")
    assert rc == 2 and "system is a built-in, not a Task or a function defined in os" in err, err
    assert not mark.exists()
    rc, _, err = cli("train", EXAMPLE, *TINY, "--task.path=os:system", f'--task.options={{command = "touch {mark}"}}',
                     "--out", tmp_path / "out")
    assert rc == 2 and "system is a built-in" in err and not mark.exists()


def test_an_imported_name_is_not_a_task_factory(tmp_path):
    (tmp_path / "reexport.py").write_text("from rlvr.tasks.sort import sort_task\n")
    with pytest.raises(TaskError, match="sort_task is imported from rlvr.tasks.sort"):
        load_task(f"{tmp_path / 'reexport.py'}:sort_task", n=3)


EVIL_REWARD = """
open({mark!r}, "a").write("imported")

def r(prompt, response, answer):
    return 0.0
"""


def test_a_file_named_in_task_options_is_not_imported(trained, tmp_path):
    mark = tmp_path / "MARK"
    evil = tmp_path / "evil.py"
    evil.write_text(EVIL_REWARD.format(mark=str(mark)))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i:03d}", "answer": f"{i:03d}"}) + "\n" for i in range(40)))
    options = f'{{ train = "{data}", rewards = ["exact_match", "{evil}:r"] }}'
    run = crafted(trained, tmp_path, "rlvr.tasks.dataset:jsonl_task", options)
    for argv in [*commands(run, only_config(run, tmp_path)),
                 ["eval", run, "--task.path=rlvr.tasks.dataset:jsonl_task"]]:  # naming the task trusts it, not its options
        rc, _, err = cli(*argv)
        assert rc == 2, (argv, err)
        assert "task.options.rewards[1]" in err and "evil.py:r" in err and "config.toml" in err, err
        assert not mark.exists(), argv
    rc, _, err = cli("audit", run / "config.toml", "--prompts=4", "--trust-run-config")  # the control: it would run
    assert mark.exists(), err


def test_a_module_named_in_task_options_is_held_to_the_project_tasks(tmp_path, monkeypatch):
    """A mixture's component named by a bare module (no ':' and no '.py', so no string check sees it)
    is refused at import while a run directory's task is built."""
    mark = tmp_path / "MARK"
    (tmp_path / "sneaky_component.py").write_text(f"open({str(mark)!r}, 'a').write('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    comps = [{"path": "sneaky_component", "options": {}}]
    with untrusted_config("RUN/config.toml"), pytest.raises(TaskError, match="RUN/config.toml is data"):
        load_task("rlvr.tasks.mix:mix_task", tasks=comps)
    assert not mark.exists()
    with pytest.raises(TaskError):  # the control: outside the block the module is imported
        load_task("rlvr.tasks.mix:mix_task", tasks=comps)
    assert mark.exists()


def test_workers_do_not_import_from_the_current_directory(trained, tmp_path, monkeypatch):
    """`cd RUN && rlvr eval .`: a struct.py in the run directory would shadow the stdlib module in a
    reward worker started with `python -c` (the current directory first on sys.path)."""
    mark = tmp_path / "MARK"
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "struct.py").write_text(f"open({str(mark)!r}, 'a').write('x')\nfrom _struct import *\n")
    old = subprocess.run([sys.executable, "-c", "import struct"], cwd=run)  # the control: the old command line
    assert old.returncode == 0 and mark.exists()
    mark.unlink()
    assert subprocess.run(python_argv("import struct, json"), cwd=run).returncode == 0
    assert not mark.exists()
    monkeypatch.chdir(run)
    rc, out, err = cli("eval", ".", "--prompts=4", "--task.reward_workers=1")
    assert rc == 0, err
    assert json.loads(out)["eval/prompts"] == 4 and not mark.exists()


# --------------------------------------------------------------------------- rlvr report and links


def report_run(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "config.toml").write_text('[task]\npath = "rlvr.tasks.sort:sort_task"\n')
    rows = [{"step": s, "train/reward": 0.1 * s, "train/goal": 0.1, "train/sampled_tokens": 10 * s} for s in (1, 2)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_report_refuses_a_linked_report_directory(tmp_path):
    pytest.importorskip("matplotlib")
    run = report_run(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "report").symlink_to(elsewhere)
    rc, _, err = cli("report", run)
    assert rc == 2 and f"{run / 'report'} is a symbolic link" in err and "Traceback" not in err, err
    assert list(elsewhere.iterdir()) == []


def test_report_never_writes_through_a_planted_temporary_name(tmp_path):
    pytest.importorskip("matplotlib")
    run = report_run(tmp_path / "run")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (run / "report").mkdir()
    (run / "report" / ".report.html.tmp").symlink_to(victim)
    rc, _, err = cli("report", run)
    assert rc == 0, err
    assert victim.read_text() == "keep me"
    assert (run / "report" / "report.html").is_file() and not (run / "report" / "report.html").is_symlink()
    assert "<html" in (run / "report" / "report.html").read_text()


def test_report_never_reads_a_linked_file_of_the_run(tmp_path):
    pytest.importorskip("matplotlib")
    run = report_run(tmp_path / "run")
    secret = tmp_path / "secret.toml"
    secret.write_text('token = "SECRET-4f1c"\n')
    (run / "config.toml").unlink()
    (run / "config.toml").symlink_to(secret)
    (run / "price.json").symlink_to(tmp_path / "secret.toml")
    rc, _, err = cli("report", run)
    assert rc == 0, err
    page = (run / "report" / "report.html").read_text()
    assert "SECRET-4f1c" not in page
    assert f"{run / 'config.toml'} is a symbolic link" in err and "skipped" in err
    (run / "metrics.jsonl").rename(tmp_path / "metrics.jsonl")
    (run / "metrics.jsonl").symlink_to(tmp_path / "metrics.jsonl")
    rc, _, err = cli("report", run)
    assert rc == 2 and f"{run / 'metrics.jsonl'} is a symbolic link" in err, err


def test_loading_a_run_never_reads_through_a_link_out_of_it(trained, tmp_path):
    """A copy of a finished run whose config.toml links to a file outside it (someone else's run
    directory pointing at a private file): eval and probe refuse before reading it, naming the link;
    --trust-run-config (the user's own directory) follows it; a link inside the directory is fine."""
    run = tmp_path / "linked"
    shutil.copytree(trained, run)
    outside = tmp_path / "elsewhere.toml"
    (run / "config.toml").rename(outside)
    (run / "config.toml").symlink_to(outside)
    reads = []
    real_load = config_mod.load
    config_mod.load = lambda path, *a, **kw: reads.append(Path(path)) or real_load(path, *a, **kw)
    try:
        for argv in (["eval", run, "--prompts=4"], ["probe", EXAMPLE, *TINY[:3], "--prompts=2", "--samples=2",
                                                     "--checkpoint", run]):
            reads.clear()
            rc, _, err = cli(*argv)
            assert rc == 2, (argv, err)
            assert f"{run / 'config.toml'} is a symbolic link to {outside}, outside the run directory" in err, err
            assert all(p.resolve() != outside for p in reads), reads               # refused before reading it
        rc, out, err = cli("eval", run, "--prompts=4", "--trust-run-config")
        assert rc == 0, err
    finally:
        config_mod.load = real_load
    inside = tmp_path / "inside"
    shutil.copytree(trained, inside)
    (inside / "config.toml").rename(inside / "kept.toml")
    (inside / "config.toml").symlink_to(inside / "kept.toml")
    rc, _, err = cli("eval", inside, "--prompts=4")
    assert rc == 0, err


# --------------------------------------------------------------------------- --overwrite


def a_run_look(d: Path) -> None:
    """Files that make `d` look like a run directory (config.toml beside metrics.jsonl) and one that is not rlvr's."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.toml").write_text("[train]\nsteps = 1\n")
    (d / "metrics.jsonl").write_text('{"step": 1}\n')
    (d / "thesis.tex").write_text("years of work")


def overwrite(out, tmp_path) -> tuple[int, str]:
    """`rlvr train ... --out OUT --overwrite`: (exit code, stdout and stderr)."""
    rc, out, err = cli("train", EXAMPLE, *TINY, "--out", out, "--overwrite")
    return rc, out + err


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    mine = tmp_path / "mine"
    (mine / ".ssh").mkdir(parents=True)
    (mine / ".ssh" / "id_ed25519").write_text("key")
    (mine / "thesis.tex").write_text("years of work")
    before = tree(mine)
    rc, err = overwrite(mine, tmp_path)
    assert rc == 2 and "is not a run directory" in err and "nothing was deleted" in err, err
    assert tree(mine) == before


@pytest.mark.parametrize("where", ["cwd", "parent", "home"])
def test_overwrite_refuses_the_current_parent_and_home_directories(tmp_path, monkeypatch, where):
    target = tmp_path / "target"
    a_run_look(target)               # even a directory that looks like a run
    (target / "sub").mkdir()
    monkeypatch.setenv("HOME", str(target if where == "home" else tmp_path / "nohome"))
    if where == "cwd":
        monkeypatch.chdir(target)
        out = "."
    elif where == "parent":
        monkeypatch.chdir(target / "sub")
        out = ".."
    else:
        out = str(target)
    before = tree(target)
    rc, err = overwrite(out, tmp_path)
    words = {"cwd": "is the current directory", "parent": "is the current directory or one above it",
             "home": "is the home directory"}[where]
    assert rc == 2 and words in err and "Traceback" not in err, err
    assert tree(target) == before


def test_overwrite_refuses_a_symbolic_out(tmp_path):
    real = tmp_path / "real"
    a_run_look(real)
    link = tmp_path / "link"
    link.symlink_to(real)
    before = tree(real)
    rc, err = overwrite(link, tmp_path)
    assert rc == 2 and f"--out {link} is a symbolic link" in err and "Traceback" not in err, err
    assert tree(real) == before and link.is_symlink()


def test_overwrite_replaces_a_run_and_keeps_what_rlvr_did_not_write(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "notes.txt").write_text("mine")
    (run / "metrics.jsonl").write_text('{"step": 99, "train/reward": 5}\n')
    rc, err = overwrite(run, tmp_path)
    assert rc == 0, err
    assert (run / "notes.txt").read_text() == "mine"
    assert "--overwrite: kept 1 name(s) rlvr did not write" in err and "notes.txt" in err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r.get("step") != 99 for r in rows)
    assert (run / "checkpoint" / "model.safetensors").is_file()


# --------------------------------------------------------------------------- what a reward worker is kept from

TASK = textwrap.dedent('''
    import json, os, resource, subprocess, sys, time
    from rlvr.rewards import Reward, RewardCard
    from rlvr.tasks import Example, Task

    CARD = RewardCard(pays_for="a probe of the worker", ignores="everything else", exploit="none")
    SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]

    def orphan(out):
        """A grandchild in its own session whose parent exits: it is nobody's child but the reaper's."""
        code = ("import subprocess, sys; p = subprocess.Popen(%r, start_new_session=True); "
                "open(%r, 'w').write(str(p.pid))" % (SLEEPER, out))
        subprocess.run([sys.executable, "-c", code], check=True)
        return int(open(out).read())

    def probe(prompt, response, answer):
        out = answer
        if response == "env":
            with open(os.path.join(out, "env.json"), "w") as f:
                json.dump(sorted(os.environ), f)
            return 1.0
        if response == "raise":                   # a reward that lifts its own memory limit, then allocates
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            return float(len(bytearray(300 * 2**20)))
        if response == "big file":
            with open(os.path.join(out, "big"), "wb") as f:
                f.write(bytes(3 * 2**20))
            return 1.0
        if response == "limits":
            with open(os.path.join(out, "limits.json"), "w") as f:
                json.dump({k: resource.getrlimit(getattr(resource, k)) for k in
                           ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_CPU")}, f)
            return 1.0
        if response in ("orphan", "orphan then hang", "orphan then die"):
            pid = orphan(os.path.join(out, response + ".pid"))
            child = subprocess.Popen(SLEEPER, start_new_session=True)    # and a direct child, in a new session
            with open(os.path.join(out, response + ".child"), "w") as f:
                f.write(str(child.pid))
            if response == "orphan then hang":
                time.sleep(1e6)
            if response == "orphan then die":
                os._exit(3)
            return float(pid)
        if response == "spin":
            t = time.process_time()
            while time.process_time() - t < 1.2:
                pass
            return 1.0
        return 0.0

    def make(out="."):
        return Task(name="probe", train=[Example("p", out)], heldout=[Example("h", out)],
                    goal=lambda p, r, a: True, max_new_tokens=4,
                    rewards={"probe": Reward("probe", probe, CARD)})
''')


@pytest.fixture(scope="module")
def task_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("task") / "probe.py"
    path.write_text(TASK)
    return f"{path}:make"


def probe(pool: RewardPool, response: str, out: Path):
    return pool.scores(["probe"], ["p"], [response], [str(out)])["probe"][0]


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed orphan may wait for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone_soon(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------------------------------
# the environment


def test_worker_env_keeps_only_the_allow_list_and_the_names_asked_for():
    parent = {"PATH": "/bin", "HOME": "/h", "LC_ALL": "C", "HF_TOKEN": "secret", "AWS_SECRET_ACCESS_KEY": "s",
              "MYTASK_DATA": "/d", "OMP_NUM_THREADS": "8"}
    env = worker_env(parent)
    assert {"PATH", "HOME", "LC_ALL"} <= set(env)
    assert not {"HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "MYTASK_DATA"} & set(env)
    assert env["OMP_NUM_THREADS"] == "1"                                    # one thread per worker
    assert worker_env(parent, ["MYTASK_*"])["MYTASK_DATA"] == "/d"
    assert env_allowed("LC_CTYPE", ["LC_*"]) and not env_allowed("LCX", ["LC_*"]) and not env_allowed("PATHX", ["PATH"])


def test_a_reward_sees_only_the_allow_listed_environment(task_path, tmp_path, monkeypatch):
    monkeypatch.setenv("RLVR_TEST_SECRET_TOKEN", "hunter2")
    monkeypatch.setenv("RLVR_TEST_WANTED", "yes")
    with RewardPool(task_path, {}, workers=1, env=["RLVR_TEST_WANTED"]) as pool:
        assert probe(pool, "env", tmp_path).status == "ok"
    names = set(json.loads((tmp_path / "env.json").read_text()))
    assert "RLVR_TEST_SECRET_TOKEN" not in names
    assert "RLVR_TEST_WANTED" in names
    own = {"PYTHONPATH", "RLVR_POOL_PARENT", "RLVR_REWARD_WORKER", "RLVR_TEST_WANTED"}
    assert all(env_allowed(n, WORKER_ENV_NAMES) or n in own for n in names), sorted(names)


# ---------------------------------------------------------------------------------------------
# the limits


def test_every_limit_is_set_with_hard_equal_to_soft(task_path, tmp_path):
    with RewardPool(task_path, {}, workers=1, limits=Limits(memory_mb=256, processes=100, file_mb=2, cpu_s=50)) as pool:
        assert probe(pool, "limits", tmp_path).status == "ok"
    got = json.loads((tmp_path / "limits.json").read_text())
    for name, (soft, hard) in got.items():
        assert soft == hard != resource.RLIM_INFINITY, name
    assert got["RLIMIT_FSIZE"][0] == 2 * 2**20
    assert 50 < got["RLIMIT_CPU"][0] < 50 + 60                    # beyond the CPU that loading the task took
    assert got["RLIMIT_NPROC"][0] >= 100


def test_a_reward_cannot_raise_its_own_memory_limit(task_path, tmp_path):
    """Hard = soft and no CAP_SYS_RESOURCE (even as root): lifting RLIMIT_AS fails, so the 300 MB
    allocation after it never happens."""
    with RewardPool(task_path, {}, workers=1, memory_mb=64) as pool:
        s = probe(pool, "raise", tmp_path)
    assert s.status == "error" and "ValueError" in s.detail and "raise" in s.detail, s


def test_a_file_past_the_file_size_limit_is_an_error_not_a_crash(task_path, tmp_path):
    with RewardPool(task_path, {}, workers=1, limits=Limits(file_mb=1)) as pool:
        s = probe(pool, "big file", tmp_path)
        assert s.status == "error" and "File too large" in s.detail, s
        assert pool.restarts == 0                                    # the worker lives on (SIGXFSZ ignored)
    assert (tmp_path / "big").stat().st_size <= 2**20


def test_a_worker_past_half_its_cpu_limit_is_replaced_between_calls(task_path, tmp_path):
    with RewardPool(task_path, {}, workers=1, limits=Limits(cpu_s=2)) as pool:
        first = pool.pids
        assert probe(pool, "spin", tmp_path).status == "ok"            # 1.2 s of CPU: past half of 2
        assert pool.recycled == 1 and pool.restarts == 0 and pool.pids != first
        assert probe(pool, "nothing", tmp_path).status == "ok"


# ---------------------------------------------------------------------------------------------
# the processes a reward starts


def _pids(out: Path, name: str) -> list[int]:
    return [int((out / f"{name}.{k}").read_text()) for k in ("pid", "child")]


def test_a_rewards_orphans_are_gone_after_the_pool_closes(task_path, tmp_path):
    """A grandchild that called setsid and lost its parent, and a child in its own session: both
    outlived the trainer before; both die when the pool closes."""
    with RewardPool(task_path, {}, workers=1) as pool:
        assert probe(pool, "orphan", tmp_path).status == "ok"
        pids = _pids(tmp_path, "orphan")
        assert all(alive(p) for p in pids)
        assert all(os.getsid(p) != os.getsid(pool.pids[0]) for p in pids)   # each left the worker's session
    assert all(gone_soon(p) for p in pids)


@pytest.mark.parametrize("how", ["hang", "die"])
def test_a_rewards_orphans_die_with_a_worker_that_is_replaced(task_path, tmp_path, how):
    """A worker killed at its timeout, or one that died on its own (its orphans then found by the mark in
    their environment), leaves nothing running."""
    with RewardPool(task_path, {}, workers=1, timeout_s=3.0) as pool:
        s = probe(pool, f"orphan then {how}", tmp_path)
        assert s.status == ("timeout" if how == "hang" else "crashed") and pool.restarts == 1
        pids = _pids(tmp_path, f"orphan then {how}")
        assert all(gone_soon(p) for p in pids)
        assert probe(pool, "nothing", tmp_path).status == "ok"


# ---------------------------------------------------------------------------------------------
# what listens on the network


def _listening() -> dict[int, tuple[str, int]]:
    """{socket inode: (address, port)} of every listening TCP socket in this network namespace."""
    out = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":                                           # TCP_LISTEN
                continue
            host, port = f[1].split(":")
            raw = bytes.fromhex(host)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))   # each 32-bit word is host order
            out[int(f[9])] = (socket.inet_ntop(family, raw), int(port, 16))
    return out


def _tree(pid: int) -> set[int]:
    from rlvr.process_tree import _parents, descendants

    return {pid} | descendants(pid, _parents())


def listening_addresses(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of the listening TCP sockets the processes `pids` hold."""
    table, found = _listening(), set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in table:
                found.add(table[int(link[8:-1])])
    return found


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1") or address.startswith("::ffff:127.")


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")
def test_a_local_ray_listens_on_loopback_only(ray_local):
    from rlvr.distributed.sync import start_ray

    assert start_ray("", 1) is False                                   # joins the session's Ray
    addresses = listening_addresses(_tree(os.getpid()))
    assert addresses, "found no listening socket of Ray's"
    assert all(is_loopback(a) for a, _ in addresses), sorted(addresses)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")
def test_a_learner_group_listens_on_loopback_only(ray_local):
    from test_distributed import new_learner, tiny_cfg

    import rlvr.distributed.learners as learners_mod
    from rlvr import build as build_mod

    cfg = tiny_cfg("--distributed.learners=2")
    before = listening_addresses(_tree(os.getpid()))
    group = learners_mod.LearnerGroup(cfg, new_learner(build_mod.build(cfg)), build_mod.build)
    try:
        new = listening_addresses(_tree(os.getpid())) - before
    finally:
        group.close()
    assert new, "found no listening socket of the group's"               # the store and gloo's pairs at least
    assert all(is_loopback(a) for a, _ in new), sorted(new)
    assert not listening_addresses({os.getpid()}) & new                  # the store's socket closed with the group


def test_the_rendezvous_port_is_held_until_the_store_takes_it():
    """The port is chosen by a socket that stays bound and listening (no bind-close-reuse race) on the
    loopback address when no cluster is in use."""
    from rlvr.distributed.learners import open_rendezvous

    listener, url = open_rendezvous()
    try:
        host, port = url.removeprefix("tcp://").rsplit(":", 1)
        assert is_loopback(host) and listener.getsockname() == (host, int(port))
        with socket.socket() as other, pytest.raises(OSError):
            other.bind((host, int(port)))
    finally:
        listener.close()
