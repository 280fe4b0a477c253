"""Learned baseline: a small critic V(S) over the prompt tokens, trained by its own objective.

`algorithm.scheme = "learned"` uses Δ = R - V(S) (the "baseline" scheme of rlvr.advantages with
b = V(S), detached). Unlike the group schemes it needs no second sample of the same prompt, so it
works with samples_per_prompt = 1, where centered / normalized give Δ = 0.

Which critic, and why. V is a SEPARATE small network over the prompt's token ids (embeddings of
token and position, mean-pooled, then a two-layer MLP), not a value head on the policy's final
hidden state:
- it needs no hidden-state hook: the policy surface of both model families (the built-in
  transformer and Hugging Face models, with or without LoRA) returns logits only;
- its gradient never reaches the policy's weights, so the two objectives do not compete for a
  shared trunk (no value-loss coefficient to tune) and the policy loss sees V as a constant;
- it is cheap: an embedding lookup and an MLP per prompt, no extra pass through the policy.
The price: it does not share the policy's representation, so where the expected reward depends
on subtle features of the prompt it learns more slowly than a head would. It reads the prompt
only, never the response: a baseline that depends on the sampled action would bias the gradient.

Its objective is the squared error to the observed rewards, with its own optimiser (Adam, lr =
`algorithm.value_lr`):

    value_loss = mean over p, g of (V(S_p) - R[p, g])²,   minimised at V(S_p) = E[R | S_p]

E[R | S] under the CURRENT policy: the critic chases a moving target and lags it by roughly
1 / value_lr updates. The variance-minimising constant is not E[R] but
b* = E[R ‖∇log π‖²] / E[‖∇log π‖²] (rlvr.lab prints both); E[R] is what squared error gives and is
close to b* when ‖∇log π‖² varies little between answers.

The loop (one step, in this order, so b never depends on the rewards it is subtracted from):
    b = critic.baseline(prompt_ids, prompt_mask)                  # (P,), before the update
    delta = advantages.compute(rewards, "baseline", baseline=b)   # (P, G)
    critic.update(prompt_ids, prompt_mask, rewards)               # its own gradient step
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def value_loss(values: Tensor, rewards: Tensor) -> Tensor:
    """mean over p, g of (V_p - R[p, g])²: (P,) values with gradient, (P, G) rewards -> scalar.

    Its gradient in V_p is 2 (V_p - mean_g R[p, g]) / P: each prompt's value moves toward the mean
    reward of its samples; with G = 1, toward the one reward.
    """
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D (P,), got shape {tuple(values.shape)}")
    if rewards.dim() != 2 or rewards.shape[0] != values.shape[0]:
        raise ValueError(f"rewards must have shape (P, G) with P = {values.shape[0]}, got {tuple(rewards.shape)}")
    return ((values[:, None] - rewards.detach().to(values.dtype)) ** 2).mean()


class PromptCritic(nn.Module):
    """V(S): token + position embeddings of the prompt, mean-pooled over real tokens, MLP -> scalar.

    Prompts are (P, Lp) ids with a (P, Lp) mask (1 on real tokens; left padding is fine: positions
    count real tokens only). Positions past max_positions share the last embedding. The output
    layer starts at zero, so V = 0 before the first update.
    """

    def __init__(self, vocab_size: int, *, width: int = 64, max_positions: int = 512):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(max_positions, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))
        nn.init.normal_(self.tok.weight, std=0.1)
        nn.init.normal_(self.pos.weight, std=0.1)
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor) -> Tensor:
        m = prompt_mask.to(self.tok.weight.dtype)  # (P, Lp)
        pos = (prompt_mask.long().cumsum(dim=1) - 1).clamp(0, self.pos.num_embeddings - 1)  # (P, Lp)
        h = self.tok(prompt_ids) + self.pos(pos)  # (P, Lp, width)
        pooled = (h * m[..., None]).sum(dim=1) / m.sum(dim=1, keepdim=True).clamp(min=1)  # (P, width)
        return self.mlp(pooled).squeeze(-1)  # (P,)


class LearnedBaseline:
    """A PromptCritic and its own Adam optimiser: `baseline` to read V(S), `update` to fit it."""

    def __init__(self, vocab_size: int, *, lr: float = 1e-3, width: int = 64, max_positions: int = 512,
                 seed: int = 0, device: str | torch.device = "cpu"):
        for name, v in (("vocab_size", vocab_size), ("width", width), ("max_positions", max_positions)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not 0 < lr < math.inf:
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        with torch.random.fork_rng(devices=[]):  # a seeded init that leaves the global generator alone
            torch.manual_seed(seed)
            self.critic = PromptCritic(vocab_size, width=width, max_positions=max_positions).to(device)
        self.opt = torch.optim.Adam(self.critic.parameters(), lr=lr)

    def baseline(self, prompt_ids: Tensor, prompt_mask: Tensor) -> Tensor:
        """(P,) float32 V(S), detached: a constant for the policy loss."""
        self._check(prompt_ids, prompt_mask)
        with torch.no_grad():
            return self.critic(prompt_ids, prompt_mask).float()

    def update(self, prompt_ids: Tensor, prompt_mask: Tensor, rewards: Tensor) -> float:
        """One Adam step on value_loss(V(S), rewards (P, G)); returns the loss before the step."""
        self._check(prompt_ids, prompt_mask)
        rewards = torch.as_tensor(rewards, dtype=torch.float32, device=prompt_ids.device)
        if not bool(torch.isfinite(rewards).all()):
            raise ValueError("rewards contain NaN or inf")
        loss = value_loss(self.critic(prompt_ids, prompt_mask), rewards)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.item()

    def state_dict(self) -> dict:
        """The critic's weights and its optimiser state (for a resumable run)."""
        return {"critic": self.critic.state_dict(), "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.critic.load_state_dict(state["critic"])
        self.opt.load_state_dict(state["opt"])

    def to_tensors(self) -> tuple[dict[str, Tensor], dict]:
        """The state as flat named tensors and a JSON-able dict (rlvr.state.save_state's
        extra_tensors and extra): critic weights, Adam moments and step, Adam's param groups."""
        named = {f"critic.{k}": v for k, v in self.critic.state_dict().items()}
        opt = self.opt.state_dict()
        for idx, st in opt["state"].items():
            for name, v in st.items():
                named[f"opt.{idx}.{name}"] = torch.as_tensor(v)
        return named, {"param_groups": opt["param_groups"]}

    def load_tensors(self, named: dict[str, Tensor], meta: dict) -> None:
        """Restore what `to_tensors` wrote; KeyError / RuntimeError when it does not fit this critic."""
        self.critic.load_state_dict({k[len("critic."):]: v for k, v in named.items() if k.startswith("critic.")})
        state: dict[int, dict] = {}
        for k, v in named.items():
            if k.startswith("opt."):
                _, idx, name = k.split(".", 2)
                state.setdefault(int(idx), {})[name] = v
        self.opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})

    def _check(self, prompt_ids: Tensor, prompt_mask: Tensor) -> None:
        if prompt_ids.dim() != 2 or tuple(prompt_mask.shape) != tuple(prompt_ids.shape):
            raise ValueError(f"prompt_ids and prompt_mask must both be (P, Lp), got {tuple(prompt_ids.shape)} "
                             f"and {tuple(prompt_mask.shape)}")
        V = self.critic.tok.num_embeddings
        bad_ids = prompt_ids.numel() and not 0 <= int(prompt_ids.min()) <= int(prompt_ids.max()) < V
        if prompt_ids.is_floating_point() or bad_ids:
            raise ValueError(f"prompt_ids must be integer ids in 0..{V - 1}")
