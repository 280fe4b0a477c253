"""Every benchmark script starts: its module-level imports resolve (the helpers it loads from this
repository included) and it prints its usage for --help. The benchmarks themselves are too slow for
the suite (they are run by hand, see benchmarks/README.md); this catches a script left pointing at a
file that moved."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

CHILD = r"""
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # an import that does not resolve, or any other failure at start
        code = repr(e)
    out[path] = [code, len(buf.getvalue())]
print(json.dumps(out))
"""


def test_every_benchmark_prints_its_usage():
    assert len(SCRIPTS) >= 10
    proc = subprocess.run([sys.executable, "-c", CHILD, *map(str, SCRIPTS)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(got) == sorted(map(str, SCRIPTS))
    for path, (code, printed) in got.items():
        # 0: argparse's --help; 2: a script that prints its usage itself when not given a config
        assert code in (0, 2) and printed > 0, (path, code, proc.stderr[-3000:])
