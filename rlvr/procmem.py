"""Memory figures read from /proc: this process's resident set and what the machine can still give."""

from __future__ import annotations

import threading


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


class ResidentPeak:
    """The largest resident set (`resident_bytes`) seen while the ``with`` block runs, polled by a
    daemon thread every `interval` seconds and once at each end (``peak``, bytes; 0 where /proc has
    no figure). Unlike the kernel's high-water mark (VmHWM, ru_maxrss) it covers only the block, and
    it resets nothing that a tool watching the process reads. A poll can miss a spike shorter than
    `interval`; the tensors of a forward and backward live far longer."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, resident_bytes())

    def __enter__(self) -> ResidentPeak:
        self.peak = resident_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, name="rlvr-resident-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, resident_bytes())
