"""The README's test command is what CI runs, and the README names the main command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"^TEST_CMD='(.+)'$", ci, re.M)
    assert m, ".ci/run must define TEST_CMD on one line"
    assert m.group(1) in (ROOT / "README.md").read_text()
    assert 'bash -c "$TEST_CMD"' in ci


def test_install_pins_cpu_torch_before_the_package():
    for text in ((ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()):
        for line in text.splitlines():
            if "pip install" in line and "-e ." in line:
                assert line.index("torch==2.13.0") < line.index("-e ."), line


def test_readme_main_command_runs_the_sort_example():
    assert "rlvr train examples/sort.toml" in (ROOT / "README.md").read_text()


def test_every_example_is_in_the_readme_with_a_figure():
    """examples/ holds only configs that learn: each is a row of the README's Examples table, and
    the plumbing configs (held-out goal 0.000) live under tests/configs/, named there too."""
    text = (ROOT / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `examples/")]
    named = {line.split("`")[1] for line in rows}
    assert named == {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.toml")}
    for line in rows:
        assert re.search(r"\d\.\d{2,}", line) and "being measured" not in line, line   # a measured figure, no placeholder
    for p in (ROOT / "tests" / "configs").glob("*.toml"):
        assert f"`{p.name}`" in text and not (ROOT / "examples" / p.name).exists(), p.name
