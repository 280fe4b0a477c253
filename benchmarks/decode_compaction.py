"""Sampling with finished rows dropped from the batch against computing every row to the end.

    python benchmarks/decode_compaction.py [--rounds 3] [--prompts 8] [--group 8] [--max-new 256] [--mean-len 96]
                                           [--threads N]

The built-in model (4 layers, width 256, 512 tokens; random weights) with its end token's logit
raised so that a response ends with probability about 1 / ``--mean-len`` at each token: response
lengths are geometric, from a few tokens to ``--max-new``, and vary widely inside each group, as
chain-of-thought responses do. One sampling call (``--prompts`` x ``--group`` rows, per-prompt
seeds, temperature 1) is timed with ``rlvr.sampling.COMPACT_FINISHED`` = None (every row computed
until the last one ends) and at its default (rows leave the batch by ``WASTE_PER_COPY``'s rule; the
built-in model's cache fills holes, so they leave as they finish), alternated in one process, the
same seed each time (the same rows: checked). The built-in model has its own ``KVCache``: the lean
forward's ``LeanCache`` (grouped layout, ``cache_rows.ungroup``) is not exercised here; its drops
are tested in tests/test_sampling_compaction.py.

Prints each round, the medians and their ratio (every row / rows dropped), the mean and longest
response, the share of the decode forwards' rows spent on finished rows each way, and the bound
on the ratio if time were proportional to the rows computed (rows computed every row / dropped).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from rlvr import sampling
from rlvr.models.tiny import TinyConfig, TinyTransformer

EOS, PAD, BOS = 2, 0, 1


class EndBiased(torch.nn.Module):
    """A policy whose end token's logit is raised by ``bias`` (everything else delegated)."""

    differentiable_cache = False

    def __init__(self, model: TinyTransformer, bias: float):
        super().__init__()
        self.model, self.bias, self.config = model, bias, model.config

    def forward(self, ids, **kw):
        logits = self.model(ids, **kw)                                        # (B, L, V)
        logits[..., EOS] += self.bias
        return logits

    def new_cache(self, batch_size: int, max_len: int):
        return self.model.new_cache(batch_size, max_len)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--mean-len", type=float, default=96.0, help="1 / the end token's probability per token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    V = 512
    torch.manual_seed(a.seed)
    tiny = TinyTransformer(TinyConfig(vocab_size=V, n_layer=4, n_head=4, n_embd=256, block_size=a.max_new + 64)).eval()
    # the random model's logits are near-uniform: p(end) = e^b / (e^b + V - 1) = 1 / mean_len
    model = EndBiased(tiny, math.log((V - 1) / (a.mean_len - 1)))
    g = torch.Generator().manual_seed(a.seed)
    prompts = [[BOS] + torch.randint(3, V, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 48, (a.prompts,), generator=g)]
    default = sampling.COMPACT_FINISHED

    def sample(compact):
        sampling.COMPACT_FINISHED = compact
        t0 = time.perf_counter()
        r = sampling.generate(model, prompts, samples_per_prompt=a.group, max_new_tokens=a.max_new, eos_id=EOS,
                              pad_id=PAD, generators=sampling.prompt_generators(a.seed, 0, a.prompts))
        return time.perf_counter() - t0, r

    sample(default)                                                           # warm-up
    times: dict[str, list[float]] = {"every row": [], "rows dropped": []}
    for i in range(a.rounds):
        t_all, every = sample(None)
        t_drop, dropped = sample(default)
        times["every row"].append(t_all)
        times["rows dropped"].append(t_drop)
        assert torch.equal(every.ids, dropped.ids), "the rows differ"
        print(f"round {i}: every row {t_all:.2f} s, rows dropped {t_drop:.2f} s")
    sampling.COMPACT_FINISHED = default
    med = {k: statistics.median(v) for k, v in times.items()}
    lengths = every.response_lengths.float()
    print(f"rows {every.ids.size(0)}, mean response {lengths.mean():.0f} tokens, longest {int(lengths.max())}, "
          f"shortest {int(lengths.min())}")
    print(f"finished rows' share of the decode rows: every row {every.finished_row_frac:.2f}, "
          f"rows dropped {dropped.finished_row_frac:.2f}")
    print(f"median: every row {med['every row']:.2f} s, rows dropped {med['rows dropped']:.2f} s; "
          f"ratio {med['every row'] / med['rows dropped']:.2f}x "
          f"(rows computed: {every.decode_rows / dropped.decode_rows:.2f}x)")
    print("command: python benchmarks/decode_compaction.py " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
