"""Rewards in supervised worker processes: every way a reward can fail gets a status, the pool goes on.

A reward that hangs, exits, segfaults or eats memory must not hang or end the run: its call gets a
named status (timeout, crashed, exit, error), its worker is replaced, and every other call is scored
as in-process scoring would score it.
"""

import json
import os
import select as select_module
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlvr.reward_pool import RewardPool, RewardPoolError, available_cores, open_pool
from rlvr.rewards import STATUSES, Reward, goal_hits, score_batch, steps_of
from rlvr.tasks import load_task, weighted_rewards

TASK = textwrap.dedent('''
    import ctypes, os, sys, time
    from rlvr.rewards import Reward, RewardCard
    from rlvr.tasks import Example, Task

    CARD = RewardCard(pays_for="the response's length", ignores="everything else", exploit="long text")

    def behave(prompt, response, answer):
        """Misbehaves on command; otherwise the response's length."""
        if response == "sleep":
            time.sleep(1e6)
        if response == "_exit":
            os._exit(3)
        if response == "exit":
            sys.exit(0)
        if response == "interrupt":
            raise KeyboardInterrupt
        if response == "memory":
            bytearray(2 * 2**30)          # 2 GB, past the 256 MB limit the tests set
        if response == "segfault":
            ctypes.string_at(0)
        if response.startswith("slow"):
            time.sleep(0.05)
        if response == "pid":
            return float(os.getpid())
        return float(len(response))

    def batched(prompts, responses, answers):
        return [100.0 + behave(p, r, a) for p, r, a in zip(prompts, responses, answers)]

    def goal(prompt, response, answer):
        behave(prompt, response, answer)
        return response == answer

    def tool(prompt, response, answer):
        """Misbehaves as the rewards do; otherwise the response in brackets, or None on "none"."""
        behave(prompt, response, answer)
        return None if response == "none" else "[" + response + "]"

    def make(n=3):
        return Task(name="misbehaving", train=[Example("p%d" % i, "a") for i in range(n)],
                    heldout=[Example("h", "a")], goal=goal, max_new_tokens=4, tool=tool,
                    rewards={"behave": Reward("behave", behave, CARD),
                             "batched": Reward("batched", behave, CARD, batch_fn=batched)})
''')

LIMITS = dict(timeout_s=1.0, memory_mb=256)


@pytest.fixture(scope="module")
def task_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("task") / "misbehaving.py"
    path.write_text(TASK)
    return f"{path}:make"


@pytest.fixture(scope="module")
def pool(task_path):
    with RewardPool(task_path, workers=2, **LIMITS) as p:
        yield p


def scores_of(pool, responses, name="behave"):
    return pool.scores([name], ["p"] * len(responses), responses, ["a"] * len(responses))[name]


@pytest.mark.parametrize("response, status, detail", [
    ("sleep", "timeout", "took longer than 1 s (task.reward_timeout_s)"),
    ("_exit", "crashed", "the reward worker died (exit code 3)"),
    ("segfault", "crashed", "the reward worker died (signal SIGSEGV)"),
    ("exit", "exit", "SystemExit: 0"),
    ("interrupt", "exit", "KeyboardInterrupt"),
    ("memory", "error", "MemoryError: over the worker's memory limit (256 MB"),
])
def test_each_failure_has_its_status_and_the_pool_goes_on(pool, response, status, detail):
    before = pool.restarts
    s = scores_of(pool, ["ab", response, "abcd"])
    assert [x.status for x in s] == ["ok", status, "ok"]
    assert detail in s[1].detail and s[1].value == 0.0
    assert (s[0].value, s[2].value) == (2.0, 4.0)          # the rest of the chunk was scored
    assert pool.restarts == before + (status in ("timeout", "crashed"))
    assert [x.value for x in scores_of(pool, ["abc"] * 4)] == [3.0] * 4   # and the next call works


def test_tool_calls_run_in_the_workers_with_the_same_statuses(pool):
    before = pool.restarts
    responses = ["ab", "none", "sleep", "exit", "_exit", "x"]
    got = pool.tool_calls(["p"] * 6, responses, ["a"] * 6)
    assert [s.status for s in got] == ["ok", "ok", "timeout", "exit", "crashed", "ok"]
    assert (got[0].value, got[1].value, got[5].value) == ("[ab]", None, "[x]")
    assert pool.restarts == before + 2
    from rlvr.rewards import call_tool
    task = load_task(pool.task_path)
    assert [call_tool(task.tool, "p", r, "a") for r in ("ab", "none")] == got[:2]   # as in the trainer's process


def test_many_failures_in_one_batch_leave_every_other_score_right(pool):
    responses = [("_exit" if i % 5 == 2 else "exit" if i % 7 == 3 else "x" * (i % 4)) for i in range(30)]
    s = scores_of(pool, responses)
    for r, x in zip(responses, s):
        expected = {"_exit": "crashed", "exit": "exit"}.get(r, "ok")
        assert x.status == expected and (expected != "ok" or x.value == len(r))


def test_score_batch_and_goal_hits_through_a_pool_count_each_status(pool, task_path):
    task = load_task(task_path)
    responses = ["a", "sleep", "_exit", "exit", "bb"]
    args = (["p"] * 5, responses, ["a"] * 5)
    b = score_batch(weighted_rewards(task, {"behave": 2.0}), *args, pool=pool)
    assert b.total == [2.0, 0.0, 0.0, 0.0, 4.0]
    assert b.status_counts == {s: {"ok": 2, "timeout": 1, "crashed": 1, "exit": 1}.get(s, 0) for s in STATUSES}
    hits, failures, errors = goal_hits(task.goal, *args, pool=pool)
    assert hits == [True, False, False, False, False] and failures == 3
    assert errors[0].startswith("goal: timeout: took longer than 1 s")


def test_the_same_scores_as_in_process():
    task = load_task("rlvr.tasks.sort:sort_task", n=4)
    weights = {name: 1.0 for name in task.rewards}
    prompts = [ex.prompt for ex in task.train[:20]]
    answers = [ex.answer for ex in task.train[:20]]
    responses = [str(ex.answer)[::-1] if i % 2 else str(ex.answer) for i, ex in enumerate(task.train[:20])]
    here = score_batch(weighted_rewards(task, weights), prompts, responses, answers)
    with RewardPool("rlvr.tasks.sort:sort_task", {"n": 4}, workers=2) as p:
        there = score_batch(weighted_rewards(task, weights), prompts, responses, answers, pool=p)
        assert goal_hits(task.goal, prompts, responses, answers, pool=p) == goal_hits(task.goal, prompts, responses,
                                                                                      answers)
    assert there == here
    # a process reward's per-step scores come back from the worker with their mean
    steps = [steps_of(v) for v in there.per_reward["position_per_token"]]
    assert steps == [steps_of(v) for v in here.per_reward["position_per_token"]] and all(steps)


def test_a_batched_reward_runs_batched_in_the_worker(pool):
    assert [x.value for x in scores_of(pool, ["a", "bcd"], "batched")] == [101.0, 103.0]
    s = scores_of(pool, ["a", "_exit", "bc"] + ["x"] * 21, "batched")   # 8 chunks of 3 on 2 workers
    assert [x.status for x in s] == ["crashed"] * 3 + ["ok"] * 21         # the whole batched call died
    assert [x.value for x in s[3:]] == [101.0] * 21


def test_calls_run_in_parallel_on_every_worker(pool):
    pids = {x.value for x in scores_of(pool, ["slow", "pid"] * 8)[1::2]}
    assert len(pids) == 2 and set(pool.pids) >= pids


def test_two_workers_score_a_50ms_reward_in_at_most_0_6_of_the_in_process_time(pool, task_path):
    """64 calls of 50 ms: at least 3.2 s in the trainer's process (one after the other)."""
    task = load_task(task_path)
    responses = ["slow"] * 64
    t = time.perf_counter()
    s = scores_of(pool, responses)
    pooled = time.perf_counter() - t
    assert all(x.status == "ok" for x in s)
    t = time.perf_counter()
    score_batch(weighted_rewards(task, {"behave": 1.0}), ["p"] * 16, responses[:16], ["a"] * 16)
    in_process = (time.perf_counter() - t) * 64 / 16
    assert in_process >= 64 * 0.05
    assert pooled <= 0.6 * in_process, (pooled, in_process)


def test_unknown_reward_name_and_closed_pool(task_path):
    p = RewardPool(task_path, workers=1)
    with pytest.raises(ValueError, match="'nope' is not one of the pool's task"):
        p.scores(["nope"], ["p"], ["r"], ["a"])
    pids = p.pids
    p.close()
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)          # reaped: no worker left behind
    with pytest.raises(RewardPoolError, match="closed"):
        p.scores(["behave"], ["p"], ["r"], ["a"])


def test_a_task_a_worker_cannot_load_is_an_error_up_front(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nif os.environ.get('RLVR_POOL_PARENT'):\n    raise ImportError('not here')\n"
                   "from rlvr.tasks.sort import sort_task as make\n")
    with pytest.raises(RewardPoolError, match="cannot load the task .*bad.py.*ImportError: not here"):
        RewardPool(f"{bad}:make", workers=1)


def test_answers_that_cannot_be_sent_are_refused_up_front(task_path):
    class Config:
        path, options, reward_workers, reward_timeout_s, reward_memory_mb = task_path, {}, 1, 5.0, 0

    task = load_task(task_path)
    task.train[0].answer = lambda: None
    with pytest.raises(RewardPoolError, match="answers cannot be sent.*task.reward_workers = 0"):
        with open_pool(Config, task):
            pass
    Config.reward_workers = 0
    with open_pool(Config, task) as none:
        assert none is None


def test_workers_die_with_a_killed_parent(task_path):
    code = (f"from rlvr.reward_pool import RewardPool\np = RewardPool({task_path!r}, workers=2)\n"
            "print(*p.pids, flush=True)\nimport time; time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    pids = [int(x) for x in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_default_workers_are_the_available_cores():
    assert available_cores() == len(os.sched_getaffinity(0))


def test_reward_object_is_not_sent(pool):
    """The worker uses its own task's reward of that name; the function given here never crosses."""
    b = score_batch({"behave": (Reward("behave", lambda p, r, a: -1.0, None), 1.0)}, ["p"], ["abc"], ["a"], pool=pool)
    assert b.total == [3.0]


def test_evaluation_through_a_pool_gives_the_same_figures():
    import torch

    from rlvr.evaluate import evaluate
    from rlvr.models.tiny import TinyConfig, TinyTransformer
    from rlvr.setup_types import Limits
    from rlvr.tokenizer import CharTokenizer

    task = load_task("rlvr.tasks.sort:sort_task", n=3, heldout=20)
    tok = CharTokenizer(task.alphabet)
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=16))
    kw = dict(reward_weights={"position": 1.0}, limits=Limits(task.max_new_tokens, None, 4), pass_k=2,
              pass_k_prompts=10)
    with RewardPool("rlvr.tasks.sort:sort_task", {"n": 3, "heldout": 20}, workers=2) as p:
        assert evaluate(model, tok, task, pool=p, **kw) == evaluate(model, tok, task, **kw)


def test_a_reward_that_calls_sys_exit_does_not_end_an_audit(tmp_path, capsys):
    from rlvr.cli import main

    leaves = tmp_path / "leaves.py"
    leaves.write_text(textwrap.dedent('''
        import sys
        from rlvr.rewards import Reward, RewardCard
        from rlvr.tasks.sort import sort_task

        def leave(prompt, response, answer):
            sys.exit(0)

        def make():
            task = sort_task(n=3, heldout=5)
            card = RewardCard(pays_for="nothing", ignores="everything", exploit="none: it exits")
            task.rewards["leave"] = Reward("leave", leave, card)
            return task
    '''))
    example = str(Path(__file__).resolve().parents[1] / "examples" / "sort.toml")
    code = main(["audit", example, f"--task.path={leaves}:make", "--task.options={}", "--task.reward=leave",
                 "--task.reward_workers=1", "--prompts=5", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["solved_reward"] == 0.0 and result["rows"]   # scored 0 (status exit), not ended


def test_an_interrupted_call_leaves_the_pool_usable(task_path, monkeypatch):
    with RewardPool(task_path, workers=1, **LIMITS) as p:
        real_select = select_module.select
        calls = []

        def interrupted(*a):
            calls.append(1)
            if len(calls) == 2:             # after the chunk was sent: the user's Ctrl-C
                raise KeyboardInterrupt
            return real_select(*a)

        monkeypatch.setattr(select_module, "select", interrupted)
        with pytest.raises(KeyboardInterrupt):
            scores_of(p, ["slow"] * 3)
        monkeypatch.setattr(select_module, "select", real_select)
        assert [x.value for x in scores_of(p, ["ab", "abc"])] == [2.0, 3.0]
