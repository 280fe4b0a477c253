"""How rlvr starts a fresh Python interpreter for its workers (reward pool, math verifier).

A worker started with ``python -c CODE`` has the current directory first on ``sys.path``: a
``struct.py`` (or any module name) in the directory where ``rlvr eval`` runs, a run directory
received from someone else say, would be imported in place of the real module. The worker's
``sys.path`` is what the parent passes (its PYTHONPATH) and the interpreter's own: never the
current directory.
"""

from __future__ import annotations

import sys

_DROP_CWD = "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
"""Python 3.10 (no ``-P``): the first statement of the command removes the current-directory entry
before anything else is imported (``sys`` is built in)."""


def python_argv(code: str) -> list[str]:
    """The command line that runs ``code`` in a fresh interpreter whose ``sys.path`` does not hold the
    current directory: ``python -P -c CODE`` on 3.11+, else the entry removed by the code's first
    statement."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-c", code]
    return [sys.executable, "-c", _DROP_CWD + code]
