"""Memory figures read from /proc: this process's resident set and what the machine can still give."""

from __future__ import annotations


def _proc_kib(path: str, key: str) -> int | None:
    """Bytes of the `key:` line (in kB) of a /proc file; None where the file or line is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """This process's resident set now (VmRSS of /proc/self/status; 0 where there is none)."""
    return _proc_kib("/proc/self/status", "VmRSS") or 0


def available_bytes() -> int | None:
    """Memory the machine can give a new run without swapping: MemAvailable of /proc/meminfo
    (None where it cannot be read)."""
    return _proc_kib("/proc/meminfo", "MemAvailable")
