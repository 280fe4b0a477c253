"""What a reward worker is kept from, and what listens on the network (issue 49, docs/security.md).

The reward pool is a fault boundary: a reward sees only allow-listed environment variables, cannot
raise its own limits, and the processes it starts die with its worker. A local Ray and a learner
group listen on the loopback interface only.
"""

import json
import os
import resource
import socket
import textwrap
import time
from pathlib import Path

import pytest

from rlvr.reward_pool import WORKER_ENV_NAMES, Limits, RewardPool, env_allowed, worker_env

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
    group = learners_mod.LearnerGroup(cfg, new_learner(build_mod.build(cfg)))
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
