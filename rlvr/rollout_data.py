"""The ``Rollout``: what a sampling call returns (G responses per prompt, left-padded prompts first,
the sampled tokens' log-probs and masks), and ``concat`` for dynamic sampling's refill rounds
(rlvr.sampling samples them and recomputes their log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Rollout:
    """G responses per prompt, left-padded prompts first. B = P * G rows, T generated columns.

    ``T`` is the number of decoding steps actually run: ``max_new_tokens``, or fewer when every
    row produced eos early.
    """

    ids: torch.Tensor
    """(B, Lp + T) long: left-padded prompt, then generated tokens; pad after each row's eos."""
    attention_mask: torch.Tensor
    """(B, Lp + T) long: 1 on real prompt tokens and on generated tokens up to and including eos."""
    prompt_len: int
    """Lp, the padded prompt width; response column t is ``ids[:, Lp + t]``."""
    mask: torch.Tensor
    """(B, T) float32: 1 on generated tokens up to and including the first eos, else 0."""
    logp: torch.Tensor
    """(B, T) float32: log-prob of each token under the distribution sampled from; 0 where mask is 0."""
    truncated: torch.Tensor
    """(B,) bool: the row hit ``max_new_tokens`` without eos (always False when eos_id is None)."""
    temperature: float = 1.0
    """Temperature used to sample (0 = greedy); ``sequence_token_logprobs`` defaults to it."""
    top_p: float = 1.0
    """Nucleus mass used to sample; ``sequence_token_logprobs`` defaults to it."""
    logp_full: torch.Tensor | None = None
    """(B, T) float32: log-prob of each token under the tempered distribution WITHOUT the nucleus
    (what the KL to the reference compares); None without truncation, where it is ``logp``."""
    top_k: int = 0
    """Top-k used to sample (0 = off); ``sequence_token_logprobs`` defaults to it."""
    min_p: float = 0.0
    """Min-p used to sample (0 = off); ``sequence_token_logprobs`` defaults to it."""
    decode_rows: int = 0
    """Rows the decode steps' forwards computed, summed over the steps (0 where not recorded: ``select``)."""
    decode_finished_rows: int = 0
    """Of ``decode_rows``, the rows that had already ended: computed for nothing (``COMPACT_FINISHED``)."""

    @property
    def finished_row_frac(self) -> float:
        """The share of the decode forwards' rows spent on rows that had already ended (0 when none ran)."""
        return self.decode_finished_rows / self.decode_rows if self.decode_rows else 0.0

    @property
    def tempered_logp(self) -> torch.Tensor:
        """(B, T) the sampled tokens' log-probs under the tempered distribution without the nucleus."""
        return self.logp if self.logp_full is None else self.logp_full

    def select(self, idx: torch.Tensor | slice) -> "Rollout":
        """The rows ``idx`` (index tensor, bool mask or slice) as a new ``Rollout`` (minibatches).

        Columns are kept, so ``prompt_len`` is unchanged and a subset may carry all-pad columns.
        """
        return Rollout(ids=self.ids[idx], attention_mask=self.attention_mask[idx], prompt_len=self.prompt_len,
                       mask=self.mask[idx], logp=self.logp[idx], truncated=self.truncated[idx],
                       temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                       logp_full=None if self.logp_full is None else self.logp_full[idx])

    @property
    def response_ids(self) -> torch.Tensor:
        """(B, T) view of the generated tokens."""
        return self.ids[:, self.prompt_len:]

    @property
    def prompt_ids(self) -> torch.Tensor:
        """(B, Lp) view of the left-padded prompts."""
        return self.ids[:, :self.prompt_len]

    @property
    def response_lengths(self) -> torch.Tensor:
        """(B,) long: generated tokens per row, eos included."""
        return self.mask.sum(1).long()


def concat(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """Stack rollouts row-wise (dynamic sampling's refill rounds), in order, groups intact.

    Prompts are left-padded to the widest ``prompt_len`` and responses right-padded to the longest
    T; the added columns carry ``pad_id``, attention 0, mask 0 and logp 0, so every per-token
    figure and the recomputed log-probs are unchanged (positions come from the attention mask).
    """
    if not rollouts:
        raise ValueError("concat: no rollouts given")
    if len({(r.temperature, r.top_p, r.top_k, r.min_p) for r in rollouts}) != 1:
        raise ValueError("concat: rollouts were sampled from different distributions (temperature / top_p / "
                         "top_k / min_p)")
    Lp = max(r.prompt_len for r in rollouts)
    T = max(r.mask.shape[1] for r in rollouts)
    full = any(r.logp_full is not None for r in rollouts)
    parts: dict[str, list[torch.Tensor]] = {"ids": [], "attention_mask": [], "mask": [], "logp": [], "logp_full": []}
    for r in rollouts:
        left, right = Lp - r.prompt_len, T - r.mask.shape[1]
        parts["ids"].append(F.pad(r.ids, (left, right), value=pad_id))
        parts["attention_mask"].append(F.pad(r.attention_mask, (left, right), value=0))
        parts["mask"].append(F.pad(r.mask, (0, right), value=0.0))
        parts["logp"].append(F.pad(r.logp, (0, right), value=0.0))
        parts["logp_full"].append(F.pad(r.tempered_logp, (0, right), value=0.0))
    if not full:
        del parts["logp_full"]
    return Rollout(**{k: torch.cat(v) for k, v in parts.items()}, prompt_len=Lp,
                   truncated=torch.cat([r.truncated for r in rollouts]),
                   temperature=rollouts[0].temperature, top_p=rollouts[0].top_p, top_k=rollouts[0].top_k,
                   min_p=rollouts[0].min_p, decode_rows=sum(r.decode_rows for r in rollouts),
                   decode_finished_rows=sum(r.decode_finished_rows for r in rollouts))
