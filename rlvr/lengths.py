"""The response-length model behind the price at an expected length (rlvr.costs; RunShape's
expected_response_tokens): lengths geometric with a given mean and cut at the cap, and what a
batch of them costs in decode steps, rows computed a step and learn-stage columns.

A response's length L = min(X, cap), X geometric on 1, 2, ... (``length_ratio``, ``length_survival``).
A batch decodes until its longest row ends (``expected_longest``); each decode step computes the
rows still in the batch (``decode_rows_per_step``: finished rows leave it, rlvr.sampling's rule),
at a fixed cost plus a cost per row (``decode_split``, from decode steps measured at two row
counts; ``expected_decode_seconds``), and a cost per row for each column a row has cached
(``decode_row_columns``: its attention reads them); each learn part runs to its rows' expected
columns (``learn_part_widths``), in the buckets the learn stage cuts (``expected_buckets``); a
part at the expected lengths is what the learn probe times (``part_lengths``).
"""

from __future__ import annotations


def length_ratio(mean: float, cap: int) -> float:
    """q of the response-length model: a length L = min(X, cap), X geometric on 1, 2, ... with
    P(X > t) = q^t, whose mean E[L] = sum_{t < cap} q^t = (1 - q^cap) / (1 - q) is `mean` (1 <= mean
    <= cap; 0 at mean 1, every response one token; 1 at the cap, every response cut there). E[L] rises
    with q, so bisection finds it."""
    if not 1 <= mean <= cap:
        raise ValueError(f"length_ratio: the mean length must lie in [1, {cap}] (the cap), got {mean!r}")
    if mean >= cap:
        return 1.0
    if mean <= 1:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(100):
        q = (lo + hi) / 2
        if (1 - q**cap) / (1 - q) < mean:
            lo = q
        else:
            hi = q
    return (lo + hi) / 2


def length_survival(mean: float, cap: int) -> list[float]:
    """P(L > t) for t = 0 .. cap - 1 of a response length L with mean `mean` truncated at `cap`
    (`length_ratio`: q^t; all 1 at the cap). Its sum is `mean`; it is also the expected share of a
    batch's rows still decoding at decode step t (a row of L tokens takes L - 1 decode steps)."""
    q = length_ratio(mean, cap)
    return [q**t for t in range(cap)]


def expected_longest(survival: list[float], rows: int) -> float:
    """E[the longest of `rows` independent lengths with survival P(L > t) = survival[t]]:
    sum_t P(max > t) = sum_t 1 - (1 - survival[t])^rows (the decode steps a batch runs, plus 1: the
    loop runs until its last row ends)."""
    return sum(1 - (1 - s)**rows for s in survival)


def decode_rows_per_step(survival: list[float], rows: int, compact: float | None) -> list[float]:
    """Expected rows each decode step t = 1 .. cap - 1 computes for a batch of `rows` rows: the rows
    still in the batch, rows x survival[t] still decoding, more where finished rows wait to be
    dropped: with `compact` (rlvr.sampling.COMPACT_FINISHED) the batch is narrowed to the live rows
    once that share of the rows it holds has finished (followed in expectation); with None every row
    is computed while the loop runs. Never more than rows x P(the loop still runs) = rows x
    (1 - (1 - survival[t])^rows)."""
    out, held = [], float(rows)
    for s in survival[1:]:
        live = rows * s
        if compact is None:
            held = float(rows)
        elif held - live >= compact * held:
            held = live
        out.append(min(held, rows * (1 - (1 - s)**rows)))
    return out


def decode_split(step_s: float, rows: int, small_s: float = 0.0, small_rows: int = 0) -> tuple[float, float]:
    """(seconds a decode step costs whatever its rows, seconds more a row) from a step measured at
    `rows` rows (`step_s`) and one at fewer, `small_rows` (`small_s`): the line through the two,
    kept within [0, step_s] for the fixed part. Without the second: all of it fixed (an upper estimate:
    fewer rows then cost nothing less)."""
    if small_s <= 0 or not 0 < small_rows < rows:
        return step_s, 0.0
    per_row = min(max((step_s - small_s) / (rows - small_rows), 0.0), step_s / rows)
    return step_s - per_row * rows, per_row


def expected_decode_seconds(survival: list[float], rows: int, fixed_s: float, per_row_s: float,
                            compact: float | None) -> tuple[float, float, float]:
    """(seconds, expected decode steps, expected rows computed in all) of one sampling call's decode
    of `rows` rows whose lengths have survival `survival` (`length_survival`), each step costing
    `fixed_s` + `per_row_s` x its rows (`decode_split`): E[longest] - 1 steps, the rows of
    `decode_rows_per_step`. At the cap (survival all 1): cap - 1 steps of `rows` rows."""
    steps = expected_longest(survival, rows) - 1
    computed = sum(decode_rows_per_step(survival, rows, compact))
    return fixed_s * steps + per_row_s * computed, steps, computed


def decode_row_columns(survival: list[float], rows: int, compact: float | None) -> float:
    """Expected sum over a batch's decode steps t = 1 .. cap - 1 of the rows step t computes times
    t, the columns each has cached past its prompt (``decode_rows_per_step``): what a decode priced
    per row and cached column costs above one priced at the prompt alone. At the cap (survival all
    1): rows x cap (cap - 1) / 2."""
    return sum(n * t for t, n in enumerate(decode_rows_per_step(survival, rows, compact), start=1))


def length_at(survival: list[float], u: float) -> int:
    """The length at quantile u (0 < u < 1) of the model with survival P(L > t) = survival[t]:
    1 + the steps t >= 1 with survival[t] > u (the inverse CDF)."""
    return 1 + sum(1 for s in survival[1:] if s > u)


BUCKET_DRAWS = 64
"""Parts `expected_buckets` draws: the mean bucket count of a 16-row part at SmolLM2's lengths moved
by under 0.1 between seeds at this many."""


def expected_buckets(survival: list[float], rows: int, draws: int = BUCKET_DRAWS, seed: int = 0) -> tuple[float, float]:
    """(mean buckets, mean response positions) of a learn part of `rows` rows cut in length buckets
    (train.length_buckets) at lengths with survival `survival`: `draws` parts of lengths drawn from
    the model (inverse CDF, a generator seeded with `seed`: the same figures every time), each cut
    by rlvr.scoring.length_buckets as the learn stage cuts its forwards (positions: each bucket's
    rows x its longest row, the buckets' own padding counted)."""
    import random

    import torch

    from rlvr.scoring import length_buckets

    rng = random.Random(seed)
    buckets = positions = 0
    for _ in range(draws):
        ext = torch.tensor([length_at(survival, rng.random()) for _ in range(rows)])
        cut = length_buckets(ext)
        buckets += len(cut)
        positions += sum(len(b) * int(ext[b].max()) for b in cut)
    return buckets / draws, positions / draws


def part_lengths(survival: list[float], groups: int, G: int) -> list[int]:
    """Response lengths of a learn part of `groups` groups of G rows as the length model expects one
    (rlvr.learn.learn_part_seconds times such a part): its n = groups x G rows at the model's
    quantiles u = (i + 1/2) / n, i = 0 .. n - 1 (`length_at`, as `expected_buckets` draws), dealt to
    the groups in turn, so that each group spans the spread as a sampled group does: row g * G + j
    gets quantile j * groups + g."""
    n = groups * G
    at = [length_at(survival, (i + 0.5) / n) for i in range(n)]
    return [at[j * groups + g] for g in range(groups) for j in range(G)]


def learn_part_widths(survival: list[float], groups: int, G: int, parts: int, length_buckets: bool) -> list[float]:
    """Expected response columns a row of each of the `parts` parts of a minibatch of `groups`
    groups of G rows computes in the learn stage's forward and backward: the part's longest row,
    E[the longest of its ceil(groups / parts) x G rows] (a part runs every row to its longest,
    rlvr.learn); with `length_buckets` (train.length_buckets: each forward in length buckets, each
    bucket to its own longest row) about each row's own length, the mean (sum of `survival`; the
    buckets' own padding not counted)."""
    if length_buckets:
        return [sum(survival)] * parts
    return [expected_longest(survival, -(-groups // parts) * G)] * parts
