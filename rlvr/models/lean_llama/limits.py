"""The lean forward's thresholds: where it switches between two ways of computing the same numbers.

Each is a speed choice only (both sides give the same logits to float rounding, the tests check
both); the timings behind the values are in docs/performance.md. Tests lower or raise them through
the package (``monkeypatch.setattr(rlvr.models.lean_llama, "SMALL_ATTENTION", 0)``).
"""

SMALL_ATTENTION = 16384
"""On CPU, queries x keys (L * S) up to this use explicit matmul attention, larger ones SDPA: at
RL-sized shapes a few small ops cost less than the CPU SDPA kernels, and SDPA holds no score matrix
(see docs/performance.md)."""

GROUP_ATTENTION_FLOPS = 4.0
"""A cache repeated for G samples per prompt takes the grouped layout (``LeanCache``) when
(prefix + G * new) / (prefix + new) <= this, ``new`` being the columns left to decode: the score
FLOPs of letting a prompt's G rows attend to each other's columns (masked) over those of each row
attending to its own. The grouped layout reads the prompt's keys once per prompt instead of once
per row, in G times larger products, which pays up to about this ratio (see docs/performance.md)."""

LIVE_ROWS = 0.75
"""A CPU decode step without gradient in which at most this fraction of the rows is still decoding
(the others produced eos earlier; their new column is masked) runs the layers' products, norms and
the output head on the live rows only (``_live_rows``): they are compute-bound at a sampling call's
row counts, so their time falls with the rows, while moving the rows in and out costs four small
copies a layer; this bound keeps a margin over the break-even (see docs/performance.md). The
finished rows get zero queries, keys and values (columns nobody attends to but themselves) and zero
logits (the sampler's draw for them is discarded). The products give each row the same bits
whatever the number of rows computed with it (bf16; fp32 from 12 rows up, see ``linear_t``), so a
live row's numbers do not depend on how many others have finished, except in fp32 with 2-11 live
rows, where MKL rounds differently."""

CACHE_GROW = 32
"""A CPU cache's plain-layout buffers (``LeanCache.spare_cols``) are allocated this many columns past
those filled, and grown by as many when full: a no-gradient call attends over their whole width
(``LeanCache.attend_width``), so its products read whole contiguous tensors (oneDNN's batched
bf16 product copies any other operand) at the price of up to this many masked columns a row."""

KEYS_ROW_MAJOR = 512
"""A CPU cache's plain-layout key buffers at most this many columns wide hold each row's keys
row-major, (B, Hkv, cols, D) as the values, and wider ones transposed, (B, Hkv, D, cols)
(``LeanCache.keys_transposed``; a buffer changes layout when it is grown past this width). A decode
step writes one column a row: row-major, each row's new key is one contiguous run; transposed, D
separate elements a row and head, each in a cache line of its own. The transposed buffer is the
scores' product's plain (D, S) operand, where the row-major one is read through a transposed view,
which costs more as S grows; the bound sits below where the two break even at SmolLM2's shapes
(see docs/performance.md)."""

GROUP_SCORES = 1 << 22
"""Grouped attention computes its score matrix (P * Hkv, G * L * rep, S) in query chunks of at most
about this many elements (a decode step is one chunk; a many-token call is split)."""

HEAD_CHUNK = 1024
"""Without gradient and with at most ``HEAD_ROWS`` rows (a decode step), the output head is
computed in blocks of this many vocabulary rows written into one output, so that each block's
weights and outputs stay in cache (see docs/performance.md). On CPU a block is computed
weight-major (``W_block @ x.T``, as ``linear_t``) and transposed into place from cache; the
log-probs equal the one-product head's to float rounding."""

HEAD_ROWS = 256
"""The most rows a no-gradient call computes the head in blocks and its projections weight-major for
(``output_head``, ``_weight_major``): decode steps and small prefills."""

PACK_ROWS = 64
"""The row count oneDNN lays a prepacked bf16 weight out for (``_Bf16Weights.packed``): one pack
serves every row count up to ``HEAD_ROWS``. The layout oneDNN picks changes how some products
round, and packs made for this many rows gave ``F.linear``'s bits where packs made for fewer did
not (see docs/performance.md), so ``_packed_linear_ok`` probes a pack made for this many."""
