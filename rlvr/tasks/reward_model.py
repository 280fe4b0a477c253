"""A learned reward model as a reward: RLHF's real-valued score (a smoother signal than a checker; docs/background.md, section 9).

:class:`RewardModelReward` loads ``AutoModelForSequenceClassification`` and its tokenizer from a
**local** directory (``local_files_only=True``: nothing is downloaded) and scores
``prompt + response`` as the single logit of a ``num_labels=1`` head. It is a plain
``fn(prompt, response, answer) -> float`` (the answer is ignored) with a batched
:meth:`~RewardModelReward.score_batch`, and carries its :class:`~rlvr.rewards.RewardCard`.

::

    rm = RewardModelReward("models/my-rm", batch_size=16, max_length=512)
    rm("2+2=", "4", None)                   # -> a float
    task = add_reward_model(task, rm)       # the task gains a reward named "rm"

    # or from a config, over a JSONL of prompts (rlvr.tasks.dataset):
    [task]
    path = "rlvr.tasks.reward_model:rm_task"
    reward = "rm"
    options = { model = "models/my-rm", train = "data/prompts.jsonl" }

Weights are loaded from safetensors only; a directory with only a pickled ``pytorch_model.bin`` is
refused with the conversion command (a pickle can run code when loaded).

Text scored: ``template.format(prompt=..., response=...)`` (default: the two concatenated),
truncated from the **left** to ``max_length`` tokens so the end of the response is always seen.
Padding is on the right and the model's ``pad_token_id`` is set from the tokenizer (the
classification head reads the last non-pad token). The model runs in eval mode under
``torch.no_grad``, so the same text always gets the same score; the trainer calls rewards one
response at a time today, so only direct users of ``score_batch`` get batching.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

from rlvr.rewards import Reward, RewardCard
from rlvr.tasks import Task, TaskError

__all__ = ["RewardModelReward", "add_reward_model", "rm_task"]


class RewardModelReward:
    """A sequence-classification reward model (one logit) as a reward function."""

    def __init__(self, path: str | os.PathLike, *, batch_size: int = 8, max_length: int = 512,
                 device: str = "cpu", template: str = "{prompt}{response}", name: str = "rm"):
        if not os.path.isdir(path):
            raise TaskError(f"reward model {str(path)!r}: not a local directory (nothing is downloaded)")
        _check_weights(Path(path))
        if batch_size < 1 or max_length < 1:
            raise TaskError(f"reward model: batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
        try:
            import torch  # noqa: F401
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as e:
            raise TaskError(f"reward model needs transformers and torch: {e}") from e
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            self.model = AutoModelForSequenceClassification.from_pretrained(str(path), local_files_only=True,
                                                                            use_safetensors=True)
        except Exception as e:
            raise TaskError(f"reward model {str(path)!r} failed to load: {type(e).__name__}: {e}") from e
        if self.model.config.num_labels != 1:
            raise TaskError(f"reward model {str(path)!r} has num_labels={self.model.config.num_labels}; "
                            "a reward model has one output (num_labels=1)")
        tok = self.tokenizer
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise TaskError(f"reward model {str(path)!r}: the tokenizer has neither a pad nor an eos token")
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        tok.truncation_side = "left"
        self.model.config.pad_token_id = tok.pad_token_id
        self.model.to(device).eval()
        self.path, self.batch_size, self.max_length = str(path), batch_size, max_length
        self.device, self.template, self.name = device, template, name
        self.__name__ = name

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """One float per (prompt, response), in ``batch_size`` chunks."""
        import torch

        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts and {len(responses)} responses")
        texts = [self.template.format(prompt=p, response=r) for p, r in zip(prompts, responses)]
        out: list[float] = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                     truncation=True, max_length=self.max_length)
                enc = {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
                logits = self.model(**enc).logits.float()
                out.extend(logits[:, 0].tolist())
        return out

    def __call__(self, prompt: str, response: str, answer: Any = None) -> float:
        return self.score_batch([prompt], [response])[0]

    @property
    def card(self) -> RewardCard:
        return RewardCard(
            pays_for=f"whatever the reward model at {self.path!r} learned to prefer (its preference data), "
                     f"read as one real-valued logit of the last {self.max_length} tokens of prompt+response",
            ignores="correctness: the answer column is never looked at, and the model only knows what its "
                    "training pairs showed it; text beyond max_length on the left is cut off",
            exploit="reward-model over-optimisation: the policy drifts to what raises the logit without being "
                    "better (longer responses, confident or flattering style, repeated phrases the RM "
                    "liked, degenerate text off the RM's training distribution); the score keeps rising "
                    "while the held-out goal flattens or falls. Watch a KL term and response length",
            exploit_example=None,
        )

    def reward(self) -> Reward:
        """This model as a :class:`~rlvr.rewards.Reward` named ``self.name``."""
        return Reward(self.name, self, self.card,
                      batch_fn=lambda prompts, responses, answers: self.score_batch(prompts, responses))


def _check_weights(path: Path) -> None:
    """safetensors only: a pickled ``.bin`` checkpoint can run code when loaded, so it is refused with the
    one-off conversion (as the policy loader, rlvr.models.hf, does)."""
    if any(path.glob("*.safetensors")):
        return
    if any(path.glob("*.bin")):
        raise TaskError(f"reward model {str(path)!r}: only pytorch_model*.bin (pickle) weights; rlvr loads "
                        "safetensors only. Convert once: AutoModelForSequenceClassification.from_pretrained(dir)"
                        ".save_pretrained(dir) writes model.safetensors")
    raise TaskError(f"reward model {str(path)!r}: no weights (expected model.safetensors or "
                    "model-*.safetensors shards)")


def add_reward_model(task: Task, rm: RewardModelReward | str, **kwargs: Any) -> Task:
    """A copy of ``task`` with the reward model added under ``rm.name`` (a path is loaded with kwargs)."""
    if not isinstance(rm, RewardModelReward):
        rm = RewardModelReward(rm, **kwargs)
    if rm.name in task.rewards:
        raise TaskError(f"task {task.name!r} already has a reward named {rm.name!r}; pass name=...")
    return dataclasses.replace(task, rewards={**task.rewards, rm.name: rm.reward()})


def rm_task(model: str, train: str, heldout: str | None = None, *, batch_size: int = 8,
            max_length: int = 512, template: str = "{prompt}{response}", **dataset_options: Any) -> Task:
    """:func:`rlvr.tasks.dataset.jsonl_task` over ``train`` with the reward model as reward ``rm``.

    The dataset's own rewards (default ``exact_match``) and goal stay: the goal is still checked
    against the answer column, so a run shows the gap between the RM's score and correctness.
    """
    from rlvr.tasks.dataset import jsonl_task

    task = jsonl_task(train, heldout, **dataset_options)
    return add_reward_model(task, RewardModelReward(model, batch_size=batch_size, max_length=max_length,
                                                    template=template))


TASK = rm_task
