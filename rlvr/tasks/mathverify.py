"""Math answers checked by math-verify, in a worker process with a hard timeout.

Why a worker process
--------------------
math-verify bounds ``parse`` and ``verify`` with ``signal.alarm``, which only works on the main
thread of a process (off it, the timeout silently does nothing or raises), and sympy can run
for minutes on an adversarial expression. So :class:`MathVerifier` runs them in one long-lived
child process (a fresh ``python -P -c`` interpreter, the current directory not on its path: no inherited threads, CUDA state or
re-imported ``__main__``) where they *are* on the main thread, and waits at most ``timeout`` seconds per call. On a timeout the child is killed,
the call raises :class:`TimeoutError` (status ``error`` in :func:`rlvr.rewards.score`: counted,
never a silent 0, never a hang) and the next call starts a fresh child. Calls are serialized by
a lock, so the reward is safe to call from several threads.

Cost: the first call starts the child (about 0.3 s) and the first check imports math-verify
and sympy (about 1 s);
later calls cost a pipe round trip plus the check itself (about a millisecond for simple
answers). One module-level verifier is shared by every :func:`math_equal` call.

The reward
----------
``math_equal(prompt, response, answer)``: 1.0 when math-verify finds the response's final
answer equal to ``str(answer)`` (the gold is wrapped in ``$...$`` unless it already has
delimiters or a ``\\boxed``), else 0.0. A response with no parseable answer scores 0.0 (that
is a wrong answer, not a failure).

The task
--------
:func:`math_task` is either a JSONL file of problems (through :func:`rlvr.tasks.dataset.jsonl_task`,
with ``math_equal`` as the reward) or, with ``problems=None``, a small built-in set of
fraction-arithmetic questions whose answers are written as ``\\frac{p}{q}``.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from typing import Any, Callable

from rlvr.isolation import python_argv
from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task, TaskError
from rlvr.tasks.answers import Answer, unwrap
from rlvr.tasks.dataset import jsonl_task

__all__ = ["MathVerifier", "math_equal", "MATH_EQUAL", "math_task", "get_verifier", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 10.0
"""Seconds one parse+verify may take in the worker (start-up of a fresh worker not counted)."""
START_TIMEOUT = 120.0
"""Seconds a fresh worker may take to start and answer its first ping."""


# ---------------------------------------------------------------------------------------------
# functions run inside the worker (module level, so they pickle by name)


def _verify(gold: str, response: str) -> bool:
    from math_verify import parse, verify  # lazy: imports sympy

    g = gold.strip()
    if not (g.startswith("$") or "\\boxed" in g or g.startswith("\\(") or g.startswith("\\[")):
        g = f"${g}$"
    gold_p = parse(g)
    if not gold_p:
        raise ValueError(f"math-verify cannot parse the gold answer {gold!r}")
    return bool(verify(gold_p, parse(response)))


def _ping() -> str:
    return "pong"


def _sleep(seconds: float) -> float:
    """Test hook: a check that takes ``seconds`` (stands in for a hanging sympy call)."""
    time.sleep(seconds)
    return seconds


_FUNCTIONS: dict[str, Callable] = {"verify": _verify, "ping": _ping, "sleep": _sleep}
"""What a worker may be asked to run, by name (no pickled callables cross the pipe)."""


def _serve() -> None:
    """The worker loop: read one JSON request per line on stdin, answer one JSON line.

    Request ``{"fn": name, "args": [...]}``; answer ``{"ok": value}`` or ``{"err": "Type: msg"}``.
    The protocol uses a private copy of the stdout descriptor; fd 1 is pointed at stderr so
    that anything printed by math-verify or sympy cannot corrupt it.
    """
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            reply = {"ok": _FUNCTIONS[req["fn"]](*req["args"])}
        except BaseException as e:  # report everything, keep serving
            if isinstance(e, KeyboardInterrupt):
                return
            reply = {"err": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class MathVerifier:
    """A worker process that runs checks with a per-call timeout; restarted after a timeout.

    The worker is a fresh interpreter (``python -P -c``, rlvr.isolation, via subprocess), not a multiprocessing
    child: ``spawn`` and ``forkserver`` re-import the parent's ``__main__``, which would re-run
    an unguarded training script, and ``fork`` copies the trainer's threads. POSIX only (it
    waits on the pipe with ``select``).
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self.restarts = 0
        """How many times the worker was killed (timeout) or found dead and replaced."""

    # -- process management
    def _start(self) -> None:
        from rlvr.reward_pool import worker_env

        env = worker_env(dict(os.environ))  # the reward workers' allow-list: no token of the trainer's
        self._proc = subprocess.Popen(
            python_argv("from rlvr.tasks.mathverify import _serve; _serve()"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
        )
        self._buf = b""
        self._request("ping", (), START_TIMEOUT)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        with self._lock:
            self._kill()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _request(self, fn: str, args: tuple, limit: float) -> dict:
        """Send one request and wait for its line; TimeoutError / RuntimeError on failure."""
        proc = self._proc
        try:
            proc.stdin.write((json.dumps({"fn": fn, "args": list(args)}) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            self._kill()
            self.restarts += 1
            raise RuntimeError(f"math-verify worker died: {type(e).__name__}: {e}") from None
        deadline = time.monotonic() + limit
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self._kill()
                self.restarts += 1
                raise TimeoutError(f"{fn} took longer than {limit:g}s; the worker was killed "
                                   "and will be restarted")
            chunk = os.read(fd, 65536)
            if not chunk:
                code = proc.poll()
                self._kill()
                self.restarts += 1
                raise RuntimeError(f"math-verify worker exited (code {code}) during {fn}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    # -- calls
    def call(self, fn: str, *args: Any, timeout: float | None = None) -> Any:
        """Run the worker function ``fn`` (a name in ``_FUNCTIONS``) on JSON ``args``.

        TimeoutError after ``timeout`` s (default ``self.timeout``; the worker is killed and
        the next call starts a new one); RuntimeError with the worker's exception text if the
        function raised or the worker died.
        """
        if fn not in _FUNCTIONS:
            raise ValueError(f"unknown worker function {fn!r}; known: {', '.join(_FUNCTIONS)}")
        limit = self.timeout if timeout is None else float(timeout)
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    self.restarts += 1
                self._kill()
                self._start()
            reply = self._request(fn, args, limit)
        if "err" in reply:
            raise RuntimeError(reply["err"])
        return reply["ok"]

    def equal(self, gold: str, response: str, timeout: float | None = None) -> bool:
        """math-verify's verdict: is the response's answer equal to ``gold``?"""
        return bool(self.call("verify", str(gold), str(response), timeout=timeout))


_DEFAULT: MathVerifier | None = None
_DEFAULT_LOCK = threading.Lock()


def get_verifier() -> MathVerifier:
    """The module's shared verifier (created on first use, stopped at exit)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = MathVerifier()
            atexit.register(_DEFAULT.close)
        return _DEFAULT


def math_equal(prompt: str, response: str, answer: Any) -> float:
    """1.0 when math-verify finds the response's answer equal to the gold, else 0.0.

    Raises TimeoutError (the check ran past the verifier's timeout) or RuntimeError (the check
    or the worker failed, e.g. an unparseable gold): :func:`rlvr.rewards.score` counts both as
    status ``error``.
    """
    gold, _ = unwrap(answer)
    return 1.0 if get_verifier().equal(str(gold), response) else 0.0


MATH_EQUAL_CARD = RewardCard(
    pays_for="a final answer (the boxed one, else the last expression math-verify extracts) that is "
             "mathematically equal to the gold: 0.5 = 1/2 = \\frac{1}{2}, x=2 matches 2",
    ignores="the reasoning and every candidate answer but the one extracted",
    exploit="lenient surface forms: trailing variables or units are dropped ('3x' passes for gold 3) and "
            "numbers are compared after rounding ('0.5000001' passes for 0.5); a response that hedges with "
            "several boxed values fails, so no multi-answer exploit is known",
    exploit_example=lambda ex: f"{unwrap(ex.answer)[0]}x",
)
MATH_EQUAL = Reward("math_equal", math_equal, MATH_EQUAL_CARD)
"""``math_equal`` with its card: name it in a dataset task as ``rlvr.tasks.mathverify:MATH_EQUAL``."""


def _goal(prompt: str, response: str, answer: Any) -> bool:
    try:
        return math_equal(prompt, response, answer) == 1.0
    except Exception:
        return False


def _latex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


BUILTIN_PROBLEMS = 9 ** 4 * 3
"""Distinct built-in problems: a/b op c/d with a, b, c, d in 1..9 and op one of +, -, x."""


def math_task(
    problems: str | None = None,
    heldout: str | int | None = None,
    *,
    train: int = 2000,
    seed: int = 0,
    prompt_column: str = "problem",
    answer_column: str = "answer",
    heldout_fraction: float = 0.1,
    max_new_tokens: int = 256,
) -> Task:
    """Math problems scored by ``math_equal``.

    With ``problems`` (a JSONL/parquet/csv path): rows with ``prompt_column`` and
    ``answer_column``, ``heldout`` another file or None (``heldout_fraction`` is held out).
    Without: ``train`` built-in questions "What is a/b + c/d?" (and -, *) with answers as
    ``\\frac{p}{q}``, and ``heldout`` (an int, default 200) more with distinct prompts.
    """
    if problems is not None:
        if heldout is not None and not isinstance(heldout, str):
            raise TaskError("math_task: with a problems file, heldout is a file path or None")
        return jsonl_task(problems, heldout, prompt_column=prompt_column, answer_column=answer_column,
                          heldout_fraction=heldout_fraction, seed=seed,
                          rewards={"math_equal": "rlvr.tasks.mathverify:MATH_EQUAL"},
                          max_new_tokens=max_new_tokens)
    n_held = 200 if heldout is None else heldout
    if isinstance(n_held, bool) or not isinstance(n_held, int) or n_held < 1 or train < 1:
        raise TaskError(f"math_task: train and heldout must be positive ints, got {train!r}, {heldout!r}")
    if train + n_held > BUILTIN_PROBLEMS:
        raise TaskError(f"math_task: train + heldout = {train + n_held:,} asks for more than the {BUILTIN_PROBLEMS:,} "
                        f"distinct built-in problems; ask for fewer, or give a problems file")
    rng = random.Random(seed)
    seen: dict[str, Example] = {}
    for _ in range(50 * (train + n_held)):
        if len(seen) >= train + n_held:
            break
        a, b, c, d = (rng.randint(1, 9) for _ in range(4))
        op = rng.choice("+-*")
        x, y = Fraction(a, b), Fraction(c, d)
        val = x + y if op == "+" else x - y if op == "-" else x * y
        sym = {"+": "+", "-": "-", "*": "\\times"}[op]
        p = f"What is $\\frac{{{a}}}{{{b}}} {sym} \\frac{{{c}}}{{{d}}}$? Put the final answer in \\boxed{{}}."
        if p not in seen:
            seen[p] = Example(p, Answer(_latex(val), {}), {"value": str(val)})
    examples = list(seen.values())
    if len(examples) < train + n_held:
        raise TaskError(f"math_task: only {len(examples)} distinct built-in problems; ask for fewer")
    return Task(
        name="math-fractions",
        train=examples[n_held:],
        heldout=examples[:n_held],
        rewards={"math_equal": MATH_EQUAL},
        goal=_goal,
        max_new_tokens=max_new_tokens,
        alphabet=None,
        fixed_length=False,
    )


TASK = math_task
