"""Sorting: the toy that shows how a denser reward buys speed and sells loopholes.

Format
------
The prompt is n whole numbers drawn uniformly from ``[low, high]`` followed by ``=``; the
answer, and a solved response, is the same numbers in non-decreasing order.

* ``high <= 9`` (one digit each): the digits run together. Prompt ``"31415="``, answer
  ``"11345"``; a response is exactly ``n`` characters.
* ``high >= 10``: every number is zero-padded to the width of ``high`` and the numbers are
  joined by ``,``. With ``high=12``: prompt ``"07,12,03="``, answer ``"03,07,12"``.

Responses have a fixed length (``Task.fixed_length`` is True): the sampler draws exactly
``max_new_tokens = len(answer)`` tokens and no end token.

Rewards (each with its card; see :func:`sort_task` for the numbers)
--------------------------------------------------------------------
* ``exact``: 1.0 when the response equals the answer, else 0.0. The goal itself, and sparse.
* ``position``: the fraction of positions holding the answer's number at that position.
* ``position_per_token``: a process reward, one score per response token: 1.0 where the token
  (character) equals the answer's there. Its per-token Δ credits each token for its own
  position; compare with the sequence-level ``position``.
* ``inclusion_adjacency``: (prompt numbers found in the response, as a multiset) plus
  (neighbouring pairs in non-decreasing order), divided by ``n + (n - 1)``.

The goal is an exact match. Every reward returns a number in [0, 1] for any string: wrong
length, stray characters or an empty response score low, never raise.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from math import comb

from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Example, Task, limits

ENUMERATE_LIMIT = 200_000
"""Spaces of at most this many lists are enumerated: train is every list not held out."""
DEFAULT_TRAIN = 100_000
"""Training examples drawn when the space is larger than ENUMERATE_LIMIT and train=None."""
SEP = ","
"""Separator between numbers when ``high >= 10``."""
MAX_CARD_WORK = 2_000_000
"""Largest ``n**2 * (high - low + 1)``: the reward cards' figures are exact order-statistic sums over
that many binomial tails (``_order_statistic_pmfs``), a few seconds at this bound; larger lists or
ranges are refused before anything is built."""


def _items(s: str, answer: str) -> list[str]:
    """Split a response or answer into its numbers (as strings) the way ``answer`` is written."""
    return s.split(SEP) if SEP in answer else list(s)


def _num(item: str) -> int | None:
    """The item as an int if it is ASCII digits only, else None."""
    return int(item) if item.isascii() and item.isdigit() else None


def exact(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response is the sorted answer, else 0.0."""
    return 1.0 if response == answer else 0.0


def goal(prompt: str, response: str, answer: str) -> bool:
    """The real target: the response is exactly the sorted numbers."""
    return response == answer


def position(prompt: str, response: str, answer: str) -> float:
    """Fraction of positions where the response's number equals the answer's.

    Divided by the longer of the two, so extra numbers count as wrong positions.
    Truth 0123: 0123 → 4/4, 2130 → 1/4, 1023 → 2/4 (a commonly quoted table prints 1 for the last row;
    positions 2 and 3 match, so that row is a typo under this definition).
    """
    truth = _items(answer, answer)
    got = _items(response, answer)
    hits = sum(a == b for a, b in zip(got, truth))
    return hits / max(len(truth), len(got))


def position_per_token(prompt: str, response: str, answer: str) -> list[float]:
    """Process reward: one score per response character, 1.0 where it equals the answer's there.

    Each token of a fixed-length response (a character, with the built-in tokenizer) is credited
    for its own position only, so the per-token Δ (rlvr.advantages.per_step_centered) pushes each
    digit by whether it is right. On one-digit lists the mean of the scores is `position`; with
    multi-digit numbers a token is a digit or a comma and is credited for its own character (a
    number with one wrong digit earns partial credit, unlike `position`). Characters beyond the
    answer score 0; an empty response returns [0.0] (no token to credit).
    """
    if not response:
        return [0.0]
    return [1.0 if i < len(answer) and c == answer[i] else 0.0 for i, c in enumerate(response)]


def inclusion_adjacency(prompt: str, response: str, answer: str) -> float:
    """(numbers of the prompt in the response, multiset) + (ordered neighbouring pairs), / (2n-1).

    Inclusion counts each prompt number at most as often as the prompt holds it (the answer
    has the same multiset). Adjacency counts neighbouring pairs of numbers with
    ``left <= right``, at most n - 1; a pair with a non-number in it does not count.
    """
    truth = _items(answer, answer)
    got = _items(response, answer)
    n = len(truth)
    inclusion = sum((Counter(got) & Counter(truth)).values())
    adjacency = 0
    prev = None
    for item in got:
        v = _num(item)
        if prev is not None and v is not None and prev <= v:
            adjacency += 1
        prev = v
    return (inclusion + min(adjacency, n - 1)) / (2 * n - 1)


def _order_statistic_pmfs(n: int, low: int, high: int) -> list[list[float]]:
    """pmfs[k][v - low] = P(the (k+1)-th smallest of n uniform draws from [low, high] is v).

    P(k-th smallest <= v) = P(at least k of n draws are <= v), a binomial tail.
    """
    m = high - low + 1

    def cdf(k: int, v: int) -> float:
        if v < low:
            return 0.0
        p = (v - low + 1) / m
        return sum(comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k, n + 1))

    return [[cdf(k, v) - cdf(k, v - 1) for v in range(low, high + 1)] for k in range(1, n + 1)]


def _position_modes(n: int, low: int, high: int) -> tuple[list[int], float]:
    """Most likely number at each sorted position for uniform prompts, and its mean position score."""
    modes, expected = [], 0.0
    for pmf in _order_statistic_pmfs(n, low, high):
        best = max(range(len(pmf)), key=pmf.__getitem__)
        modes.append(low + best)
        expected += pmf[best]
    return modes, expected / n


def _per_token_constant_score(n: int, low: int, high: int, modes: list[int]) -> float:
    """Mean `position_per_token` score of the constant response `modes` over uniform prompts.

    Per character: a digit of number k matches when the k-th smallest has that digit there; the
    n - 1 separators always match. Equals the `position` mean on one-digit lists.
    """
    width = len(str(high))
    hits = float(n - 1) if width > 1 else 0.0
    for k, pmf in enumerate(_order_statistic_pmfs(n, low, high)):
        mode = str(modes[k]).zfill(width)
        for j in range(width):
            hits += sum(q for v, q in enumerate(pmf, start=low) if str(v).zfill(width)[j] == mode[j])
    return hits / (n * width + (n - 1 if width > 1 else 0))


def _split_lists(strs: list[str], n: int, heldout: int, train: int | None, seed: int
                 ) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """Held-out and training lists of n numbers from `strs`, disjoint, drawn with Random(seed)."""
    m = len(strs)
    space = m**n
    rng = random.Random(seed)
    if space <= ENUMERATE_LIMIT:
        need = heldout + (train or 1)
        if need > space:
            raise ValueError(
                f"sort_task: {heldout} held out + {train or 1} train > {space} possible lists"
            )
        lists = list(itertools.product(strs, repeat=n))
        rng.shuffle(lists)
        held_lists = lists[:heldout]
        train_lists = lists[heldout:] if train is None else lists[heldout : heldout + train]
    else:
        n_train = DEFAULT_TRAIN if train is None else train
        if heldout + n_train > space // 2:
            raise ValueError(
                f"sort_task: {heldout} held out + {n_train} train is more than half of the "
                f"{space} possible lists; ask for fewer"
            )
        chosen: dict[int, None] = {}  # insertion-ordered set of list indices
        while len(chosen) < heldout + n_train:
            chosen.setdefault(rng.randrange(space), None)
        idx = list(chosen)

        def decode(i: int) -> tuple[str, ...]:
            out = []
            for _ in range(n):
                i, r = divmod(i, m)
                out.append(strs[r])
            return tuple(out)

        held_lists = [decode(i) for i in idx[:heldout]]
        train_lists = [decode(i) for i in idx[heldout:]]
    return held_lists, train_lists


class _CardFigures:
    """The numbers on the sort cards for one (n, low, high), and the exploit responses they describe."""

    def __init__(self, n: int, low: int, high: int, sep: str):
        self.n, self.low, self.high, self.sep = n, low, high, sep
        self.m = high - low + 1
        self.space = self.m**n
        self.width = len(str(high))
        self.strs = [str(x).zfill(self.width) for x in range(low, high + 1)]
        self.modes, self.modes_score = _position_modes(n, low, high)
        self.per_token_score = _per_token_constant_score(n, low, high, self.modes)
        self.constant = self.fmt(self.modes)
        p_ordered = (self.m + 1) / (2 * self.m)  # P(a <= b) for two uniform draws
        self.copy_score = (n + (n - 1) * p_ordered) / (2 * n - 1)
        self.near_score = (2 * n - 2) / (2 * n - 1)

    def fmt(self, nums) -> str:
        return self.sep.join(self.strs[x - self.low] for x in nums)

    def position_exploit(self, ex: Example) -> str:
        """The same response for every prompt (changed in one place if it happens to be right)."""
        if self.constant != ex.answer:
            return self.constant
        low = self.low
        alt = self.modes[:-1] + [low if self.modes[-1] != low else low + 1]
        return self.fmt(alt)

    def near_sort_exploit(self, ex: Example) -> str:
        """The answer with one neighbouring pair swapped, or one number changed if all equal."""
        nums = [int(x) for x in _items(ex.answer, ex.answer)]
        for i in range(len(nums) - 1):
            if nums[i] != nums[i + 1]:
                nums[i], nums[i + 1] = nums[i + 1], nums[i]
                return self.fmt(nums)
        if nums[-1] < self.high:
            nums[-1] += 1  # 77777 -> 77778: still non-decreasing, one number wrong
        else:
            nums[0] -= 1  # 99999 -> 89999
        return self.fmt(nums)


def _exact_reward(f: _CardFigures) -> Reward:
    return Reward(
        "exact",
        exact,
        RewardCard(
            pays_for="a response equal to the sorted numbers, character for character",
            ignores=(
                "how close a wrong response is: one swapped pair and noise both score 0, so "
                "a policy that is rarely right gets almost no gradient (a group of all-wrong "
                "samples has zero centered advantage)"
            ),
            exploit=(
                "none known: exact equals the goal on every string. Its failure is "
                f"sparsity, not a loophole: uniform random numbers solve a prompt with "
                f"probability 1/{f.space}"
            ),
            exploit_example=None,
        ),
    )


def _position_reward(f: _CardFigures) -> Reward:
    return Reward(
        "position",
        position,
        RewardCard(
            pays_for=(
                "each position holding the sorted answer's number there, as a fraction of n"
            ),
            ignores=(
                "the prompt, and which positions are wrong: two unrelated wrong answers "
                "score the same (truth 0123: 2130 and 0312 both score 1/4)"
            ),
            exploit=(
                f"the fixed response {f.constant!r} (the most likely number at each sorted "
                f"position) ignores the prompt and scores {f.modes_score:.3f} on average; "
                f"uniform random numbers score {1 / f.m:.3f}, a solved response 1.0"
            ),
            exploit_example=f.position_exploit,
        ),
    )


def _position_per_token_reward(f: _CardFigures) -> Reward:
    return Reward(
        "position_per_token",
        position_per_token,
        RewardCard(
            pays_for=(
                "each response token (character) equal to the sorted answer's character at "
                "the same position: one score per token, so each token is credited for its "
                "own position (a process reward; its mean is `position` on one-digit lists)"
            ),
            ignores=(
                "the prompt, and how the tokens relate: a right digit in a wrong list earns "
                "its point whatever surrounds it"
            ),
            exploit=(
                f"the fixed response {f.constant!r} ignores the prompt and scores "
                f"{f.per_token_score:.3f} per token on average (a solved response 1.0)"
                + ("; the separators and leading digits it gets right earn much of that"
                   if f.width > 1 else "")
            ),
            exploit_example=f.position_exploit,
        ),
    )


def _inclusion_adjacency_reward(f: _CardFigures) -> Reward:
    return Reward(
        "inclusion_adjacency",
        inclusion_adjacency,
        RewardCard(
            pays_for=(
                "each prompt number present in the response (multiset) plus each "
                f"neighbouring pair in non-decreasing order, over n + (n-1) = {2 * f.n - 1}"
            ),
            ignores=(
                "whether the numbers sit in their sorted positions: a run of one repeated "
                "number earns every adjacency point"
            ),
            exploit=(
                f"the answer with one neighbouring pair swapped scores {f.near_score:.3f} "
                f"(solved: 1.0) with the goal failed; copying the prompt verbatim sorts "
                f"nothing and scores {f.copy_score:.3f} on average"
            ),
            exploit_example=f.near_sort_exploit,
        ),
    )


def _rewards(n: int, low: int, high: int, sep: str) -> dict[str, Reward]:
    """The sort task's rewards with their cards; the card figures are computed for these n, low, high."""
    f = _CardFigures(n, low, high, sep)
    cards = (_exact_reward, _position_reward, _position_per_token_reward, _inclusion_adjacency_reward)
    return {r.name: r for r in (card(f) for card in cards)}


def demonstrate(example: Example) -> str:
    """The worked response to a sort prompt, for ``rlvr sft``: the answer itself."""
    return example.answer


def _check_sizes(n: int, low: int, high: int, heldout: int, train: int | None) -> None:
    """ValueError naming the option when the task would be too large to build (rlvr.tasks.limits): a
    prompt longer than MAX_PROMPT_CHARS, card figures past MAX_CARD_WORK, more examples than
    MAX_EXAMPLES or than the machine's memory holds. Checked before anything is allocated."""
    width = len(str(high)) if high < 10**4096 else limits.MAX_PROMPT_CHARS + 1   # two such numbers: too long
    option = "high" if width > n else "n"
    chars = n * width + (n - 1) * (width > 1) + 1                      # the prompt: the list and "="
    limits.check_length("sort_task", option, n if option == "n" else high, chars)
    work = n * n * (high - low + 1)
    if work > MAX_CARD_WORK:
        raise ValueError(f"sort_task: options n = {n:,}, low = {low:,}, high = {high:,} need n**2 * (high - low + 1) "
                         f"= {work:,} binomial tails for the reward cards, above the limit of {MAX_CARD_WORK:,}; "
                         "choose a smaller n or range")
    limits.check_count("sort_task", "heldout", heldout)
    if train is not None:
        limits.check_count("sort_task", "train", train)
    space = (high - low + 1) ** n
    count = heldout + (train if train is not None else space - heldout if space <= ENUMERATE_LIMIT else DEFAULT_TRAIN)
    limits.check_memory("sort_task", count, 2 * chars)


def sort_task(
    n: int = 5,
    low: int = 0,
    high: int = 9,
    heldout: int = 1000,
    train: int | None = None,
    seed: int = 0,
) -> Task:
    """The sorting task: n numbers from [low, high], the answer is them sorted.

    ``heldout`` distinct prompts are drawn with ``random.Random(seed)``; train never contains
    them. When the space of lists ((high-low+1)**n) is at most ENUMERATE_LIMIT, every list is
    shuffled once with that generator: held out are the first ``heldout``, train is the rest
    (or the next ``train`` of them). Larger spaces draw ``heldout`` and then ``train``
    (default DEFAULT_TRAIN) distinct lists. The same arguments always give the same task.
    """
    for k, v in (("n", n), ("low", low), ("high", high), ("heldout", heldout)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"sort_task: {k} must be an int, got {v!r}")
    if train is not None and (isinstance(train, bool) or not isinstance(train, int) or train < 1):
        raise ValueError(f"sort_task: train must be None or a positive int, got {train!r}")
    if n < 2:
        raise ValueError(f"sort_task: n must be at least 2 (a list to sort), got {n}")
    if not 0 <= low < high:
        raise ValueError(f"sort_task: need 0 <= low < high, got low={low}, high={high}")
    if heldout < 1:
        raise ValueError(f"sort_task: heldout must be at least 1, got {heldout}")
    _check_sizes(n, low, high, heldout, train)

    width = len(str(high))
    sep = "" if width == 1 else SEP
    strs = [str(x).zfill(width) for x in range(low, high + 1)]  # zero-padded: sorts as numbers

    def example(items: tuple[str, ...]) -> Example:
        return Example(prompt=sep.join(items) + "=", answer=sep.join(sorted(items)))

    held_lists, train_lists = _split_lists(strs, n, heldout, train, seed)
    rewards = _rewards(n, low, high, sep)
    alphabet = "0123456789" + ("" if width == 1 else SEP) + "="
    return Task(
        name=f"sort-{n}" if (low, high) == (0, 9) else f"sort-{n}-{low}-{high}",
        train=[example(x) for x in train_lists],
        heldout=[example(x) for x in held_lists],
        rewards=rewards,
        goal=goal,
        max_new_tokens=n * width + len(sep) * (n - 1),
        alphabet=alphabet,
        fixed_length=True,
        demonstrate=demonstrate,
    )


TASK = sort_task
"""``load_task("rlvr.tasks.sort:TASK", n=6)``: the callable form, parameterized by kwargs."""
