"""How the policy's forwards compute (`model.autocast`): the autocast context, the decision
`model.autocast = auto` takes (`choose_numerics`: from the model's size and whether the device
computes bf16 in hardware, never from a timing, so every start on one machine decides alike), the
timing of one probe product in fp32 and under bf16 autocast that the price's wall-time estimate
uses, all recorded as a `Numerics`.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass

import torch

from rlvr import config as config_mod, memory_model
from rlvr.machine import time_calls
from rlvr.models.lean_llama import bf16_weights
from rlvr.models.tiny import TinyConfig
from rlvr.policy import Policy


AUTOCAST_MIN_HIDDEN = 256
"""`model.autocast = auto` keeps fp32, without timing, for models whose hidden size is below this:
their step is per-operation overhead more than matrix products, so bf16 buys little speed and a
machine-dependent trajectory (docs/performance.md)."""
AUTOCAST_SAMPLE_S = 2e-3
"""Each timed sample of the probe product repeats it for at least this long, so a sample is the
product's warm cost and not a timer tick or a first call's kernel choice."""
_AUTOCAST_TIMINGS: dict[tuple, tuple[float, float]] = {}


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 products in hardware: a CUDA device that reports bf16 support, or
    a CPU with bf16 matrix tiles or bf16 vector dot products (torch.cpu's own checks of the
    instructions its bf16 kernels use). False elsewhere (other CPUs emulate bf16 and run it slower than fp32; MPS). A property of the
    machine, so `model.autocast = auto` decides alike in every start on it, whatever the load."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    cpu = torch.cpu
    checks = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(check() for check in checks if check is not None)


def autocast_context(enabled: bool, device_type: str) -> contextlib.AbstractContextManager:
    """torch.autocast to bf16 on `device_type` when `enabled` (with a region of bf16 weight copies on
    the CPU, rlvr.models.lean_llama.bf16_weights), else a context that changes nothing. A new object
    per call (use one per `with`)."""
    if not enabled:
        return contextlib.nullcontext()
    if device_type != "cpu":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return _cpu_bf16()


@contextlib.contextmanager
def _cpu_bf16():
    with torch.autocast("cpu", dtype=torch.bfloat16), bf16_weights():
        yield


def autocast_timings(device: torch.device, rows: int, inner: int, outer: int, budget_s: float = 0.5,
                     rounds: int = 5) -> tuple[float, float]:
    """(fp32 seconds, bf16 seconds) of one warm (rows, inner) x (inner, outer) product as a Linear
    layer computes it (the weight cast to bf16 included), plain and under bf16 autocast on `device`.

    First-call costs are excluded: three untimed calls of each choose the kernels, then each timed
    sample repeats the product for at least AUTOCAST_SAMPLE_S, and the result is the median of
    `rounds` samples of each, alternated (fewer when the budget runs out). Measured once per process
    and thread count."""
    key = (str(device), rows, inner, outer, torch.get_num_threads())
    if key in _AUTOCAST_TIMINGS:
        return _AUTOCAST_TIMINGS[key]
    x, w = torch.randn(rows, inner, device=device), torch.randn(outer, inner, device=device)

    def timed(bf16: bool, calls: int) -> float:
        with torch.no_grad(), autocast_context(bf16, device.type):
            return time_calls(lambda: torch.nn.functional.linear(x, w), device, calls)

    start = time.perf_counter()
    warm = (timed(False, 3), timed(True, 3))                     # kernel choice, first casts: not timed
    calls = [max(1, math.ceil(AUTOCAST_SAMPLE_S / max(t, 1e-9))) for t in warm]
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for i, bf16 in enumerate((False, True)):
            samples[i].append(timed(bf16, calls[i]))
        if time.perf_counter() - start > budget_s:
            break
    fp32, bf16 = (statistics.median(s) for s in samples)
    _AUTOCAST_TIMINGS[key] = (fp32, bf16)
    return fp32, bf16


@dataclass(frozen=True)
class Numerics:
    """How the policy's forwards compute (`model.autocast`): fp32, or bf16 products under torch.autocast
    (weights, optimizer and log-softmax stay float32)."""

    bf16: bool
    """True: the forwards run under bf16 autocast."""
    asked: str = "off"
    """model.autocast as configured: auto, bf16 or off."""
    device_type: str = "cpu"
    fp32_s: float = 0.0
    """Measured seconds of the probe product in fp32 (a fresh run's price, when the run computes in
    bf16; 0 = not measured)."""
    bf16_s: float = 0.0
    """The same product under bf16 autocast."""
    shape: tuple[int, int, int] = (0, 0, 0)
    """(rows, inner, outer) of the probe product."""

    def context(self) -> contextlib.AbstractContextManager:
        """The context the policy's forwards run in (a new one per call)."""
        return autocast_context(self.bf16, self.device_type)

    def matmul_speedup(self) -> float:
        """fp32 time / bf16 time of the probe product when the run computes in bf16 and it was measured
        (auto, or bf16 set on a fresh run; below 1 where bf16 is slower), so the price's wall-time
        estimate scales the fp32 matmul rate by it; 1.0 otherwise (fp32, or bf16 without a
        measurement: a resumed run, `rlvr eval`)."""
        return self.fp32_s / self.bf16_s if self.bf16 and self.fp32_s > 0 and self.bf16_s > 0 else 1.0

    def describe(self) -> str:
        """One line for the price: what was chosen and why, with both measured times where timed."""
        what = "bf16 autocast" if self.bf16 else "fp32"
        rows, inner, outer = self.shape
        if self.asked == "auto" and inner and inner < AUTOCAST_MIN_HIDDEN:
            return (f"{what} (model.autocast = auto: hidden size {inner} < {AUTOCAST_MIN_HIDDEN}: a model this small "
                    f"is not bound by its products)")
        why = (f"model.autocast = auto: this {self.device_type.upper()} "
               + ("computes bf16 in hardware" if self.bf16 else "has no bf16 units")
               if self.asked == "auto" else f"model.autocast = {self.asked}")
        if not self.fp32_s:
            return f"{what} ({why})"
        speedup = self.fp32_s / self.bf16_s
        slower = "; slower than fp32 here" if speedup < 1 else ""
        return (f"{what} ({why}; bf16 {speedup:.2f}x fp32 here, {self.bf16_s * 1e3:.3g} ms against "
                f"{self.fp32_s * 1e3:.3g} ms for a {rows} x {inner} x {outer} product{slower})")


def auto_takes_bf16(hidden: int, native: bool) -> bool:
    """The rule of `model.autocast = auto`: bf16 for a model of hidden size at least
    AUTOCAST_MIN_HIDDEN on a device that computes bf16 in hardware (`native_bf16`). Below the floor a
    step is per-operation overhead more than products, so bf16 would buy little speed for a changed
    trajectory; on a device without bf16 units bf16 is slower. No timing enters: a decision taken from
    a timing flipped between starts on one machine (noise, another busy process), and with it what a
    seed learns."""
    return hidden >= AUTOCAST_MIN_HIDDEN and native


def choose_numerics(mode: str, device: torch.device, shape: tuple[int, int, int],
                    time_bf16: bool = False) -> Numerics:
    """`model.autocast` resolved: `bf16` and `off` as said; `auto` by `auto_takes_bf16` on the probe's
    inner size (the hidden size) and `native_bf16(device)`. `time_bf16` (a fresh run's price): when
    the run computes in bf16, one (rows, inner, outer) product is timed in both numerics with
    `autocast_timings`, so the price's wall time is at the rate bf16 runs at here and its line says
    when bf16 is the slower one; the timing never changes the decision."""
    bf16 = mode == "bf16" or (mode == "auto" and auto_takes_bf16(shape[1], native_bf16(device)))
    if not (bf16 and time_bf16):
        return Numerics(bf16, mode, device.type, shape=tuple(shape))
    fp32_s, bf16_s = autocast_timings(device, *shape)
    return Numerics(bf16, mode, device.type, fp32_s, bf16_s, tuple(shape))


def eval_numerics(cfg: config_mod.Config, model: Policy, recorded: str | None) -> Numerics:
    """What `rlvr eval` samples a finished run's model under: `recorded`, the decision the run took when
    it started (model.autocast = auto; rlvr.rundir.RunDir.recorded_autocast), so the evaluation
    computes as the run's own evaluations did; else model.autocast as configured (auto measured now)."""
    device = next(iter(model.parameters())).device
    asked = (recorded if cfg.model.autocast == "auto" else None) or cfg.model.autocast
    return choose_numerics(asked, device, probe_shape(model, device))


def probe_shape(model: Policy, device: torch.device) -> tuple[int, int, int]:
    """(rows, inner, outer) of the autocast probe: 256 token rows (4096 on a GPU, where small products
    time only the launch) x the hidden size x the MLP width of `model` (1024 x 1024 when unknown)."""
    rows = 256 if device.type == "cpu" else 4096
    shape = model_shape(model)
    return (rows, shape.hidden, shape.mlp) if shape is not None else (rows, 1024, 1024)


def model_shape(model: Policy) -> memory_model.ModelShape | None:
    """The dimensions rlvr.memory_model.memory needs, from the built-in model's or a Hugging Face model's
    config (None when they cannot be read)."""
    c = model.config
    if isinstance(c, TinyConfig):
        return memory_model.ModelShape(layers=c.n_layer, hidden=c.n_embd, mlp=c.mlp_ratio * c.n_embd, heads=c.n_head,
                                kv_heads=c.n_head, head_dim=c.n_embd // c.n_head, vocab=c.vocab_size)
    hf = getattr(c, "hf", None)
    hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    try:
        heads = hf.num_attention_heads
        return memory_model.ModelShape(
            layers=hf.num_hidden_layers, hidden=hf.hidden_size, mlp=getattr(hf, "intermediate_size", None)
            or 4 * hf.hidden_size, heads=heads, kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads, vocab=hf.vocab_size,
            checkpointed=bool(getattr(model, "gradient_checkpointing", False)))
    except (AttributeError, TypeError):
        return None
