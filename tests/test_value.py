"""The learned baseline: its objective by hand, convergence to E[R | S], G = 1, detachment, resume."""

import io

import pytest
import torch

from rlvr import advantages
from rlvr.value import LearnedBaseline, PromptCritic, value_loss

# two prompts, the second left-padded (pad id 0)
IDS = torch.tensor([[3, 4, 5], [0, 6, 7]])
MASK = torch.tensor([[1, 1, 1], [0, 1, 1]])


def test_value_loss_by_hand():
    # V = (0.5, 0), R = [[1, 0], [1, 1]]: ((0.25 + 0.25) + (1 + 1)) / 4 = 0.625
    V = torch.tensor([0.5, 0.0], requires_grad=True)
    R = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    loss = value_loss(V, R)
    assert loss.item() == pytest.approx(0.625)
    # dL/dV_p = 2 (V_p - mean_g R) / P: 0 for the first (0.5 is its mean), -1 for the second
    (grad,) = torch.autograd.grad(loss, V)
    assert torch.allclose(grad, torch.tensor([0.0, -1.0]))


def test_starts_at_zero_and_the_baseline_is_detached():
    vb = LearnedBaseline(10, lr=0.01)
    b = vb.baseline(IDS, MASK)
    assert b.shape == (2,) and b.dtype == torch.float32 and not b.requires_grad
    assert torch.equal(b, torch.zeros(2))


@pytest.fixture
def one_thread():
    """Thousands of tiny steps: a second intra-op thread only adds contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_converges_to_the_expected_reward_of_each_prompt_with_one_sample(one_thread):
    """G = 1, Bernoulli rewards with P(R = 1) = 0.2 and 0.7: V(S) -> E[R | S]."""
    g = torch.Generator().manual_seed(0)
    vb = LearnedBaseline(10, lr=0.01, seed=1)
    p = torch.tensor([[0.2], [0.7]])
    tail = []
    for step in range(1500):
        rewards = (torch.rand(2, 1, generator=g) < p).float()  # (P, G = 1)
        vb.update(IDS, MASK, rewards)
        if step >= 1000:
            tail.append(vb.baseline(IDS, MASK))
    mean = torch.stack(tail).mean(0)
    assert torch.allclose(mean, torch.tensor([0.2, 0.7]), atol=0.05), mean


def test_learned_delta_is_nonzero_where_group_schemes_give_zero():
    rewards = torch.tensor([[1.0], [0.0]])  # G = 1
    assert torch.equal(advantages.compute(rewards, "centered"), torch.zeros(2, 1))
    b = torch.tensor([0.25, 0.5])  # what a critic would say
    assert torch.equal(advantages.compute(rewards, "baseline", baseline=b), torch.tensor([[0.75], [-0.5]]))


def test_one_update_moves_toward_the_target_and_only_the_critic():
    vb = LearnedBaseline(10, lr=0.05, seed=3)
    before = vb.baseline(IDS, MASK)
    loss = vb.update(IDS, MASK, torch.tensor([[1.0, 1.0], [1.0, 1.0]]))
    assert loss == pytest.approx(1.0)  # V = 0 against R = 1 everywhere
    after = vb.baseline(IDS, MASK)
    assert (after > before).all()


def test_left_padding_does_not_change_the_value():
    critic = PromptCritic(10, width=8)
    torch.nn.init.normal_(critic.mlp[2].weight)  # a non-zero output layer
    a = critic(torch.tensor([[0, 0, 6, 7]]), torch.tensor([[0, 0, 1, 1]]))
    b = critic(torch.tensor([[6, 7]]), torch.tensor([[1, 1]]))
    assert a.abs().item() > 0 and torch.allclose(a, b)


def test_seeded_and_leaves_the_global_generator_alone():
    state = torch.random.get_rng_state()
    a, b = LearnedBaseline(10, seed=7), LearnedBaseline(10, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    for x, y in zip(a.critic.parameters(), b.critic.parameters()):
        assert torch.equal(x, y)


def test_state_dict_round_trip_resumes_the_same_updates():
    R = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    a = LearnedBaseline(10, lr=0.02, seed=2)
    a.update(IDS, MASK, R)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)  # as a resumable run writes it
    buf.seek(0)
    b = LearnedBaseline(10, lr=0.02, seed=99)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert a.update(IDS, MASK, R) == b.update(IDS, MASK, R)
    assert torch.equal(a.baseline(IDS, MASK), b.baseline(IDS, MASK))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: LearnedBaseline(0), "vocab_size"),
        (lambda: LearnedBaseline(10, lr=0.0), "lr"),
        (lambda: LearnedBaseline(10, width=0), "width"),
        (lambda: LearnedBaseline(10).baseline(IDS, MASK[:, :2]), "prompt_mask"),
        (lambda: LearnedBaseline(10).baseline(IDS[0], MASK[0]), "prompt_ids"),
        (lambda: LearnedBaseline(5).baseline(IDS, MASK), "0..4"),
        (lambda: LearnedBaseline(10).baseline(IDS.float(), MASK), "integer"),
        (lambda: LearnedBaseline(10).update(IDS, MASK, torch.tensor([[float("nan")], [0.0]])), "rewards"),
        (lambda: value_loss(torch.zeros(2), torch.zeros(3, 1)), "rewards"),
        (lambda: value_loss(torch.zeros(2, 1), torch.zeros(2, 1)), "values"),
    ],
)
def test_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
