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


def test_the_files_run_first_exist():
    """tests/conftest.py's LONGEST_FIRST names files of tests/ (a renamed file would silently lose its place)."""
    from conftest import LONGEST_FIRST

    assert LONGEST_FIRST and all((ROOT / "tests" / name).is_file() for name in LONGEST_FIRST)


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


def test_readme_is_a_front_page():
    """The README is what a newcomer reads in five minutes; the rest lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_readme_links_point_at_files_that_exist():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    for target in targets:
        if target.startswith(("http://", "https://", "#")):
            continue
        assert (ROOT / target.split("#")[0]).exists(), target


def test_docs_build_is_one_command_in_the_readme_and_runs_in_ci():
    """`mkdocs build --strict`: broken links and references fail the docs build, in CI too."""
    assert 'python -m pip install -e ".[docs]" && mkdocs build --strict' in (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "mkdocs build --strict" in ci and ci.index('bash -c "$TEST_CMD"') < ci.index("mkdocs build --strict")
