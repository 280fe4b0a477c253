"""The memory model of a run: the peak resident set it reaches, predicted from the model's shape and
the run's sizes before it starts (the price's memory line, rlvr.costs.price).

Memory (`memory(...)`, the peak resident set a run reaches, in bytes; `b` = bytes of an activation,
4 in fp32 and 2 in bf16; logits are always float32):

    held all run    = baseline (the process before the run: torch, transformers, tokenizer, task;
                      measured, not derived) + policy + reference copy (kl_coef > 0 without LoRA)
                      + AdamW moments (2 x 4 bytes x trainable) + gradients (4 bytes x trainable:
                      set to None only at the next step, so they live through sampling too)
    plus the largest of four phases:
    training        = activations + logits
      activations   = trained tokens of one minibatch (of one of its train.micro_batches parts)
                      x layers x b x (6d + 4f + 2 Hkv D + H S)
                      per layer and token: the attention block's RMSNorm input and output (2d), q
                      after RoPE (d), k and v (2 Hkv D), the softmax probabilities over S = Lp + T
                      keys (H S; the score matrix is materialised as a full rectangle), the attention
                      output (d); the MLP block's RMSNorm input and output (2d), gate and up outputs
                      (2f), SiLU(gate) and SiLU(gate) * up (2f); tokens = rows x (Lp + T), or
                      P x Lp + rows x T with the prompt shared by its group; with gradient
                      checkpointing tokens x b x (layers x (2d + 2 Hkv D) + that sum): each layer's
                      input, q, k and v, and one layer recomputed at a time
      logits        = 4 x rows x T x V x 4 bytes (lm_head output, its copy joined with the prompt's
                      last position, the tempered copy, the saved log-softmax), or with
                      `model.logprob_chunk_rows` = c < rows x T: 2 x rows x T x V x b_logit + 3 x c x V x 4
                      (b_logit = 2 under bf16 forwards: the head's output and its gradient stay bf16)
    sampling        = KV cache P G x (Lp + T) x layers x 2 x Hkv x D x b, one layer's cache more
                      (the cache grows by concatenation) and the decode step's 4 x P G x V x 4 bytes
                      of logits, tempered logits, log-probs and probabilities; an upper bound where
                      the cache takes the grouped layout (rlvr.models.lean_llama: P x (Lp + G T)
                      columns, the prompt's once per prompt); with c tool calls the caches hold
                      2 c T columns more (each continuation appends at most T inserted and T
                      sampled tokens to the first round's cache, rlvr.tools)
    evaluation      = the same for the evaluation's rows (greedy: one row per held-out prompt of a
                      decode batch; pass@k: k rows per prompt)
    export          = one more policy copy when LoRA is merged into a copy for `hf/`
    and under bf16 autocast on the CPU bf16 copies of the weights, 2 bytes a parameter
    (rlvr.models.lean_llama.bf16_weights: made once instead of at every product): the frozen weights'
    (a LoRA policy's base, a reference model) kept for the whole run, with a prepacked copy of each
    more where decode reads them packed (counted as kept: the q/k/v and gate/up packs that hold a
    LoRA policy's A factors too are made in each sampling phase instead, the same bytes then and
    fewer between), and the trainable ones' in each forward phase (training, sampling, evaluation),
    freed at its end
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a run depends on: a decoder-only transformer's dimensions."""

    layers: int
    hidden: int            # d
    mlp: int               # f, the MLP's inner width
    heads: int             # H
    kv_heads: int          # Hkv (grouped-query attention: fewer key/value heads)
    head_dim: int          # D
    vocab: int             # V
    checkpointed: bool = False
    """The decoder layers are recomputed in the backward (model.gradient_checkpointing): the backward
    keeps each layer's input and q, k, v, and one layer's activations at a time."""


@dataclass
class Memory:
    """Predicted resident bytes of a run (see the module docstring for each formula)."""

    baseline: int
    policy: int
    reference: int
    optimizer: int
    gradients: int
    activations: int
    logits: int
    kv_cache: int
    eval_kv_cache: int
    export_copy: int
    weight_copies: int = 0
    """bf16 copies of the trainable weights held through each forward phase (CPU bf16 autocast; 0 otherwise)."""
    kept_copies: int = 0
    """bf16 copies (and packs) of the frozen weights, kept for the whole run (CPU bf16 autocast; 0 otherwise)."""

    @property
    def held(self) -> int:
        return self.baseline + self.policy + self.reference + self.optimizer + self.gradients + self.kept_copies

    @property
    def phases(self) -> dict[str, int]:
        w = self.weight_copies
        return {"training": self.activations + self.logits + w, "sampling": self.kv_cache + w,
                "evaluation": self.eval_kv_cache + w, "export": self.export_copy}

    @property
    def peak(self) -> int:
        return self.held + max(self.phases.values())


def kv_cache_bytes(shape: ModelShape, rows: int, prompt_len: int, response_len: int, act_bytes: int) -> int:
    """Sampling's working set: the KV cache of `rows` rows of Lp + T columns, one layer's cache more
    (it grows by concatenation: old and new exist together), and the decode step's four (rows, V)
    float32 blocks (logits, tempered logits, log-probs, probabilities)."""
    per_layer = rows * (prompt_len + response_len) * 2 * shape.kv_heads * shape.head_dim * act_bytes
    return per_layer * (shape.layers + 1) + 4 * rows * shape.vocab * 4


def activation_bytes(shape: ModelShape, tokens: int, keys: int, act_bytes: int) -> int:
    """Tensors the backward needs, over `tokens` trained tokens attending `keys` keys:
    tokens x layers x b x (6d + 4f + 2 Hkv D + H keys); checkpointed (`shape.checkpointed`), each
    layer's input, q, k and v (tokens x layers x b x (2d + 2 Hkv D)) and one layer's activations."""
    s = shape
    per_token_layer = 6 * s.hidden + 4 * s.mlp + 2 * s.kv_heads * s.head_dim + s.heads * keys
    if s.checkpointed:
        return tokens * act_bytes * (s.layers * (2 * s.hidden + 2 * s.kv_heads * s.head_dim) + per_token_layer)
    return tokens * s.layers * act_bytes * per_token_layer


def logits_bytes(shape: ModelShape, rows: int, response_len: int, chunk_rows: int = 0, logit_bytes: int = 4) -> int:
    """The (rows, T, V) blocks of the log-prob forward and backward: 4 float32 ones unchunked; with
    `chunk_rows` = c < rows x T, 2 full blocks of `logit_bytes` a logit (the head's output and its
    gradient, in the forward's dtype: 2 under bf16, whose logits are upcast a chunk at a time) and 3
    float32 (c, V) ones (a c covering every row is the plain path)."""
    full = rows * response_len * shape.vocab
    if 0 < chunk_rows < rows * response_len:
        return 2 * full * logit_bytes + 3 * chunk_rows * shape.vocab * 4
    return 4 * full * 4


def memory(shape: ModelShape, *, prompts: int, group: int, prompt_len: int, response_len: int, minibatches: int,
           n_params: int, trainable_params: int, has_reference_copy: bool, baseline: int = 0,
           bytes_per_param: int = 4, shared_prompt: bool = False, logprob_chunk_rows: int = 0, logit_bytes: int = 4,
           eval_rows: int = 0, export_copy: bool = False, weight_copy_bytes: int = 0, cache_reserve: int = 0,
           kept_copy_bytes: int = 0) -> Memory:
    """Predicted peak bytes of a run of P = `prompts` x G = `group` rows (module docstring), trained in
    `minibatches` forward/backward parts a batch (train.minibatches x train.micro_batches);
    `weight_copy_bytes`: the bf16 weight copies each forward phase holds (CPU bf16 autocast), and
    `kept_copy_bytes` those held for the whole run;
    `cache_reserve`: columns the sampling caches hold beyond Lp + T (tool continuations, rlvr.tools)."""
    P, G, Lp, T, b = prompts, group, prompt_len, response_len, bytes_per_param
    rows = P * G // minibatches                                          # rows of one minibatch
    tokens = (max(1, P // minibatches) * Lp + rows * T) if shared_prompt else rows * (Lp + T)
    policy = n_params * bytes_per_param
    return Memory(
        baseline=baseline, policy=policy, reference=policy if has_reference_copy else 0,
        optimizer=2 * 4 * trainable_params, gradients=4 * trainable_params,
        activations=activation_bytes(shape, tokens, Lp + T, b),
        logits=logits_bytes(shape, rows, T, logprob_chunk_rows, logit_bytes),
        kv_cache=kv_cache_bytes(shape, P * G, Lp, T + cache_reserve, b),
        eval_kv_cache=kv_cache_bytes(shape, eval_rows, Lp, T + cache_reserve, b) if eval_rows else 0,
        export_copy=policy if export_copy else 0, weight_copies=weight_copy_bytes, kept_copies=kept_copy_bytes,
    )
