"""rlvr.sampling.generate through HFPolicy vs transformers' own generate (tiny Llama, CPU).

    python benchmarks/hf_generate.py [--reps 20] [--attn sdpa|eager]

Tiny Llama (2 layers, hidden 128, 4 heads, vocab 64) built locally from random init; 8 prompts of
4-10 tokens x 8 samples, 7 new tokens, temperature 1, no eos (both paths run all 7 steps).
Prints the median wall time per generate call of each path and the largest |logp - recomputed
logp| of the rlvr path. transformers' path returns raw logits only (``output_logits=True``); its
samples' logp would still have to be recomputed (its top-p/top-k warpers differ from rlvr's nucleus).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def build(d: str, attn: str):
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    chars = list("0123456789abcdefghijklmnopqrstuvwxyz ,:")
    bk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[]))
    bk.add_special_tokens(specials)
    bk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=bk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    from rlvr.models.hf import load_policy
    return load_policy(d, attn_implementation=attn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from rlvr import sampling, scoring

    with tempfile.TemporaryDirectory() as d:
        pol, tok = build(d, a.attn)
    g = torch.Generator().manual_seed(0)
    lens = [4, 5, 6, 7, 8, 9, 10, 6]
    prompts = [torch.randint(3, 42, (n,), generator=g).tolist() for n in lens]
    P, G, T = len(prompts), 8, 7

    def ours():
        return sampling.generate(pol, prompts, samples_per_prompt=G, max_new_tokens=T, temperature=1.0,
                                 top_p=1.0, eos_id=None, pad_id=tok.pad_id, generator=g)

    Lp = max(lens)
    ids = torch.tensor([[tok.pad_id] * (Lp - len(p)) + p for p in prompts])
    am = torch.tensor([[0] * (Lp - len(p)) + [1] * len(p) for p in prompts])

    def theirs():
        return pol.model.generate(input_ids=ids, attention_mask=am, do_sample=True, num_return_sequences=G,
                                  max_new_tokens=T, min_new_tokens=T, temperature=1.0, top_k=0, top_p=1.0,
                                  pad_token_id=tok.pad_id, eos_token_id=None, output_logits=True,
                                  return_dict_in_generate=True)

    r = ours()
    with torch.no_grad():
        diff = (scoring.sequence_token_logprobs(pol, r) - r.logp).abs().max().item()
    # interleaved, so load from other processes on shared cores hits both paths alike
    times: dict = {ours: [], theirs: []}
    with torch.no_grad():
        for i in range(a.reps + 3):
            for fn in (ours, theirs):
                t0 = time.perf_counter()
                fn()
                if i >= 3:
                    times[fn].append(time.perf_counter() - t0)
    t_ours, t_hf = (statistics.median(times[f]) * 1e3 for f in (ours, theirs))
    print(f"attn={a.attn} threads={a.threads} P={P} G={G} T={T}")
    print(f"rlvr.sampling.generate via HFPolicy : {t_ours:7.1f} ms / call   (max |logp - recomputed| = {diff:.2e})")
    print(f"transformers generate (+raw logits) : {t_hf:7.1f} ms / call")


if __name__ == "__main__":
    main()
