"""Measurements live in the docs, not in the code.

A figure measured on one machine at one state of the code (a CPU's name, "median of ten
alternated", "36.0 against 37.1 ms", "115 GFLOP/s") goes stale the day the code or the machine
changes, and a docstring is printed where nobody can tell (`rlvr train --help` prints the config
fields' docstrings). A docstring or comment in rlvr/ states the rule and one line of why, and
links the page where the current figure lives (docs/benchmarks.md, docs/performance.md); the
history of figures is CHANGELOG.md. This test lists every line in rlvr/ that holds such a figure.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each pattern names one kind of measurement prose; a line matching any of them is refused.
PATTERNS = {
    "a CPU or GPU model": r"\b(Xeon|EPYC|Ryzen|Threadripper|Core i[3579]|AMX|AVX-?512\w*|AVX2|"
                          r"H100|H200|A100|V100|RTX ?\d+)\b",
    "a machine's core count": r"\b\d+-core\b",
    "a median of repeats": r"\bmedians? of (\d+|two|three|four|five|six|seven|eight|nine|ten)\b",
    "alternated timings": r"\b(\d+|two|three|four|five|six|seven|eight|nine|ten) alternated\b",
    "a time against a time": r"\d\s*(ms|us|µs|s)\s+against\b|\bagainst\s+[\d.,]+\s*(ms|us|µs)\b",
    "a rate": r"\d\s*[GMT]FLOP/s|\d\s*GB/s",
    "a machine's hour": r"\b(slow|fast|slower|faster|middle) hour\b",
    "a timing": r"\btook (about |~)?[\d.,]+\s*(ms|us|µs|s)\b|\b[\d.]+\s*(ms|us|µs) (a|per) "
                r"(step|call|row|layer)\b|\d\s*ms vs\b|\(measured:",
    "a speed ratio": r"(?<!at least )(?<![\d.])\d+(\.\d+)?x (faster|slower|the time)\b",
    "measured on a machine": r"\bmeasured on (a|an|one|the|this|that)\b[^.;:]{0,40}"
                             r"\b(CPU|GPU|machine|NVIDIA|cores?)\b",
}
RE = re.compile("|".join(f"(?:{p})" for p in PATTERNS.values()))


def offending_lines():
    found = []
    for path in sorted((ROOT / "rlvr").rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if RE.search(line):
                kinds = [k for k, p in PATTERNS.items() if re.search(p, line)]
                found.append(f"{path.relative_to(ROOT)}:{n}: [{', '.join(kinds)}] {line.strip()}")
    return found


def test_patterns_catch_measurement_prose():
    for text in ("(2-core Xeon with AMX)", "36.0 against 37.1 ms (median of ten alternated)",
                 "a rate of 115.5 GFLOP/s", "0.33 s against 0.09 s", "in a slow hour",
                 "measured on an NVIDIA H200", "measured on a CPU with native bf16",
                 "the step took 3.6 s there", "(measured: 9 ms vs 26 ms per layer)", "2.5x faster"):
        assert RE.search(text), text
    for text in ("measured on its own policy", "measured on this run's policy",
                 "bf16 only when it is at least 1.2x faster", "(measured at the start)",
                 "the result is the median of `rounds` samples of each, alternated",
                 "bf16 only when it is at least 1.2x faster", "(measured at the start)",
                 "the result is the median of `rounds` samples of each, alternated",
                 "f'{a * 1e3:.3g} ms against {b:.3g} ms'", "see docs/performance.md"):
        assert not RE.search(text), text


def test_no_measurement_prose_in_the_package():
    found = offending_lines()
    assert not found, ("measurement prose in rlvr/ (state the rule and why, link docs/benchmarks.md "
                       "or docs/performance.md for the figure):\n" + "\n".join(found))
