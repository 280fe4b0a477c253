"""What the loop may call on a model and a tokenizer: two typing Protocols.

Both model families meet them: the built-in ``rlvr.models.tiny.TinyTransformer`` with
``rlvr.tokenizer.CharTokenizer``, and Hugging Face causal LMs wrapped by ``rlvr.models.hf``
(``HFPolicy`` with ``HFTokenizer``). The loop, evaluation and probe use only these members, so
nothing asks a model what it is (no ``getattr`` / ``hasattr`` / ``isinstance`` probing).
A new backend (another model family, or an inference engine inside a rollout worker) is one
class that meets the same surface.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import torch


class ModelConfig(Protocol):
    block_size: int | None
    """Longest sequence (prompt + response) the model can attend over; None = unbounded."""


@runtime_checkable
class Policy(Protocol):
    """A causal LM the trainer samples from, scores and updates."""

    config: ModelConfig
    differentiable_cache: bool
    """True when ``new_cache`` keeps gradients, so a group's G responses can share one prompt forward."""

    @property
    def has_adapter(self) -> bool:
        """True under LoRA: the reference policy is this model with its adapter disabled (no copy)."""

    def __call__(self, ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None, cache: Any = None,
                 logits_to_keep: int = 0) -> torch.Tensor:
        """(B, L) ids -> (B, L', V) logits (L' = logits_to_keep when > 0)."""

    def new_cache(self, batch_size: int, max_len: int) -> Any:
        """An empty KV cache with ``repeat_interleave(G)``."""

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> Any: ...
    training: bool
    """nn.Module's mode flag: True after ``train()``, False after ``eval()``."""

    def train(self, mode: bool = True) -> Any: ...
    def eval(self) -> Any: ...

    def trainable_params(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (LoRA: the adapter only)."""

    def num_params(self) -> int:
        """Distinct parameters (a tied head counts once)."""

    def flops_per_token(self, seq_len: int | None = None, *, training: bool = True) -> int:
        """FLOPs per token of a forward (or forward + backward) at context ``seq_len``."""

    def adapter_disabled(self) -> AbstractContextManager:
        """Run the reference (adapter off) inside the block; only valid when ``has_adapter``."""


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> ids for one policy. rlvr.build.build also sets ``prompt_format`` on the run's tokenizer
    (rlvr.tokenizer.PromptFormat: whether task prompts go through the chat template)."""

    pad_id: int
    eos_id: int | None
    bos_id: int | None

    @property
    def vocab_size(self) -> int: ...

    @property
    def has_chat_template(self) -> bool:
        """True when prompts given as chat messages go through a template."""

    def encode(self, text: str, *, eos: bool = False) -> list[int]: ...

    def encode_prompt(self, prompt: str | Sequence[dict]) -> list[int]:
        """Prompt ids: a string as text, a list of {"role", "content"} messages through the chat template."""

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool) -> str:
        """Text of ``ids`` with specials dropped; with ``stop_at_eos`` nothing after the first eos."""

    def save(self, path: str | Path) -> None: ...
