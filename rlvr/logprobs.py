"""Token log-probs and entropies from logits, in float32 (float64 stays float64), optionally chunked.

`token_logprobs` (log softmax at the sampled ids) and `entropy_from_logits` (per-position entropy)
with `chunk_rows` set work through the B*T rows a chunk at a time in the forward and the backward,
so at most one (chunk_rows, V) float32 block exists at once: the working set of a large vocabulary
stays bounded, and on a CPU a cache-sized block (``AUTO_CHUNK``, `auto_chunk_rows`) runs each pass at
cache speed. A chunk that covers every row is the plain path. The losses that use these values are
in rlvr.losses.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlvr.compiled import compile_available, compiled_call

AUTO_CHUNK = "auto"
"""``chunk_rows = AUTO_CHUNK``: rows of a cache-sized float32 block (``auto_chunk_rows``)."""

LOGPROB_CHUNK_BYTES = {"cpu": 2 * 2**20, "cuda": 256 * 2**20}
"""The float32 (rows, V) block an automatic chunk holds, by device type (others take the CUDA size).
On a CPU a block that stays in the core's cache makes each of the chunk's passes (cast, temperature,
exponent, scatter, write back) run at cache speed instead of memory speed, several times faster on
a large vocabulary (figures: docs/benchmarks.md, "Figures behind the code's rules"). On a GPU the
chunk bounds memory only; a larger one keeps the launches few."""


def exp_floor(dtype: torch.dtype) -> float:
    """The chunked scorers' floor on exponent arguments: the first whole number above ln of
    ``dtype``'s smallest normal number (-87 for float32, -708 for float64; ``exp`` at ln itself
    rounds below the smallest normal). ``exp`` of an ``x - logsumexp`` below it would be a
    probability under 1.65e-38 (float32): read as exp(-87) instead, a change of less than 1.65e-38
    in any probability or logit gradient, none in a log-sum-exp whose largest term is 1 (the rest of
    its sum is absorbed). Why: torch's CPU ``exp`` (and ``logsumexp``) take a slow path on
    arguments whose result underflows, many times slower than the rest, and a low sampling
    temperature sends a large share of a real model's logits there (figures: docs/benchmarks.md,
    "Figures behind the code's rules")."""
    return float(math.ceil(math.log(torch.finfo(dtype).tiny)))


def _logsumexp_floored(x: Tensor) -> Tensor:
    """(n, V) float -> (n,) ``torch.logsumexp(x, -1)`` computed as torch computes it (the row's max
    out, exponent, sum, log, max back), with the exponent's arguments floored at ``exp_floor``: the
    same bits where no argument is below the floor."""
    m = x.amax(dim=-1, keepdim=True)                                      # (n, 1)
    m.masked_fill_(m.abs() == math.inf, 0.0)
    s = (x - m).clamp_min_(exp_floor(x.dtype)).exp_().sum(dim=-1)         # (n,)
    return s.log_().add_(m.squeeze(-1))


def auto_chunk_rows(vocab: int, device_type: str = "cpu") -> int:
    """Rows of a ``LOGPROB_CHUNK_BYTES`` float32 (rows, vocab) block, at least 1: 10 for a
    49,152-token vocabulary on a CPU (2 MiB / (4 x 49,152)), 34,952 for a 15-token one (so its
    batches take the plain path: a chunk that covers every row is the plain path)."""
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    block = LOGPROB_CHUNK_BYTES.get(device_type, LOGPROB_CHUNK_BYTES["cuda"])
    return max(1, block // (4 * vocab))


def chunk_setting(value: int) -> int | str | None:
    """``model.logprob_chunk_rows`` as the log-prob functions take it: -1 -> ``AUTO_CHUNK``, 0 ->
    None (all at once), n > 0 -> n."""
    return AUTO_CHUNK if value == -1 else (value or None)


def resolve_chunk_rows(chunk_rows: int | str | None, logits: Tensor) -> int | None:
    """``chunk_rows`` for these (..., V) logits: ``AUTO_CHUNK`` -> ``auto_chunk_rows(V, device)``,
    anything else unchanged (checked where it is used)."""
    if chunk_rows == AUTO_CHUNK:
        return auto_chunk_rows(logits.shape[-1], logits.device.type)
    return chunk_rows


def token_logprobs(
    logits: Tensor, ids: Tensor, *, temperature: float = 1.0, chunk_rows: int | str | None = None,
    compiled: bool = False,
) -> Tensor:
    """log softmax(logits / temperature) at ids: (B, T, V), (B, T) -> (B, T), float32 or wider.

    logits[:, t] must already be the prediction for ids[:, t] (shift before calling). Use the
    temperature the samples were drawn with, or the ratio compares different distributions.
    With chunk_rows set, the B*T rows are processed chunk_rows at a time as
    gathered_logit - logsumexp(row), each chunk upcast to float32 on its own, in the forward and
    in the backward pass (a custom autograd function recomputes the softmax per chunk), so at most
    one (chunk_rows, V) float32 block exists at once; exponent arguments are floored at
    ``exp_floor`` (probabilities under 1.65e-38 read as 1.65e-38). Values and gradients match the plain path;
    a chunk_rows that covers all B*T rows is the plain path. ``chunk_rows = AUTO_CHUNK`` takes
    ``auto_chunk_rows`` for this vocabulary and device.
    """
    dtype, chunk_rows = _checked(logits, temperature, chunk_rows, ids)
    ids = ids.long()
    B, T, V = logits.shape
    if chunk_rows is None or chunk_rows >= B * T:
        logp_all = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)  # (B, T, V)
        return logp_all.gather(-1, ids[..., None]).squeeze(-1)  # (B, T)
    if compiled and logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and compile_available():
        return _CompiledLogprob.apply(logits.reshape(B * T, V), ids.reshape(B * T), temperature).view(B, T)
    flat = _ChunkedLogprob.apply(logits.reshape(B * T, V), ids.reshape(B * T), temperature, chunk_rows)
    return flat.view(B, T)


def _checked(logits: torch.Tensor, temperature: float, chunk_rows, ids: torch.Tensor | None = None
             ) -> tuple[torch.dtype, int | None]:
    """(the float dtype the log-softmax runs in, the resolved chunk rows) for (B, T, V) ``logits``
    (and ``ids`` (B, T) where given); ValueError naming what is wrong with an argument."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be 3-D (B, T, V), got shape {tuple(logits.shape)}")
    if ids is not None and tuple(ids.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"ids must have shape (B, T) = {tuple(logits.shape[:2])}, got {tuple(ids.shape)}")
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    chunk_rows = resolve_chunk_rows(chunk_rows, logits)
    _check_chunk_rows(chunk_rows)
    return torch.promote_types(logits.dtype, torch.float32), chunk_rows


def _check_chunk_rows(chunk_rows) -> None:
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive int, {AUTO_CHUNK!r} or None, got {chunk_rows!r}")


class _ChunkedLogprob(torch.autograd.Function):
    """(N, V) logits, (N,) ids -> (N,) log-probs; backward recomputes the softmax chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, ids, temperature, chunk_rows):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        N = logits.shape[0]
        out = torch.empty(N, dtype=dtype, device=logits.device)  # (N,)
        lse = torch.empty(N, dtype=dtype, device=logits.device)  # (N,)
        for s in range(0, N, chunk_rows):
            x = logits[s : s + chunk_rows].to(dtype)  # (n, V) the one float32 block
            x = x.div_(temperature) if logits.dtype != dtype else x / temperature  # in place on a copy only
            lse[s : s + chunk_rows] = _logsumexp_floored(x)
            out[s : s + chunk_rows] = x.gather(1, ids[s : s + chunk_rows, None]).squeeze(1) - lse[s : s + chunk_rows]
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, ids, lse = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        grad = torch.empty_like(logits)  # (N, V) in the logits' dtype
        buf = None  # (n, V) float32, reused by every chunk and worked on in place: one block in cache
        for s in range(0, logits.shape[0], chunk_rows):
            chunk = logits[s : s + chunk_rows]
            if buf is None or buf.shape[0] != chunk.shape[0]:
                buf = torch.empty(chunk.shape, dtype=lse.dtype, device=chunk.device)
            g = grad_out[s : s + chunk_rows, None].to(lse.dtype)  # (n, 1)
            # d(x_id - logsumexp x)/dx = onehot(id) - softmax(x), x = logits / temperature; then the
            # 1/temperature. The same operations as -exp(x - lse) * g + onehot * g, then / temperature,
            # the exponent's arguments floored at exp_floor (probabilities under the smallest normal).
            x = buf.copy_(chunk).div_(temperature)  # (n, V)
            x.sub_(lse[s : s + chunk_rows, None]).clamp_min_(exp_floor(x.dtype)).exp_().mul_(-g)
            x.scatter_add_(1, ids[s : s + chunk_rows, None], g)
            if grad.dtype == x.dtype:
                torch.div(x, temperature, out=grad[s : s + chunk_rows])
            else:
                grad[s : s + chunk_rows] = x.div_(temperature)
        return grad, None, None, None


def _lse_block(logits: Tensor, temperature: float) -> Tensor:
    """(N, V) logits -> (N,) float32 ``_logsumexp_floored(logits.float() / temperature)``, as one
    compiled kernel reads it (no float32 copy of the logits)."""
    return _logsumexp_floored(logits.float() / temperature)


def _logprob_grad_block(logits: Tensor, ids: Tensor, lse: Tensor, g: Tensor, temperature: float,
                        floor: float) -> Tensor:
    """d(sum of g * log-probs at ids)/d logits, (N, V) in the logits' dtype:
    (onehot(ids) - softmax(logits / temperature)) * g / temperature, the exponent's arguments
    floored as ``_ChunkedLogprob``'s; one compiled elementwise pass."""
    x = logits.float() / temperature
    p = (x - lse[:, None]).clamp_min(floor).exp()                         # (N, V)
    onehot = torch.arange(logits.size(1), device=logits.device)[None, :] == ids[:, None]
    return ((onehot.to(p.dtype) - p) * (g[:, None] / temperature)).to(logits.dtype)


class _CompiledLogprob(torch.autograd.Function):
    """``token_logprobs`` with ``compiled`` (model.compile): (N, V) logits, (N,) ids -> (N,) float32
    log-probs, the log-sum-exp and the backward each one compiled pass over the logits (Inductor
    fuses the upcast, the temperature, the exponent and the sums, so no chunk of float32 logits is
    made); the numbers of ``_ChunkedLogprob`` to float rounding."""

    @staticmethod
    def forward(ctx, logits, ids, temperature):
        args = (logits, temperature)
        lse = compiled_call("logsumexp", _lse_block, args, ((0, 0),), lambda: _lse_block(*args))   # (N,)
        out = logits.gather(1, ids[:, None]).squeeze(1).float() / temperature - lse
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, ids, lse = ctx.saved_tensors
        args = (logits, ids, lse, grad_out.float(), ctx.temperature, exp_floor(torch.float32))
        grad = compiled_call("logprob_grad", _logprob_grad_block, args, ((0, 0), (1, 0), (2, 0), (3, 0)),
                             lambda: _logprob_grad_block(*args))
        return grad, None, None


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0, chunk_rows: int | str | None = None) -> Tensor:
    """Per-position entropy H = -Σ_v p_v log p_v of softmax(logits / temperature): (B, T, V) -> (B, T).

    WITH gradient: ∂H/∂z_v = -p_v (log p_v + H), z = logits / temperature. Computed in float32
    (float64 stays float64). Give it the learner's logits at the response positions (the same
    tensor token_logprobs reads), at the sampling temperature; the nucleus (top_p, top_k, min_p) is not applied,
    as in TRL and verl: the entropy of the tempered distribution. With chunk_rows set, B*T rows
    are processed chunk_rows at a time in the forward and the backward (the softmax is recomputed
    per chunk), so at most one (chunk_rows, V) float32 block exists at once; values and gradients
    match the plain path (a chunk_rows covering every row is the plain path; ``AUTO_CHUNK`` as in
    token_logprobs). The cost is one more softmax pass over (B, T, V) per training forward.

    p_v = exp(log p_v) is taken with log p_v floored at ``exp_floor`` (both paths): torch's CPU
    ``exp`` takes a slow path where its result underflows, and a low temperature sends most of a
    vocabulary there, so the floor makes such chunks several times faster and costs nothing
    measurable where no log-prob is below it (docs/benchmarks.md). A probability under 1.65e-38 is read as 1.65e-38: the entropy and its gradient move by
    less than V x 1.65e-38 x (1 + |log p|) (about 1e-30 at V = 49,152), nothing where no log-prob is
    below the floor.
    """
    dtype, chunk_rows = _checked(logits, temperature, chunk_rows)
    B, T, V = logits.shape
    if chunk_rows is None or chunk_rows >= B * T:
        logp_all = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)  # (B, T, V)
        return -(logp_all.clamp_min(exp_floor(dtype)).exp() * logp_all).sum(dim=-1)  # (B, T)
    return _ChunkedEntropy.apply(logits.reshape(B * T, V), temperature, chunk_rows).view(B, T)


class _ChunkedEntropy(torch.autograd.Function):
    """(N, V) logits -> (N,) entropies; backward recomputes the softmax chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_rows):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)  # (N,)
        for s in range(0, logits.shape[0], chunk_rows):
            lp = torch.log_softmax(logits[s : s + chunk_rows].to(dtype) / temperature, dim=-1)  # (n, V)
            out[s : s + chunk_rows] = -(lp.clamp_min(exp_floor(dtype)).exp_() * lp).sum(dim=-1)
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, H = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        grad = torch.empty_like(logits)  # (N, V) in the logits' dtype
        for s in range(0, logits.shape[0], chunk_rows):
            lp = torch.log_softmax(logits[s : s + chunk_rows].to(H.dtype) / temperature, dim=-1)  # (n, V)
            g = grad_out[s : s + chunk_rows, None].to(H.dtype)  # (n, 1)
            # dH/dz_v = -p_v (log p_v + H); then the 1/temperature of z = logits / temperature
            p = lp.clamp_min(exp_floor(H.dtype)).exp_()                                      # (n, V), floored
            grad[s : s + chunk_rows] = -p * (lp + H[s : s + chunk_rows, None]) * g / temperature
        return grad, None, None
