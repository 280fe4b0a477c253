"""rlvr's lean forward against transformers' forward on real model shapes (random weights, CPU).

    python benchmarks/lean_forward.py [--arch qwen2.5-0.5b|llama3.2-1b|smollm2-135m|gemma3-270m] [--rounds 3] [--numerics bf16|fp32]

Builds the architecture's config with random weights (no download; Qwen 2's zero-initialised
q/k/v biases are drawn non-zero so that they count), wraps it in a LoRA adapter (r = 16, peft's
default targets), and times, alternated in one process, with ``policy.fast_path`` True (the lean
forward) and False (transformers' forward):

- one sampling call: 8 prompts of 47 tokens x 8 samples, 16 new tokens, temperature 0.7, no eos;
- one training forward and backward of those 64 rows (the shared-prompt log-prob forward, its token
  log-probs in chunks as the learn stage computes them by default: ``model.logprob_chunk_rows``).

Prints each round and the medians, and the ratios transformers / lean. ``--numerics bf16`` runs both
under rlvr's CPU bf16 autocast context (as a run with model.autocast = bf16 does).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

ARCHS = {
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                   rope_theta=1e6, tie_word_embeddings=True)),
    "llama3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                  tie_word_embeddings=True, rope_parameters={
                                      "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                      "rope_theta": 500000.0})),
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                   rope_theta=1e5, tie_word_embeddings=True)),
    # Gemma 3 270M: 5 sliding-window layers (512, base 10,000) to each full one (base 1e6); responses here
    # stay inside the window, where the lean forward runs
    "gemma3-270m": ("gemma3_text", dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                        max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
                                        tie_word_embeddings=True)),
}
P, G, PROMPT, NEW, TEMPERATURE = 8, 8, 47, 16, 0.7


def build(d: Path, arch: str) -> None:
    """The architecture's random model and a small character tokenizer, saved to ``d``."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    kind, kw = ARCHS[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, bos_token_id=1, eos_token_id=2,
                                                                  pad_token_id=0, **kw))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.1)
    model.save_pretrained(d)
    specials = ["<pad>", "<bos>", "<eos>"]
    bk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + list("0123456789+= "))}, merges=[]))
    bk.add_special_tokens(specials)
    bk.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=bk, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen2.5-0.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--numerics", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from rlvr import logprobs, sampling, scoring
    from rlvr.config import ModelConfig
    from rlvr.hostmem import set_host_memory
    from rlvr.models.hf import LoraSpec, load_policy
    from rlvr.numerics import autocast_context

    set_host_memory("keep")
    with tempfile.TemporaryDirectory() as d:
        build(Path(d), a.arch)
        policy, _ = load_policy(d, lora=LoraSpec(r=16, alpha=32))
    n = sum(p.numel() for p in policy.parameters())
    print(f"{a.arch}: {n / 1e6:.0f}M parameters (random), LoRA r=16, {a.numerics}, {a.threads} threads; "
          f"lean forward: {policy.fast_unsupported or 'supported'}")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 16, (PROMPT,), generator=g).tolist() for _ in range(P)]
    bf16 = a.numerics == "bf16"

    def sample():
        with torch.no_grad(), autocast_context(bf16, "cpu"):
            return sampling.generate(policy, prompts, samples_per_prompt=G, max_new_tokens=NEW, temperature=TEMPERATURE,
                                     eos_id=None, pad_id=0, generators=sampling.prompt_generators(0, 0, P))

    def train(roll) -> None:
        with autocast_context(bf16, "cpu"):   # the learn stage's scorer: token log-probs in chunks, as by default
            lp = scoring.sequence_token_logprobs(policy, roll, temperature=TEMPERATURE, group_size=G,
                                                  chunk_rows=logprobs.chunk_setting(ModelConfig.logprob_chunk_rows))
        (lp * roll.mask).sum().backward()
        policy.zero_grad(set_to_none=True)

    times: dict[tuple[str, str], list[float]] = {(p, k): [] for p in ("lean", "transformers")
                                                 for k in ("sample", "train")}
    train(sample())                                                     # warm-up (both paths share it)
    for r in range(a.rounds):
        for path, fast in (("lean", True), ("transformers", False)):
            policy.fast_path = fast
            t = time.perf_counter()
            roll = sample()
            times[(path, "sample")].append(time.perf_counter() - t)
            t = time.perf_counter()
            train(roll)
            times[(path, "train")].append(time.perf_counter() - t)
        print(f"round {r + 1}: " + "  ".join(f"{p} {k} {v[-1]:.2f} s" for (p, k), v in times.items()), flush=True)
    med = {key: statistics.median(v) for key, v in times.items()}
    for k in ("sample", "train"):
        print(f"{k:6s}: lean {med[('lean', k)]:.2f} s, transformers {med[('transformers', k)]:.2f} s, "
              f"ratio {med[('transformers', k)] / med[('lean', k)]:.2f}x (medians of {a.rounds})")


if __name__ == "__main__":
    main()
