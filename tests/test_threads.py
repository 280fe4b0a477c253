"""Threads, the oversubscription warning and the wall-time estimate of the price.

`train.threads = 0` means the cores this process may use (its affinity mask); a run warns once,
before step 1, when the cores other processes keep busy (/proc/stat, or the 1-minute load average
where there is none) plus its threads exceed those cores. The price
divides its FLOPs by a measured fp32 matmul rate; summary.json sets the real wall time against it.
"""

from __future__ import annotations

import io
import json
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from rlvr import (config as config_mod, costs, learn as learn_mod, machine as machine_mod, probes, report, run_price,
                  sampling, setup_types, trainer)
from rlvr.cli import main

import pricing

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sort.toml"
TINY = ["--model.init=", "--model.n_embd=16", "--model.n_layer=1", "--model.n_head=2", "--train.steps=2",
        "--train.prompts_per_step=2", "--train.samples_per_prompt=2", "--eval.every=0", "--eval.at_start=false",
        "--eval.prompts=4", "--eval.pass_k=0", "--task.options={n = 3, heldout = 10}", "--log.print_every=1"]


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def machine(monkeypatch, cores: int, load: float) -> None:
    """Pretend this process may use `cores` cores on a machine with 1-minute load `load`."""
    monkeypatch.setattr(machine_mod.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(machine_mod.os, "getloadavg", lambda: (load, load, load))


def cfg_with(threads: int) -> config_mod.Config:
    return config_mod.load(EXAMPLE, [f"train.threads={threads}"])


def test_oversubscribed_by_hand():
    # 1.5 busy + 2 threads = 3.5 > 2 cores: warned, with the numbers and the fix
    msg = machine_mod.oversubscribed(2, 1.5, 2)
    assert msg is not None
    assert "load average 1.5" in msg and "2 threads" in msg and "> 2 cores" in msg
    assert "--train.threads=1" in msg and "stop the other job" in msg
    assert machine_mod.oversubscribed(2, 0.0, 2) is None        # 0 + 2 = 2 cores: fits
    assert machine_mod.oversubscribed(1, 0.9, 2) is None        # 0.9 + 1 < 2
    assert machine_mod.oversubscribed(4, 1.5, 4) is not None    # 5.5 > 4 + 1
    assert machine_mod.oversubscribed(2, 0.8, 2) is None        # this process's own start-up shows in the load


def test_threads_default_to_the_usable_cores(monkeypatch):
    machine(monkeypatch, cores=3, load=0.0)
    threads, busy = machine_mod.set_threads(cfg_with(0))
    assert (threads, busy, torch.get_num_threads()) == (3, None, 3)


def test_explicit_threads_win_and_warn_on_a_busy_machine(monkeypatch):
    machine(monkeypatch, cores=2, load=2.5)
    threads, busy = machine_mod.set_threads(cfg_with(1))
    assert (threads, torch.get_num_threads()) == (1, 1)
    assert "1-minute load average 2.5 + this run's 1 threads > 2 cores" in busy
    assert "stop the other job (this run already uses one thread)" in busy and "--train.threads" not in busy
    threads, busy = machine_mod.set_threads(cfg_with(0))     # default: both cores, on a machine already 2.5 busy
    assert threads == 2 and "+ this run's 2 threads > 2 cores" in busy


def test_busy_cores_by_hand():
    # 100 jiffies a second; over 0.5 s the busy fields grew by 150 jiffies (1.5 s of CPU time), of which
    # this process used 0.5 s: other processes kept (1.5 - 0.5) / 0.5 = 2 cores busy; idle and iowait
    # (fields 4 and 5) do not count
    s0 = "cpu  1000 10 200 5000 50 5 5 0 0 0"
    s1 = "cpu  1100 10 240 5900 90 10 10 0 0 0"
    assert machine_mod.busy_cores(s0, s1, own_s=0.5, wall_s=0.5, hz=100) == 2.0
    assert machine_mod.busy_cores(s0, s0, own_s=0.1, wall_s=0.5, hz=100) == 0.0      # never below 0


def test_the_direct_measurement_is_used_when_there_is_one(monkeypatch):
    machine(monkeypatch, cores=2, load=5.0)          # a load average still counting a job that just ended
    monkeypatch.setattr(machine_mod, "_proc_stat_busy", lambda interval=0.25: 0.1)
    assert machine_mod.set_threads(cfg_with(0)) == (2, None)
    monkeypatch.setattr(machine_mod, "_proc_stat_busy", lambda interval=0.25: 1.0)   # a job running now
    threads, busy = machine_mod.set_threads(cfg_with(0))
    assert threads == 2 and "other processes kept 1.0 cores busy over the last 0.25 s + this run's 2 threads" in busy
    # 0.6 other cores + 2 threads > 2 cores + half a core (this process is left out of the measurement)
    assert machine_mod.oversubscribed(2, 0.6, 2, "x", 0.5) is not None and machine_mod.oversubscribed(2, 0.4, 2, "x", 0.5) is None


def test_the_measurement_leaves_this_process_out(monkeypatch, tmp_path):
    """_proc_stat_busy charges this process's own CPU time (time.process_time: every thread of it) to
    no one: /proc/stat's busy fields grow by 150 jiffies (1.5 s at 100 a second) over 0.5 s, 0.5 s of
    it this process's, so others kept (1.5 - 0.5) / 0.5 = 2 cores busy (scripted readings: a live
    reading moves with whatever else the machine runs). And process_time does count another thread's
    spinning, which is what leaves a run's own threads out."""
    import threading

    stat = tmp_path / "stat"
    stat.write_text("cpu  1000 10 200 5000 50 5 5 0 0 0\n")
    monkeypatch.setattr(machine_mod, "PROC_STAT", str(stat))
    clock = {"cpu": 0.0, "wall": 0.0}

    def sleep(s):                       # the interval passes: the machine's counters and this process's move
        stat.write_text("cpu  1100 10 240 5900 90 10 10 0 0 0\n")
        clock["cpu"], clock["wall"] = clock["cpu"] + 0.5, clock["wall"] + s

    monkeypatch.setattr(machine_mod.time, "sleep", sleep)
    monkeypatch.setattr(machine_mod.time, "process_time", lambda: clock["cpu"])
    monkeypatch.setattr(machine_mod.time, "monotonic", lambda: clock["wall"])
    assert machine_mod._proc_stat_busy(0.5) == pytest.approx(2.0)
    monkeypatch.undo()
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    p0 = time.process_time()
    t.start()
    try:
        time.sleep(0.3)
    finally:
        stop.set()
        t.join()
    assert time.process_time() - p0 > 0.05                   # the main thread slept: the spinner's time


def test_no_load_average_no_warning(monkeypatch):
    machine(monkeypatch, cores=2, load=0.0)

    def missing():
        raise OSError("no load average here")
    monkeypatch.setattr(machine_mod.os, "getloadavg", missing)
    assert machine_mod.set_threads(cfg_with(0)) == (2, None)


def test_matmul_rate_is_measured_once(monkeypatch):
    monkeypatch.setattr(machine_mod, "_MATMUL_RATES", {})
    rate = machine_mod.matmul_rate(torch.device("cpu"), seconds=0.05)
    assert rate > 1e6                                                   # any CPU does a MFLOP/s
    assert machine_mod.matmul_rate(torch.device("cpu"), seconds=60.0) == rate   # cached: not measured again


def test_wall_estimate_by_hand():
    base = dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=3, prompt_tokens=4, steps=10,
                epochs_per_batch=2, minibatches=2, n_params=1000, has_reference=False)
    assert pricing.price(**base).wall_seconds_estimate == 0.0 and len(pricing.price(**base).lines()) == 5
    p = pricing.price(**base, matmul_flops_per_s=1e6, threads=2)
    # sampling forward P*Lp + P*G*(T-1) = 16 + 32 = 48 tokens x 2N (the last token drawn is never fed back);
    # trained μ*P*G*(Lp+T-1) = 2*16*6 = 192 x 6N (a row's last token predicts nothing scored)
    assert p.flops_per_run == (48 * 2000 + 192 * 6000) * 10 == 12_480_000
    assert p.wall_seconds_estimate == pytest.approx(12.48)            # 1.248e7 FLOP / 1e6 FLOP/s
    assert p.lines()[-1].startswith("price: wall time >= 12.5 s on this machine (1.25e+07 FLOP at a measured "
                                    "fp32 matmul rate of 0.0 GFLOP/s with 2 threads); a lower bound")
    worst = pricing.price(**base, matmul_flops_per_s=1e6, threads=2, sampling_rounds=3)
    assert "(37.4 s in the worst case of dynamic sampling)" in worst.lines()[-1]


def test_expected_wall_time_by_hand():
    """The decode positions' FLOPs (P*G*(T-1) a batch) leave the rate term; T - 1 measured decode
    steps a batch take their place."""
    base = dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=3, prompt_tokens=4, steps=10,
                epochs_per_batch=2, minibatches=2, n_params=1000, has_reference=False, threads=2)
    assert pricing.price(**base, decode_step_s=0.5).wall_seconds_expected == 0.0       # no rate: nothing expected
    assert pricing.price(**base, matmul_flops_per_s=1e6).wall_seconds_expected == 0.0  # no decode time measured
    p = pricing.price(**base, matmul_flops_per_s=1e6, decode_step_s=0.5)
    # 12,480,000 FLOP in all; decode positions 10 steps x 16 rows x 2 x 2N = 640,000 FLOP leave the rate term
    # (11.84 s); 10 steps x 2 decode steps x 0.5 s = 10 s join it
    assert p.wall_seconds_expected == pytest.approx(11.84 + 10.0)
    assert p.wall_seconds_estimate == pytest.approx(12.48)                            # the lower bound unchanged
    assert p.decode_step_s == 0.5 and p.to_dict()["wall_seconds_expected"] == p.wall_seconds_expected
    assert p.lines()[-1].endswith("; expected ~21.8 s at the 3-token cap, with each of the 2 decode steps per batch at the measured "
                                  "500 ms (16 rows), before evaluation and rewards")
    tools = pricing.price(**base, matmul_flops_per_s=1e6, decode_step_s=0.5, tool_calls=2)
    # sampling forwards 4*4 + 16*2 + 2 continuations x 16 rows x (4 + 2*3) = 368 a batch: 18,880,000 FLOP in all;
    # the decode positions (10 x (16 x 2 + 2 x 16 x 3) x 2N = 2,560,000 FLOP) leave the rate term (16.32 s),
    # 10 steps x 3 rounds x 2 decode steps x 0.5 s = 30 s join it
    assert tools.flops_per_run == 18_880_000
    assert tools.wall_seconds_expected == pytest.approx(16.32 + 30.0)
    assert "with each of the 6 decode steps per batch (3 sampling rounds: the first and 2 tool continuation(s)) " \
           "at the measured 500 ms" in tools.lines()[-1]


def test_expected_wall_time_with_a_measured_learn_stage_by_hand():
    """With a measured part (forward and backward) and optimizer step, the training FLOPs leave the
    rate term too; every gradient step's parts and optimizer step take their place."""
    base = dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=3, prompt_tokens=4, steps=10,
                epochs_per_batch=2, minibatches=2, n_params=1000, has_reference=False, threads=2,
                matmul_flops_per_s=1e6, decode_step_s=0.5)
    p = pricing.price(**base, learn_part_s=0.2, optimizer_step_s=0.05)
    # 12,480,000 FLOP: decode positions 640,000 and training 10 x 2 epochs x 16 rows x (4 + 3 - 1) x 6N = 11,520,000
    # leave the rate term (0.32 s: the prefill); 10 x 2 decode steps x 0.5 s = 10 s and
    # 10 steps x 2 epochs x 2 minibatches = 40 gradient steps x (1 part x 0.2 + 0.05 s) = 10 s join it
    assert p.wall_seconds_expected == pytest.approx(0.32 + 10.0 + 10.0)
    assert (p.learn_part_s, p.learn_parts_per_step, p.optimizer_step_s) == (0.2, 1, 0.05)
    assert p.wall_seconds_estimate == pytest.approx(12.48)                            # the lower bound unchanged
    assert p.lines()[-1].endswith(
        "; expected ~20.3 s at the 3-token cap, with each of the 2 decode steps per batch at the measured 500 ms (16 rows) "
        "and each of "
        "the 40 gradient steps at the measured 1 x 200 ms (forward and backward) + 50 ms (optimizer), before "
        "evaluation and rewards")
    # two micro parts a minibatch (2 groups: one each): 40 x (2 x 0.2 + 0.05) = 18 s
    two = pricing.price(**base, micro_batches=2, learn_part_s=0.2, optimizer_step_s=0.05)
    assert two.learn_parts_per_step == 2 and two.wall_seconds_expected == pytest.approx(0.32 + 10.0 + 18.0)
    assert "40 gradient steps at the measured 2 x 200 ms (forward and backward of each part)" in two.lines()[-1]
    # four micro parts asked of 2 groups: still 2 parts (whole groups)
    assert pricing.price(**base, micro_batches=4, learn_part_s=0.2).learn_parts_per_step == 2
    # not measured: the training FLOPs at the rate, as before
    assert pricing.price(**base).wall_seconds_expected == pytest.approx(11.84 + 10.0)
    assert pricing.price(**base).learn_part_s == 0.0


def _spy_accumulate(monkeypatch) -> list:
    """Record (rows, ids shape, mask sum, micro_batches) of every rlvr.learn.accumulate call, running the real one."""
    import rlvr.learn

    calls, real = [], rlvr.learn.accumulate

    def spy(learner, batch, rows, delta_rows, *a, **kw):
        ro = batch.rollout
        calls.append((len(rows), tuple(ro.ids.shape), float(ro.mask.sum()), learner.cfg.train.micro_batches))
        return real(learner, batch, rows, delta_rows, *a, **kw)

    monkeypatch.setattr(rlvr.learn, "accumulate", spy)
    return calls


def test_the_learn_probe_runs_the_learn_stage_on_full_length_parts_and_leaves_the_run_untouched(monkeypatch):
    from test_autocast import tiny_setup

    calls = _spy_accumulate(monkeypatch)
    setup = tiny_setup()
    model = setup.model
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert setup.cfg.sampling.expected_response_tokens == 0          # no expected length: no part timed at it
    part, opt, expected, peak = learn_mod.learn_part_seconds(setup)
    assert part > 0 and opt > 0 and expected == 0.0
    assert peak == 0                                                # no whole part ran: no peak of one
    assert not model.training                                       # its mode restored
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # no update
    assert all(p.grad is None for p in model.trainable_params())     # its gradients dropped
    assert torch.equal(torch.get_rng_state(), rng)                   # the global RNG forked
    G, T, Lp = setup.cfg.train.samples_per_prompt, setup.limits.max_new_tokens, setup.limits.prompt_tokens
    assert setup.cfg.train.prompts_per_step == 4                    # one part of 4 groups: timed at 1 and 2 groups
    sizes = [rows for rows, *_ in calls]
    assert sizes[:4] == [G, 2 * G, G, 2 * G] and sizes[4:] in ([], [G, 2 * G], [G, 2 * G] * 2)
    # every row at the longest prompt and the full response bound, every token in the loss, in one part
    assert all(shape == (rows, Lp + T) and mask == rows * T and micro == 1 for rows, shape, mask, micro in calls)
    # two parts a minibatch: a part of 2 groups timed as it is (a warm-up, then the best of two)
    calls.clear()
    two = tiny_setup("--train.micro_batches=2")
    peak = learn_mod.learn_part_seconds(two)[3]
    assert [rows for rows, *_ in calls] == [2 * G] * 3
    assert peak >= costs.resident_bytes() * 0.5 > 0                  # the process's resident set at the part's peak
    # a learner group on this machine: one rank's share of the minibatch (2 of its 4 groups, as it
    # is), at a learner actor's threads, this process's restored after; the price says whose step it is
    calls.clear()
    group = tiny_setup()
    d = group.cfg.distributed
    d.learners, d.cpus_per_worker = 2, 1.0
    torch.set_num_threads(2)
    threads = []
    real_spy = learn_mod.accumulate
    monkeypatch.setattr(learn_mod, "accumulate", lambda *a, **kw: threads.append(torch.get_num_threads())
                        or real_spy(*a, **kw))
    assert probes.learn_probe_share(group) == (2, 1)
    part, _, _, peak = learn_mod.learn_part_seconds(group)
    assert part > 0 and peak == 0 and torch.get_num_threads() == 2   # a rank's memory is not this process's
    assert [rows for rows, *_ in calls] == [2 * G] * 3 and set(threads) == {1}
    price = run_price.price_of(group, rate=1e9, decode_s=0.25, learn_s=(0.5, 0.01))
    assert (price.learner_ranks, price.learn_threads, price.learn_parts_per_step) == (2, 1, 1)
    assert ("(forward and backward of one learner rank's share at 1 torch thread(s); the 2 ranks side by side; "
            "their gradient all-reduce not counted)") in price.wall_line()
    d.learners = 3                                                      # 4 groups over 3 ranks: 2 at most
    assert probes.learn_probe_share(group) == (2, 1)
    # learners elsewhere (a cluster) or on another kind of device: nothing measured here
    calls.clear()
    for key, value in (("address", "auto"), ("gpus_per_worker", 1.0)):
        was = getattr(d, key)
        setattr(d, key, value)
        assert probes.learn_probe_share(group) is None
        assert learn_mod.learn_part_seconds(group) == (0.0, 0.0, 0.0, 0) and calls == []
        setattr(d, key, was)


def test_a_larger_part_is_extrapolated_from_one_and_two_groups(monkeypatch):
    """Clock readings scripted: one group 0.3 then 0.2 s, two groups 0.5 then 0.35 s: each size's
    best, a part of 4 groups = 0.2 + (0.35 - 0.2) x 3 = 0.65 s; the optimizer's best of three
    steps (after an untimed first) 0.01 s, on a scratch parameter as large as the trainable ones."""
    import rlvr.learn
    from test_autocast import tiny_setup

    setup = tiny_setup()
    monkeypatch.setattr(rlvr.learn, "accumulate", lambda *a, **kw: {})
    ticks = iter([t for d in (0.3, 0.5, 0.2, 0.35, 0.03, 0.01, 0.02) for t in (0.0, d)])
    monkeypatch.setattr(machine_mod.time, "perf_counter", lambda: next(ticks))
    part, opt, _, _ = learn_mod.learn_part_seconds(setup)
    assert part == pytest.approx(0.65) and opt == pytest.approx(0.01)


def test_the_learn_probe_times_a_part_at_the_expected_lengths_and_the_price_takes_it(monkeypatch):
    """Clock readings scripted, a part of one group at T = 16: at T one call, 0.5 s (the part: at an
    expected length it sets only the cap-based figure and the memory peak, so no warm-up or best of
    two); then the same group with its rows at the length model's quantiles for a mean of 5 tokens
    (rlvr.lengths.part_lengths) 0.25 then 0.2 s (its best of two; the part at T was its warm-up); the
    optimizer's steps after. The price's learn stage at that expected length is then the 0.2 s
    part, not the 0.5 s one in proportion to its positions."""
    import rlvr.learn
    from test_autocast import tiny_setup

    setup = tiny_setup("--sampling.max_new_tokens=16", "--train.prompts_per_step=1",
                       "--sampling.expected_response_tokens=5")
    rows = []
    monkeypatch.setattr(rlvr.learn, "accumulate", lambda learner, b, *a, **kw: rows.append(
        (b.groups.rollout.mask.sum(1).tolist(), b.groups.rollout.attention_mask.sum(1).tolist())) or {})
    ticks = iter([t for d in (0.5, 0.25, 0.2, 0.03, 0.01, 0.02) for t in (0.0, d)])
    monkeypatch.setattr(machine_mod.time, "perf_counter", lambda: next(ticks))
    part, opt, expected, _ = learn_mod.learn_part_seconds(setup)
    assert (part, opt, expected) == pytest.approx((0.5, 0.01, 0.2))
    G, Lp = setup.cfg.train.samples_per_prompt, setup.limits.prompt_tokens
    lengths = costs.part_lengths(costs.length_survival(5, 16), 1, G)
    assert len(set(lengths)) > 1 and max(lengths) < 16                # a spread, short of the cap
    # one call at T (every token in the loss), then two with each row's own length in the loss
    # and its attention mask (the prompt's columns and its response's)
    assert rows == [([16.0] * G, [Lp + 16] * G)] + [([float(n) for n in lengths], [Lp + n for n in lengths])] * 2
    price = run_price.price_of(setup, rate=1e9, decode_s=0.25, learn_s=(part, opt, expected))
    assert price.learn_expected_part_s == pytest.approx(0.2)
    assert price.learn_part_fraction == pytest.approx(price.learn_parts_per_step * 0.2 / 0.5)
    # a larger part at an expected length: one and two groups timed once each (no second round)
    setup = tiny_setup("--sampling.max_new_tokens=16", "--sampling.expected_response_tokens=5")
    assert setup.cfg.train.prompts_per_step == 4                        # one part of 4 groups
    rows.clear()
    ticks = iter([t for d in (0.3, 0.5, 0.25, 0.2, 0.03, 0.01, 0.02) for t in (0.0, d)])
    part, opt, expected, _ = learn_mod.learn_part_seconds(setup)
    assert (part, opt, expected) == pytest.approx((0.3 + 0.2 * 3, 0.01, 0.2))
    assert [len(m) for m, _ in rows] == [G, 2 * G] + [4 * G] * 2


def test_a_run_its_memory_refuses_is_not_probed_and_a_given_learn_time_reaches_the_price(monkeypatch):
    from test_autocast import tiny_setup

    calls = _spy_accumulate(monkeypatch)
    setup = tiny_setup()
    monkeypatch.setattr(costs, "available_bytes", lambda: 1)     # nothing fits
    refused = run_price.price_of(setup, rate=1e9, decode_s=0.25, probe_learn=True)
    assert calls == [] and refused.learn_part_s == 0.0 and refused.wall_seconds_expected > 0
    with pytest.raises(setup_types.RunError, match="needs about"):
        run_price.check_memory(setup.cfg, refused)                         # which the run's own check then refuses
    monkeypatch.undo()
    given = run_price.price_of(setup, rate=1e9, decode_s=0.25, learn_s=(0.5, 0.01))
    steps = setup.cfg.train.steps * setup.cfg.train.epochs_per_batch * setup.cfg.train.minibatches
    assert given.learn_part_s == 0.5 and given.optimizer_step_s == 0.01
    assert given.wall_seconds_expected == pytest.approx(refused.wall_seconds_expected
                                                        - given.flops_train_per_batch * setup.cfg.train.steps / 1e9
                                                        + steps * (0.5 + 0.01))
    measured = run_price.price_of(setup, rate=1e9, decode_s=0.25, probe_learn=True)
    assert measured.learn_part_s > 0 and measured.optimizer_step_s > 0
    assert run_price.price_of(setup, rate=1e9, decode_s=0.25).learn_part_s == 0.0   # no probe: the FLOPs at the rate


def test_decode_step_is_measured_on_the_runs_policy_or_a_rollout_workers_share(monkeypatch):
    from test_autocast import tiny_setup

    calls = []
    real = sampling.generate
    monkeypatch.setattr(sampling, "generate", lambda model, prompts, **kw: calls.append((prompts, kw)) or real(
        model, prompts, **kw))
    setup = tiny_setup("--sampling.max_new_tokens=8")
    setup.model.train()
    got = probes.decode_step_seconds(setup)
    assert got > 0 and setup.model.training                       # measured; the model's mode restored
    P, G = setup.cfg.train.prompts_per_step, setup.cfg.train.samples_per_prompt
    assert P > 1 and G > 1
    assert setup.limits.max_new_tokens >= 3                       # b = 2: both timed calls decode
    n = min(probes.DECODE_PROBE_STEPS, setup.limits.max_new_tokens - 2)
    more = setup.limits.max_new_tokens - 2
    # one call of 2 + n tokens timed inside (its steps' clock readings), n = DECODE_PROBE_STEPS, then
    # one of all the response bound allows (a tiny model's steps span far less than DECODE_PROBE_SECONDS)
    assert more > n and [kw["budgets"][0] for _, kw in calls] == [2 + n, 2 + more]
    assert all(len(kw["step_times"]) == kw["budgets"][0] for _, kw in calls)
    # each call's cache as long as the run's (its rows cut after the tokens timed): the run's layout
    assert all(kw["max_new_tokens"] == setup.limits.max_new_tokens and kw["reserve"] == 0
               and kw["budgets"] == [kw["budgets"][0]] * P for _, kw in calls)
    # a real step's shape: P prompts of G samples each (the grouped cache layout), not one prompt x P*G
    assert all(kw["samples_per_prompt"] == G and len(p) == P
               and all(len(x) == setup.limits.prompt_tokens for x in p) and kw["eos_id"] is None for p, kw in calls)
    price = run_price.price_of(setup, rate=1e9, decode_s=0.25)
    assert price.decode_step_s == 0.25 and price.wall_seconds_expected > price.wall_seconds_estimate
    assert f"at the measured 250 ms ({P * G} rows)" in price.wall_line()

    # rollout workers on this machine: the largest worker's share, ceil(P / N) prompts, at a worker's
    # threads (this process's restored after); the price says whose step it is
    d = setup.cfg.distributed
    d.rollout_workers, d.cpus_per_worker = 2, 1.0
    torch.set_num_threads(2)
    seen = []
    monkeypatch.setattr(sampling, "generate", lambda model, prompts, **kw: seen.append(
        (len(prompts), torch.get_num_threads())) or real(model, prompts, **kw))
    assert probes.decode_probe_share(setup) == (-(-P // 2), 1)
    assert probes.decode_step_seconds(setup) > 0 and torch.get_num_threads() == 2
    assert seen and set(seen) == {(-(-P // 2), 1)}
    price = run_price.price_of(setup, rate=1e9, decode_s=0.25)
    assert (price.decode_prompts, price.decode_threads, price.rollout_workers) == (-(-P // 2), 1, 2)
    assert (f"(a rollout worker's largest share, {-(-P // 2)} prompts x {G} = {-(-P // 2) * G} rows at 1 torch "
            "thread(s); the 2 workers decode side by side") in price.wall_line()
    from rlvr.distributed.sync import state_bytes, trainable_state
    assert price.sync_bytes == state_bytes(trainable_state(setup.model)) > 0     # what each sync sends
    assert f"{price.sync_bytes / 2**20:,.2f} MiB after every update" in price.wall_line()
    d.rollout_workers, d.cpus_per_worker = 3, 2.0
    assert probes.decode_probe_share(setup) == (-(-P // 3), 2)
    seen.clear()
    for key, value in (("address", "auto"), ("gpus_per_worker", 1.0)):  # elsewhere, or another device: not here
        was = getattr(d, key)
        setattr(d, key, value)
        assert probes.decode_probe_share(setup) is None and probes.decode_step_seconds(setup) == 0.0
        price = run_price.price_of(setup, rate=1e9)
        assert price.wall_seconds_expected == 0.0 and "expected" not in price.wall_line()
        setattr(d, key, was)
    assert not seen


def _scripted_decode(monkeypatch, readings):
    """sampling.generate replaced: each call's budget recorded, and where it is timed (``step_times``)
    the next of `readings` (one clock reading per step) given as its steps' readings."""
    calls, script = [], iter(readings)

    def fake(*a, budgets, step_times=None, **kw):
        calls.append(budgets[0])
        if step_times is not None:
            got = next(script)
            assert len(got) == budgets[0]
            step_times.extend(got)

    monkeypatch.setattr(sampling, "generate", fake)
    return calls


def test_a_decode_step_is_timed_inside_one_call_after_its_first_tokens(monkeypatch):
    """Clock readings scripted, one at each step of a call of 2 + 3 tokens: the step is the span from
    the second step's reading to the last's over 3 (the prefill and the first decode step, which a
    call pays once, not counted): a slow first step does not move it. With responses of 2 tokens at
    most, a call of 2 tokens and the span of its one step after the first."""
    from test_autocast import tiny_setup

    monkeypatch.setattr(probes, "DECODE_PROBE_STEPS", 3)
    monkeypatch.setattr(probes, "DECODE_PROBE_SECONDS", 0.0)      # the first call only
    calls = _scripted_decode(monkeypatch, [[0.0, 5.0, 5.1, 5.3, 5.6]])
    assert probes.decode_step_seconds(tiny_setup("--sampling.max_new_tokens=8")) == pytest.approx(0.2)
    assert calls == [5]
    calls = _scripted_decode(monkeypatch, [[0.0, 0.3]])
    assert probes.decode_step_seconds(tiny_setup("--sampling.max_new_tokens=2")) == pytest.approx(0.3)
    assert calls == [2]


def test_a_decode_probe_whose_steps_span_too_little_time_times_more_of_them(monkeypatch):
    """Clock readings scripted, DECODE_PROBE_SECONDS = 1: the first call's 3 steps after its first 2
    tokens span 0.3 s, 0.1 s a step; a second call times the 10 steps that span 1 s at that rate,
    0.12 s a step, the figure returned (not the first call's). The response bound caps the steps
    (T - 2); steps that already span the time are not timed again. On a GPU each timed call follows
    an untimed warm-up of as many tokens."""
    from test_autocast import tiny_setup

    monkeypatch.setattr(probes, "DECODE_PROBE_STEPS", 3)
    monkeypatch.setattr(probes, "DECODE_PROBE_SECONDS", 1.0)

    def steps(first, each, n):                 # readings: 2 tokens, then n steps of `each` seconds
        return [0.0, first] + [first + each * (i + 1) for i in range(n)]

    calls = _scripted_decode(monkeypatch, [steps(1.0, 0.1, 3), steps(1.0, 0.12, 10)])
    assert probes.decode_step_seconds(tiny_setup("--sampling.max_new_tokens=64")) == pytest.approx(0.12)
    assert calls == [5, 12]
    calls = _scripted_decode(monkeypatch, [steps(1.0, 0.1, 3), steps(1.0, 0.7 / 6, 6)])   # 6 steps at most
    assert probes.decode_step_seconds(tiny_setup("--sampling.max_new_tokens=8")) == pytest.approx(0.7 / 6)
    assert calls == [5, 8]
    calls = _scripted_decode(monkeypatch, [steps(1.0, 0.4, 3)])       # 3 steps of 0.4 s span 1.2 s: enough
    assert probes.decode_step_seconds(tiny_setup("--sampling.max_new_tokens=64")) == pytest.approx(0.4)
    assert calls == [5]
    assert [probes.probe_steps(s, 3, 30) for s in (0.0, 0.5, 0.25, 0.3, 0.01)] == [3, 3, 4, 4, 30]
    calls = _scripted_decode(monkeypatch, [steps(1.0, 0.1, 4)])       # the steps asked for: one call, as told
    assert probes.decode_step_seconds(tiny_setup("--sampling.max_new_tokens=64"), steps=4) == pytest.approx(0.1)
    assert calls == [6]
    # on a GPU: a warm-up as long as each timed call (first kernel choices per cache length); the
    # device faked
    gpu = tiny_setup("--sampling.max_new_tokens=64")
    monkeypatch.setattr(gpu, "device", torch.device("cuda"))
    monkeypatch.setattr(sampling, "prompt_generators", lambda *a, **kw: None)
    calls = _scripted_decode(monkeypatch, [steps(1.0, 0.1, 3), steps(1.0, 0.12, 10)])
    assert probes.decode_step_seconds(gpu) == pytest.approx(0.12)
    assert calls == [5, 5, 12, 12]


def test_a_decode_steps_cost_per_cached_column_is_measured_after_a_longer_prompt(monkeypatch):
    """decode_column_seconds: a step after a prompt min(T // 2, DECODE_PROBE_DEPTH) columns longer,
    less the step after the run's prompt, over the rows and those columns; its calls keep the run's
    columns (T - depth more to decode) and, for a lean cache whose deeper call would take the grouped
    layout where the run's takes the plain one, reserve columns until it takes the plain one too."""
    from test_autocast import tiny_setup

    from rlvr.models import lean_llama

    setup = tiny_setup("--sampling.max_new_tokens=64")
    P, G, T = setup.cfg.train.prompts_per_step, setup.cfg.train.samples_per_prompt, setup.limits.max_new_tokens
    Lp = setup.limits.prompt_tokens
    seen = []
    times = {0: [0.3], 32: [0.5]}
    asked = []

    def fake(st, prompts=None, depth=0, reserve=0, steps=0):
        seen.append((depth, reserve))
        asked.append(steps)
        return times[depth][min(sum(d == depth for d, _ in seen), len(times[depth])) - 1]

    monkeypatch.setattr(probes, "decode_step_seconds", fake)
    assert probes.decode_column_seconds(setup, 0.25) == pytest.approx((0.5 - 0.3) / (P * G * 32))
    assert seen == [(0, 0), (32, 0)]      # the run's step again, then T // 2 deeper; the built-in cache: no layouts
    assert asked == [8, 8]                # each in one call of the steps that span 2 s at the run's 0.25 s
    # the machine slowed between the two: the deeper no longer than the step; the pair again, each's best
    seen.clear()
    times.update({0: [0.6, 0.4, 0.3], 32: [0.55, 0.38, 0.5]})
    assert probes.decode_column_seconds(setup, 0.25) == pytest.approx((0.38 - 0.3) / (P * G * 32))
    assert seen == [(0, 0), (32, 0)] * 3
    assert probes.decode_column_seconds(setup, 0.0) == 0.0        # no step measured: nothing to compare
    assert probes.decode_column_seconds(tiny_setup("--sampling.max_new_tokens=16"), 0.3) == 0.0  # 8 columns: too few
    # a lean (CPU) cache: at G = 4 and 4x the score FLOPs allowed, the run's columns (Lp + G x 64 against
    # Lp + 64) take the plain layout, the deeper call's (Lp + 32, 32 to decode) the grouped one
    monkeypatch.setattr(setup.model, "new_cache", lambda b, m: lean_llama.LeanCache(1, b, m, "cpu"))
    monkeypatch.setattr(lean_llama, "GROUP_ATTENTION_FLOPS", 3.5)
    assert not lean_llama.grouped_layout(Lp, T, G) and lean_llama.grouped_layout(Lp + 32, T - 32, G)
    seen.clear()
    times.update({0: [0.3], 32: [0.5]})
    probes.decode_column_seconds(setup, 0.3)
    assert seen[0] == (0, 0)
    (depth, reserve), = seen[1:]
    assert not lean_llama.grouped_layout(Lp + 32, T - 32 + reserve, G)
    assert lean_llama.grouped_layout(Lp + 32, T - 32 + reserve - 1, G)   # the fewest columns that do
    monkeypatch.setattr(lean_llama, "GROUP_ATTENTION_FLOPS", 4.0)      # the run's own cache grouped: not measured
    assert lean_llama.grouped_layout(Lp, T, G) and probes.decode_column_seconds(setup, 0.3) == 0.0


def test_the_column_probe_times_no_more_steps_than_its_deeper_call_can_decode():
    """Steps that span DECODE_PROBE_SECONDS on a tiny model are more than a call after a prompt T // 2
    longer can decode (T - T // 2 - 2): the deeper call times all it can, measured for real, asked
    for them or not, and `rlvr price` of such a run prices it (it once refused to, its budgets past
    the call's bound)."""
    from test_autocast import tiny_setup

    setup = tiny_setup("--sampling.max_new_tokens=64")
    step = probes.decode_step_seconds(setup)
    assert step > 0 and probes.probe_steps(step, 3, 62) > 30       # more than the deeper call's 30
    assert probes.decode_step_seconds(setup, depth=32) > 0 and probes.decode_step_seconds(setup, depth=32, steps=62) > 0
    assert probes.decode_column_seconds(setup, step) >= 0
    rc, out = cli("price", EXAMPLE, *TINY, "--sampling.max_new_tokens=64")
    assert rc == 0 and "expected ~" in out, out


def cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue()


def test_run_warns_before_step_1_and_sets_wall_against_the_estimate(tmp_path, monkeypatch):
    machine(monkeypatch, cores=2, load=3.0)
    monkeypatch.setattr(machine_mod, "matmul_rate", lambda device: 1e9)
    rc, out = cli("train", EXAMPLE, "--out", tmp_path / "r", *TINY, "--algorithm.dynamic_sampling=true",
                  "--algorithm.dynamic_sampling_rounds=3")
    assert rc == 0, out
    lines = out.splitlines()
    warn = [i for i, line in enumerate(lines) if "oversubscribed" in line]
    step1 = next(i for i, line in enumerate(lines) if "step     1/2" in line)
    assert len(warn) == 1 and warn[0] < step1
    assert "load average 3.0 + this run's 2 threads > 2 cores" in lines[warn[0]]
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert "oversubscribed" in rows[0]["warning"] and rows[0]["step"] == 0    # before any step row
    price = json.loads((tmp_path / "r" / "price.json").read_text())
    assert price["matmul_flops_per_s"] == 1e9 and price["threads"] == 2
    assert price["wall_seconds_estimate"] == pytest.approx(price["flops_per_run"] / 1e9)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["cost/wall_vs_estimate"] == pytest.approx(summary["wall_seconds"] / price["wall_seconds_estimate"])
    cost = next(line for line in lines if line.startswith("cost: "))
    assert (f"(price {price['sampled_tokens_per_run']:,}, worst case {price['sampled_tokens_per_run_worst']:,})"
            in cost)
    assert any(line.startswith("price: wall time >= ") for line in lines)


def test_the_cost_line_splits_the_wall_time_and_sets_the_steps_against_the_expected_time(tmp_path, monkeypatch):
    """The price's expected wall time prices the steps without their rewards: the summary's
    cost/step_seconds (the sum of the rows' time/step_s) less cost/score_seconds (the sum of their
    time/score_s: scoring the responses, here made 0.1 s longer a call) is set against it, the
    evaluations inside the wall time are counted apart (the step-0 one and eval.every's), and the
    cost line names every part."""
    from rlvr import groups as groups_mod

    real_score = groups_mod.score_groups
    monkeypatch.setattr(groups_mod, "score_groups", lambda *a, **k: time.sleep(0.1) or real_score(*a, **k))
    machine(monkeypatch, cores=2, load=0.0)
    monkeypatch.setattr(machine_mod, "matmul_rate", lambda device: 1e9)
    monkeypatch.setattr(machine_mod, "_MATMUL_RATES", {})          # none measured in this process
    monkeypatch.setattr(probes, "decode_step_seconds", lambda setup: 0.01)
    evals = []
    real_eval = trainer.run_eval
    monkeypatch.setattr(trainer, "run_eval", lambda *a: evals.append(time.sleep(0.2)) or real_eval(*a))
    rc, out = cli("train", EXAMPLE, "--out", tmp_path / "r", *TINY, "--eval.at_start=true", "--eval.every=1",
                  "--train.steps=3")
    assert rc == 0, out
    assert len(evals) == 4                                    # step 0, after steps 1 and 2, and the final one
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    price = json.loads((tmp_path / "r" / "price.json").read_text())
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    steps_s = sum(r["time/step_s"] for r in rows if "time/step_s" in r)
    score_s = sum(r["time/score_s"] for r in rows if "time/step_s" in r)
    assert all(0.1 <= r["time/score_s"] < r["time/step_s"] for r in rows if "time/step_s" in r)
    assert summary["cost/step_seconds"] == pytest.approx(steps_s, rel=1e-9)
    assert summary["cost/score_seconds"] == pytest.approx(score_s, rel=1e-9)
    assert 0.6 <= summary["cost/eval_seconds"] < summary["wall_seconds"] - steps_s   # three inside the wall time
    ratio = (steps_s - score_s) / price["wall_seconds_expected"]
    assert summary["cost/steps_vs_expected"] == pytest.approx(ratio)
    assert "cost/wall_vs_expected" not in summary
    cost = next(line for line in out.splitlines() if line.startswith("cost: "))
    assert (f"{summary['wall_seconds']:.1f} s (estimate >= {price['wall_seconds_estimate']:.1f} s): "
            f"steps {steps_s:.1f} s (scoring their responses {score_s:.1f} s; the rest {steps_s - score_s:.1f} s "
            f"against the expected ~{price['wall_seconds_expected']:.1f} s: {ratio:.2f}x), "
            f"evaluation {summary['cost/eval_seconds']:.1f} s, saves and logging ") in cost
    # the rate was given, not measured in this process: no end-of-run comparison
    assert summary["machine/matmul_rate_vs_start"] is None and "matmul rate at the end" not in cost
    rep = {name: (p, c) for name, p, c in report.cost_rows(report.load_run_records(tmp_path / "r"))}
    assert rep["unscored_step_seconds"] == (price["wall_seconds_expected"], pytest.approx(steps_s - score_s))
    assert rep["step_seconds"] == (None, summary["cost/step_seconds"])
    assert "wall_seconds_expected" not in rep and rep["eval_seconds"] == (None, summary["cost/eval_seconds"])


def test_the_eta_leaves_out_the_step_0_evaluation():
    from test_autocast import tiny_setup
    setup = tiny_setup()
    state = trainer.new_state(setup)
    row = {"step": 2, "train/reward": 0.5, "train/goal": 0.5, "train/nonzero_delta_frac": 1.0,
           "train/agreeing_groups_frac": 0.0, "train/entropy": 1.0}
    steps = setup.cfg.train.steps
    line = trainer.progress(state, row, elapsed=13.0, steps_done=2, before_s=3.0)
    assert "| 13.0s | 5.00 s/step |" in line and line.endswith(f"ETA {trainer._duration(5.0 * (steps - 2))}")
    assert "| 6.50 s/step |" in trainer.progress(state, row, elapsed=13.0, steps_done=2)


def test_price_command_prints_the_estimate(monkeypatch):
    machine(monkeypatch, cores=2, load=0.0)
    monkeypatch.setattr(machine_mod, "matmul_rate", lambda device: 2e9)
    rc, out = cli("price", EXAMPLE, "--train.threads=1")
    assert rc == 0 and "GFLOP/s with 1 threads" in out and "warning" not in out
    rc, out = cli("price", EXAMPLE, "--json")
    assert rc == 0 and json.loads(out)["matmul_flops_per_s"] == 2e9


def test_the_cost_line_says_how_the_machines_speed_moved_over_the_run(tmp_path, monkeypatch):
    """The price's matmul rate, measured once at the start (cached in the process), against the same
    products timed again at the end: scripted at half (a machine that slowed), the summary's
    machine/matmul_rate_vs_start is 0.5 and the cost line says so."""
    machine(monkeypatch, cores=2, load=0.0)
    monkeypatch.setattr(machine_mod, "_MATMUL_RATES", {})
    monkeypatch.setattr(machine_mod, "measure_matmul_rate",
                        lambda device, seconds: 2e9 if not machine_mod._MATMUL_RATES else 1e9)
    monkeypatch.setattr(probes, "decode_step_seconds", lambda setup, **kw: 0.01)
    rc, out = cli("train", EXAMPLE, "--out", tmp_path / "r", *TINY, "--train.steps=1")
    assert rc == 0, out
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["machine/matmul_rate_vs_start"] == pytest.approx(0.5)
    cost = next(line for line in out.splitlines() if line.startswith("cost: "))
    assert cost.endswith("; this machine's matmul rate at the end: 0.50x the one measured at the start")
