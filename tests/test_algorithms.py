"""The algorithm layer: PPO arithmetic against numbers worked out by hand, and the registries."""
import math
from types import SimpleNamespace

import pytest
import torch

from training.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    AdvantageInputs,
    AdaptiveKLController,
    FixedKLController,
    actor_loss,
    compute_advantages_and_returns,
    compute_rewards,
    critic_loss,
    get_advantage_estimator,
    get_policy_loss,
    get_rl_algorithm,
    get_value_loss,
    kl_from_logits,
    kl_loss,
    masked_mean,
    register_advantage_estimator,
    sequence_rewards,
    whiten,
)
from training.core.sequences import token_entropies, token_logprobs
from utils.errors import UserError

GARBAGE = 1e4  # placed on masked-out positions: it must never reach a result


def test_gae_by_hand_with_prompt_and_padding():
    # position 0 is prompt, 1-2 the answer, 3 padding after EOS
    values = torch.tensor([[GARBAGE, 1.0, 2.0, GARBAGE]])
    rewards = torch.tensor([[GARBAGE, 0.5, 1.0, GARBAGE]])
    mask = torch.tensor([[0, 1, 1, 0]])
    advantages, returns = compute_advantages_and_returns(values, rewards, mask, gamma=0.9, lam=0.8)
    # t=2 (last token): delta = 1.0 + 0 - 2.0 = -1.0 ; A = -1.0
    # t=1: delta = 0.5 + 0.9 * 2.0 - 1.0 = 1.3 ; A = 1.3 + 0.9 * 0.8 * (-1.0) = 0.58
    torch.testing.assert_close(advantages, torch.tensor([[0.0, 0.58, -1.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.0, 1.58, 1.0, 0.0]]))


def _reference_gae(values, rewards, gamma, lam):
    """Textbook GAE over one unpadded episode."""
    n = len(values)
    advantages = [0.0] * n
    running = 0.0
    for t in reversed(range(n)):
        next_value = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values)]


def test_gae_matches_textbook_loop_per_episode():
    torch.manual_seed(0)
    values, rewards = torch.randn(3, 7), torch.randn(3, 7)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0]])
    advantages, returns = compute_advantages_and_returns(values, rewards, mask, gamma=0.95, lam=0.9)
    for row in range(3):
        idx = mask[row].nonzero().squeeze(-1)
        ref_adv, ref_ret = _reference_gae(values[row, idx].tolist(), rewards[row, idx].tolist(), 0.95, 0.9)
        torch.testing.assert_close(advantages[row, idx], torch.tensor(ref_adv))
        torch.testing.assert_close(returns[row, idx], torch.tensor(ref_ret))
        assert torch.all(advantages[row][mask[row] == 0] == 0)


def test_actor_loss_by_hand():
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 0.5, 3.0]]))
    advantages = torch.tensor([[1.0, 1.0, -2.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = actor_loss(logprobs, old, advantages, mask, cliprange=0.2)
    # per token max(-A r, -A clip(r)): [-1.2 (clipped), -0.5, 1.6 (clipped)]
    torch.testing.assert_close(out.loss, torch.tensor(-0.1 / 3))
    torch.testing.assert_close(out.clip_fraction, torch.tensor(2 / 3))
    expected_kl = ((0.5 - math.log(1.5)) + 2 * (-0.5 - math.log(0.5))) / 3
    torch.testing.assert_close(out.approx_kl, torch.tensor(expected_kl))


def test_actor_loss_gradient_is_zero_where_clipped():
    logprobs = torch.log(torch.tensor([[1.5, 0.9]])).requires_grad_(True)
    out = actor_loss(logprobs, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), cliprange=0.2)
    out.loss.backward()
    assert logprobs.grad[0, 0] == 0  # ratio 1.5 > 1.2 with positive advantage: clipped
    torch.testing.assert_close(logprobs.grad[0, 1], torch.tensor(-0.9 / 2))


@pytest.mark.parametrize("advantage, masked", [(1.0, False), (0.0, False), (-1.0, False), (1.0, True)])
def test_a_log_ratio_past_fp32s_exp_range_keeps_the_actor_loss_and_its_gradient_finite(advantage, masked):
    logprobs = torch.tensor([[0.0, 100.0]], requires_grad=True)  # exp(100) overflows fp32
    mask = torch.tensor([[1.0, 0.0 if masked else 1.0]])
    out = actor_loss(logprobs, torch.zeros(1, 2), torch.tensor([[1.0, advantage]]), mask, cliprange=0.2)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.approx_kl) and torch.isfinite(logprobs.grad).all()
    torch.testing.assert_close(logprobs.grad[0, 0], torch.tensor(-1.0 if masked else -0.5))
    if advantage > 0 and not masked:
        torch.testing.assert_close(out.loss, torch.tensor((-1.0 - 1.2) / 2))  # the clipped term, as without overflow


def test_critic_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 100.0]])
    old_values = torch.tensor([[0.5, 0.1, 0.0]])
    returns = torch.tensor([[1.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    out = critic_loss(values, old_values, returns, mask, cliprange_value=0.2)
    # token 1: max(0, (0.7 - 1)^2 = 0.09); token 2: max(0.25, 0.25)
    torch.testing.assert_close(out.loss, torch.tensor(0.5 * (0.09 + 0.25) / 2))
    torch.testing.assert_close(out.clip_fraction, torch.tensor(0.5))


def test_rewards_kl_penalty_and_score_placement():
    logprobs = torch.tensor([[GARBAGE, -1.0, -2.0, -0.5, GARBAGE], [GARBAGE, GARBAGE, -1.0, GARBAGE, GARBAGE]])
    ref_logprobs = torch.tensor([[0.0, -1.5, -1.0, -0.5, 0.0], [0.0, 0.0, -1.2, 0.0, 0.0]])
    # row 0: answer at 1-3 then padding; row 1: an answer that ended early (EOS at 2) then padding
    action_mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]])
    scores = torch.tensor([10.0, -2.0])
    rewards, kl = compute_rewards(scores, logprobs, ref_logprobs, action_mask, kl_coef=0.1, clip_reward_value=5.0)
    expected = torch.tensor([[0.0, -0.05, 0.1, 5.0, 0.0], [0.0, 0.0, -2.02, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)
    torch.testing.assert_close(kl, torch.tensor([-0.5, 0.2]))


def test_rewards_for_an_empty_answer_are_zero():
    rewards, kl = compute_rewards(torch.tensor([3.0]), torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3), 0.1, 5.0)
    assert torch.all(rewards == 0) and kl.item() == 0


def test_log_probs_and_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    labels = torch.randint(0, 11, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, labels, tokenizer_size=None), expected)
    uniform = torch.zeros(1, 2, 8)
    peaked = torch.full((1, 2, 8), -1e4)
    peaked[..., 0] = 0.0
    both = torch.cat([uniform, peaked], dim=1)
    torch.testing.assert_close(token_entropies(both, tokenizer_size=None),
                               torch.tensor([[math.log(8)] * 2 + [0.0] * 2]))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_kl_from_logits_is_the_exact_kl_summed_over_masked_positions(temperature):
    """At a temperature both distributions are tempered (the actor's alone was once: never 0 for one model)."""
    torch.manual_seed(0)
    logits, ref_logits = torch.randn(2, 4, 9), torch.randn(2, 4, 9)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    ref_logits[0, 0] = GARBAGE  # masked-out positions never reach the result
    per_position = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=logits / temperature),
                                                     torch.distributions.Categorical(logits=ref_logits / temperature))
    exact = kl_from_logits(logits, ref_logits, mask, temperature, tokenizer_size=None)
    torch.testing.assert_close(exact, (per_position * mask).sum(-1))
    assert torch.all(exact > 0)
    torch.testing.assert_close(kl_from_logits(logits, logits.clone(), mask, temperature, tokenizer_size=None),
                               torch.zeros(2))


def test_a_masked_token_with_a_minus_inf_logit_adds_nothing_to_entropy_or_kl():
    """softmax gives a -inf logit probability 0, and 0 * -inf made the position's entropy and the exact KL nan."""
    logits = torch.tensor([[[1.0, 2.0, float("-inf"), 0.5]]])
    finite = logits[..., [0, 1, 3]]
    torch.testing.assert_close(token_entropies(logits, tokenizer_size=None),
                               token_entropies(finite, tokenizer_size=None))
    assert torch.isfinite(token_entropies(finite, tokenizer_size=None)).all()
    torch.testing.assert_close(kl_from_logits(logits, logits.clone(), torch.ones(1, 1), tokenizer_size=None),
                               torch.zeros(1))
    torch.testing.assert_close(kl_from_logits(logits, torch.zeros(1, 1, 4), torch.ones(1, 1), tokenizer_size=None),
                               kl_from_logits(finite, torch.zeros(1, 1, 3), torch.ones(1, 1), tokenizer_size=None)
                               + math.log(4 / 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_entropy_and_kl_are_those_of_the_tokenizers_ids_only(dtype):
    """Columns from `tokenizer_size` on (a model's embedding rows beyond its tokenizer, which generation never draws)
    are left out of every distribution, here made the most likely on purpose: the log-probs (and their gradient,
    none beyond the tokenizer), entropies and exact KL equal those of the first columns alone."""
    torch.manual_seed(0)
    logits, ref_logits = torch.randn(2, 3, 11).to(dtype), torch.randn(2, 3, 11).to(dtype)
    logits[..., 8:] += 6.0
    ref_logits[..., 8:] -= 6.0
    labels = torch.randint(0, 8, (2, 3))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    padded, kept = logits.clone().requires_grad_(), logits[..., :8].clone().requires_grad_()
    token_logprobs(padded, labels, 0.7, tokenizer_size=8).sum().backward()
    expected = token_logprobs(kept, labels, 0.7, tokenizer_size=None)
    expected.sum().backward()
    torch.testing.assert_close(token_logprobs(logits, labels, 0.7, tokenizer_size=8), expected.detach())
    assert torch.equal(padded.grad[..., :8], kept.grad) and torch.all(padded.grad[..., 8:] == 0)
    torch.testing.assert_close(token_entropies(logits, 0.7, tokenizer_size=8),
                               token_entropies(logits[..., :8], 0.7, tokenizer_size=None))
    torch.testing.assert_close(kl_from_logits(logits, ref_logits, mask, 0.7, tokenizer_size=8),
                               kl_from_logits(logits[..., :8], ref_logits[..., :8], mask, 0.7, tokenizer_size=None))


def plain_logprobs_gradient_entropy_kl(logits: torch.Tensor, ref_logits: torch.Tensor, labels: torch.Tensor,
                                       weights: torch.Tensor, mask: torch.Tensor,
                                       temperature: float) -> tuple[torch.Tensor, ...]:
    """The arithmetic of token_logprobs (and its backward), token_entropies and kl_from_logits before they took the
    tokenizer's size (656ef2b~1), written out over every column and every row at once: log-probs, the gradient of
    their sum weighted by `weights`, entropies, KL."""
    scaled = logits.float() / temperature
    log_z = torch.logsumexp(scaled, dim=-1)
    logprobs = scaled.gather(-1, labels[..., None]).squeeze(-1) - log_z
    gradient = (scaled - log_z[..., None]).exp_().neg_()
    gradient.scatter_add_(-1, labels[..., None], torch.ones_like(labels[..., None], dtype=gradient.dtype))
    gradient = gradient.mul_(weights[..., None].float() / temperature).to(logits.dtype)
    probs = (scaled - log_z[..., None]).exp_()
    entropies = log_z - probs.mul_(scaled).masked_fill_(probs == 0, 0).sum(-1)
    log_p = torch.log_softmax(scaled, dim=-1)
    log_q = torch.log_softmax(ref_logits.float() / temperature, dim=-1)
    p = log_p.exp()
    per_position = torch.where(p > 0, p * (log_p - log_q), 0).sum(-1)
    kl = torch.where(mask.bool(), per_position, torch.zeros_like(per_position)).sum(-1)
    return logprobs, gradient, entropies, kl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokenizer_as_large_as_the_models_rows_changes_no_digit(dtype, monkeypatch):
    """A model whose rows are its tokenizer's (the default quick run's SmolLM2: 49,152 of each) computes exactly what
    it did before the tokenizer's size was taken into account: bit for bit, log-probs, gradient, entropy and KL, with
    the size given or not, over several chunks of rows (3 rows a chunk here)."""
    monkeypatch.setattr("training.core.sequences._CHUNK_ELEMENTS", 3 * 11)
    torch.manual_seed(0)
    logits, ref_logits = torch.randn(2, 5, 11).to(dtype), torch.randn(2, 5, 11).to(dtype)
    labels, weights = torch.randint(0, 11, (2, 5)), torch.rand(2, 5)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]])
    expected = plain_logprobs_gradient_entropy_kl(logits, ref_logits, labels, weights, mask, 0.7)
    for tokenizer_size in (None, 11):
        leaf = logits.clone().requires_grad_()
        logprobs = token_logprobs(leaf, labels, 0.7, tokenizer_size=tokenizer_size)
        (logprobs * weights).sum().backward()
        results = (logprobs.detach(), leaf.grad, token_entropies(logits, 0.7, tokenizer_size=tokenizer_size),
                   kl_from_logits(logits, ref_logits, mask, 0.7, tokenizer_size=tokenizer_size))
        for name, result, plain in zip(("log-probs", "gradient", "entropies", "kl"), results, expected):
            assert torch.equal(result, plain), (name, tokenizer_size, (result.float() - plain.float()).abs().max())


def test_whiten_uses_only_masked_entries():
    x = torch.tensor([[1.0, 2.0, 3.0, GARBAGE], [5.0, GARBAGE, GARBAGE, GARBAGE]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    [out] = whiten([x], [mask])
    assert torch.all(out[mask == 0] == 0)
    torch.testing.assert_close(masked_mean(out, mask), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(masked_mean(out**2, mask), torch.tensor(1.0), atol=1e-5, rtol=0)


def test_bf16_values_are_counted_and_summed_in_fp32():
    """A bf16 mask counted 2056 tokens as 2048: the mean was 0.2% off and a whitened batch's mean -0.008."""
    torch.manual_seed(0)
    x = torch.rand(8, 257) * 3
    mask = torch.ones_like(x)
    mask[:, -1] = 0  # 2056 tokens
    torch.testing.assert_close(masked_mean(x.bfloat16(), mask), x.bfloat16().float()[:, :-1].mean())
    [out] = whiten([x.bfloat16()], [mask])
    assert abs(masked_mean(out, mask).item()) < 1e-4


def test_whitening_pieces_together_is_whitening_them_as_one_batch():
    """Two generation batches' pieces (of different widths) take the statistics of all their masked entries."""
    torch.manual_seed(0)
    first, second = torch.randn(2, 5) * 3 + 1, torch.randn(3, 4)
    first_mask, second_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), torch.tensor([[1, 0, 0, 0]] * 3)
    together = whiten([first, second], [first_mask, second_mask])
    padded = torch.cat([first, torch.nn.functional.pad(second, (0, 1))])
    padded_mask = torch.cat([first_mask, torch.nn.functional.pad(second_mask, (0, 1))])
    [whole] = whiten([padded], [padded_mask])
    torch.testing.assert_close(torch.cat([together[0], torch.nn.functional.pad(together[1], (0, 1))]), whole)
    alone = whiten([second], [second_mask])[0]
    assert (alone - together[1]).abs().max() > 0.1  # each piece on its own scale was the per-rank whitening


# Each rank joins the world through torch alone (torchrun's variables): `whiten` needs no DeepSpeed.
TWO_RANKS_WHITENING = """
import sys
import torch
import torch.distributed as torch_dist
torch_dist.init_process_group("gloo")
from training.algorithms import whiten
torch.manual_seed(0)
x, mask = torch.randn(2, 5) * 3 + 1, torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
if torch_dist.get_rank() == 1:
    x, mask = torch.randn(3, 4) - 2, torch.tensor([[1, 0, 0, 0]] * 3)
[out] = whiten([x], [mask], over_ranks=True)
torch.save({"x": x, "mask": mask, "out": out}, f"{sys.argv[1]}/rank{torch_dist.get_rank()}.pt")
torch_dist.destroy_process_group()
"""


@pytest.mark.slow
def test_whitening_over_ranks_takes_every_ranks_rows_together(tmp_path):
    """Two ranks with rows of different scales: `over_ranks` whitens each rank's rows with the statistics of both
    ranks' rows, as one process whitening them all (per-rank statistics gave each rank its own scale)."""
    from conftest import run_on_two_ranks

    run_on_two_ranks(TWO_RANKS_WHITENING, tmp_path, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    expected = whiten([r["x"] for r in ranks], [r["mask"] for r in ranks])
    for rank, want in zip(ranks, expected):
        torch.testing.assert_close(rank["out"], want)


def test_the_no_eos_penalty_hits_unfinished_answers_whole_after_the_clip():
    """The penalty came before the clip: a cut-off answer scored at or beyond the clip range kept a finished
    answer's reward."""
    scores = torch.tensor([8.0, 8.0, 5.5, 2.0, -7.0])
    ended = torch.tensor([True, False, False, False, False])
    out = sequence_rewards(scores, clip_reward_value=5.0, ended_with_eos=ended, no_eos_penalty=1.0)
    torch.testing.assert_close(out, torch.tensor([5.0, 4.0, 4.0, 1.0, -6.0]))
    torch.testing.assert_close(sequence_rewards(scores, 5.0), torch.tensor([5.0, 5.0, 5.0, 2.0, -5.0]))


def test_adaptive_kl_controller_direction_and_resume():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=100)  # KL too high: error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    high = ctl.value
    ctl.update(current_kl=3.0, n_steps=100)  # KL too low: error -0.5 clipped to -0.2
    assert ctl.value == pytest.approx(high * (1 - 0.2 * 100 / 10000))
    ctl.update(current_kl=6.0, n_steps=100)  # on target: unchanged
    assert ctl.value == pytest.approx(high * (1 - 0.2 * 100 / 10000))
    resumed = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value


def test_fixed_kl_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


# registries -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("getter,kind,known", [(get_advantage_estimator, "advantage estimator", "gae"),
                                               (get_policy_loss, "policy loss", "ppo"),
                                               (get_value_loss, "value loss", "clipped")])
def test_an_unknown_name_is_refused_with_the_choices(getter, kind, known):
    with pytest.raises(UserError, match=f"unknown {kind} 'nope'; choose one of: {known}"):
        getter("nope")


def test_a_registered_estimator_is_picked_up_with_its_critic_need(monkeypatch):
    monkeypatch.setattr(ADVANTAGE_ESTIMATORS, "entries", dict(ADVANTAGE_ESTIMATORS.entries))

    @register_advantage_estimator("toy", needs_critic=False)
    def toy(inputs, config):
        return inputs.rewards * config.scale, inputs.rewards

    estimator = get_advantage_estimator("toy")
    assert not estimator.needs_critic and get_advantage_estimator("gae").needs_critic
    assert "toy" in ADVANTAGE_ESTIMATORS.names()
    rewards = torch.tensor([[1.0, 2.0]])
    advantages, returns = estimator(AdvantageInputs(rewards, torch.ones(1, 2)), SimpleNamespace(scale=3.0))
    assert advantages.tolist() == [[3.0, 6.0]] and returns.tolist() == [[1.0, 2.0]]
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register_advantage_estimator("toy", needs_critic=True)(toy)


def test_gae_estimator_is_gae_whitened_by_the_trainer():
    torch.manual_seed(0)
    values, rewards = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]])
    estimator = get_advantage_estimator("gae")
    advantages, returns = estimator(AdvantageInputs(rewards, mask, values), SimpleNamespace(gamma=0.9, lam=0.8))
    expected, expected_returns = compute_advantages_and_returns(values, rewards, mask, 0.9, 0.8)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=0)
    torch.testing.assert_close(returns, expected_returns, rtol=0, atol=0)
    assert estimator.whitened and not get_advantage_estimator("group_normalized").whitened


def test_registered_losses_are_the_clipped_losses_at_the_configs_ranges():
    torch.manual_seed(0)
    new, old, advantages = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    config = SimpleNamespace(cliprange=0.1, cliprange_value=0.3)
    assert get_policy_loss("ppo")(new, old, advantages, mask, config) == actor_loss(new, old, advantages, mask, 0.1)
    assert get_value_loss("clipped")(new, old, advantages, mask, config) == critic_loss(new, old, advantages, mask, 0.3)


# critic-free estimators and KL estimators, against numbers worked out by hand ------------------------


def _group_of_four_and_a_tied_group() -> AdvantageInputs:
    """Prompt 0 has four answers: R = 1, 0, 1, 0 (row 2 is a lone EOS, row 1 uses every column, rows 0 and 3
    are padded); prompt 1 has four answers that all scored 0.5. GARBAGE sits on every padded position."""
    g = GARBAGE
    rewards = torch.tensor([
        [-0.5, 0.5, 1.0, g], [0.0, 0.0, 0.0, 0.0], [1.0, g, g, g], [0.25, -0.25, g, g],
        [0.5, g, g, g], [0.0, 0.5, g, g], [0.5, g, g, g], [0.25, 0.25, g, g],
    ])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0],
                         [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]])
    return AdvantageInputs(rewards, mask, group_index=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))


def test_grpo_normalises_each_answer_by_its_groups_mean_and_sample_std():
    inputs = _group_of_four_and_a_tied_group()
    advantages, returns = get_advantage_estimator("group_normalized")(inputs, SimpleNamespace(group_std_eps=1e-6))
    # group 0: mean 0.5, sample std sqrt((4 * 0.25) / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 1: every answer 0.5 -> std 0 -> advantage 0 (the eps keeps it finite)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([[a, a, a, 0], [-a, -a, -a, -a], [a, 0, 0, 0], [-a, -a, 0, 0],
                             [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(advantages, expected)
    assert returns[:4, 0].tolist() == [1.0, 0.0, 1.0, 0.0] and returns[0, 3] == 0


@pytest.mark.parametrize("estimator", ["group_normalized", "leave_one_out"])
@pytest.mark.parametrize("size", [3, 5, 6, 16])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(estimator, size):
    """0.3 (a reward function at --reward_fn_coef 0.3) and reward-model scores are not exact in binary: an fp32 group
    mean was off by an ulp, and GRPO's division by the ~1e-7 std made that an advantage of up to 0.3."""
    rewards = torch.zeros(3 * size, 2)
    rewards[:, -1] = torch.tensor([0.3, 2.9, -1.3]).repeat_interleave(size)
    inputs = AdvantageInputs(rewards, torch.ones(3 * size, 2), group_index=torch.arange(3).repeat_interleave(size))
    advantages, _ = get_advantage_estimator(estimator)(inputs, SimpleNamespace(group_std_eps=1e-6))
    assert advantages.abs().max().item() == 0.0


def test_rloo_subtracts_the_mean_of_the_other_answers():
    advantages, _ = get_advantage_estimator("leave_one_out")(_group_of_four_and_a_tied_group(), SimpleNamespace())
    # row 0: 1 - (0 + 1 + 0) / 3 = 2/3; row 1: 0 - (1 + 1 + 0) / 3 = -2/3; the tied group: 0.5 - 0.5 = 0
    first = advantages[:, 0].tolist()
    assert first[:4] == pytest.approx([2 / 3, -2 / 3, 2 / 3, -2 / 3]) and first[4:] == [0.0] * 4
    torch.testing.assert_close(advantages[0], torch.tensor([2 / 3, 2 / 3, 2 / 3, 0.0]))
    torch.testing.assert_close(advantages[2], torch.tensor([2 / 3, 0.0, 0.0, 0.0]))


def test_reinforce_pp_whitens_discounted_returns_to_go_over_the_batch():
    g = GARBAGE
    rewards = torch.tensor([[0.0, 1.0, g], [-1.0, g, g]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    estimator = get_advantage_estimator("reinforce_pp")
    advantages, returns = estimator(AdvantageInputs(rewards, mask), SimpleNamespace(gamma=0.5))
    # returns-to-go: row 0 [0 + 0.5 * 1, 1] = [0.5, 1], row 1 [-1]
    torch.testing.assert_close(returns, torch.tensor([[0.5, 1.0, 0.0], [-1.0, 0.0, 0.0]]))
    torch.testing.assert_close(advantages, returns)
    # the trainer whitens them over the three answer tokens: mean 1/6, variance (1/9 + 25/36 + 49/36) / 3 = 13/18
    assert estimator.whitened
    std = math.sqrt(13 / 18)
    expected = torch.tensor([[(0.5 - 1 / 6) / std, (1 - 1 / 6) / std, 0.0], [(-1 - 1 / 6) / std, 0.0, 0.0]])
    torch.testing.assert_close(whiten([advantages], [mask])[0], expected)


def test_remax_subtracts_the_greedy_answers_reward():
    g = GARBAGE
    inputs = AdvantageInputs(torch.tensor([[0.1, 0.9], [0.0, g]]), torch.tensor([[1, 1], [1, 0]]),
                             baseline_rewards=torch.tensor([0.25, 0.25]))
    estimator = get_advantage_estimator("greedy_baseline")
    assert estimator.needs_greedy_baseline and not estimator.needs_critic
    advantages, _ = estimator(inputs, SimpleNamespace())
    torch.testing.assert_close(advantages, torch.tensor([[0.75, 0.75], [-0.25, 0.0]]))


def test_kl_estimators_by_hand():
    logprobs, ref_logprobs = torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.25, 0.5]]))
    # log r = log(q / p) = -log 2 on token 0, 0 on token 1
    torch.testing.assert_close(KL_ESTIMATORS.get("k1")(logprobs, ref_logprobs), torch.tensor([[math.log(2), 0.0]]))
    torch.testing.assert_close(KL_ESTIMATORS.get("k2")(logprobs, ref_logprobs),
                               torch.tensor([[0.5 * math.log(2) ** 2, 0.0]]))
    torch.testing.assert_close(KL_ESTIMATORS.get("k3")(logprobs, ref_logprobs),
                               torch.tensor([[0.5 - 1 + math.log(2), 0.0]]))
    # as a loss: the masked mean (token 1 masked out), differentiable in the actor's log-probs
    actor = logprobs.clone().requires_grad_(True)
    loss = kl_loss(actor, ref_logprobs, torch.tensor([[1, 0]]), "k3")
    loss.backward()
    assert loss.item() == pytest.approx(0.5 - 1 + math.log(2))
    # d/dlogp [exp(ref - logp) - 1 - (ref - logp)] = 1 - q/p = 0.5 on token 0; 0 where masked
    torch.testing.assert_close(actor.grad, torch.tensor([[0.5, 0.0]]))


def test_k3_is_clamped_so_one_unlikely_token_cannot_outweigh_the_rest():
    """A token the reference gives log-prob -1 and the actor now -11: k3 = e^10 - 11 = 22,015 unclamped, which made one
    64-token answer's KL loss 344 (and its KL-in-reward -1,100 at coefficient 0.05)."""
    logprobs = torch.tensor([[-11.0, -1.0, -200.0]], requires_grad=True)
    ref_logprobs = torch.tensor([[-1.0, -1.0, -1.0]])
    k3 = KL_ESTIMATORS.get("k3")(logprobs, ref_logprobs)
    assert k3.tolist() == [[10.0, 0.0, 10.0]] and torch.isfinite(k3).all()
    k3.sum().backward()
    assert logprobs.grad.tolist() == [[0.0, 0.0, 0.0]]  # clamped tokens pull no more; the middle one is at its minimum
    small = KL_ESTIMATORS.get("k3")(torch.tensor([-1.5]), torch.tensor([-1.0]))
    assert small.item() == pytest.approx(math.exp(0.5) - 1 - 0.5)  # unclamped below the bound


def test_as_a_loss_k2_pulls_along_the_reverse_kl_gradient_and_k1_not_at_all():
    """Exact expectations over a 5-token vocabulary, y drawn from the actor pi = softmax(theta): E[grad kl_loss] is
    the gradient of KL(pi || ref) for k2, that of KL(ref || pi) for k3, and 0 for k1 (E[grad log pi] = 0), which is
    why k1 is refused in the loss."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.1, -0.4], dtype=torch.float64, requires_grad=True)
    ref_logprobs = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 0.4, 0.0], dtype=torch.float64), -1)

    def expected_gradient(estimator: str) -> torch.Tensor:
        logprobs = torch.log_softmax(theta, -1)
        weights = logprobs.exp().detach()  # the sampling distribution: no gradient flows through it
        per_token = [kl_loss(logprobs[y].reshape(1, 1), ref_logprobs[y].reshape(1, 1), torch.ones(1, 1), estimator)
                     for y in range(5)]
        return torch.autograd.grad((weights * torch.stack(per_token)).sum(), theta)[0]

    def gradient_of(kl) -> torch.Tensor:
        log_p = torch.log_softmax(theta, -1)
        return torch.autograd.grad(kl(log_p), theta)[0]

    reverse = gradient_of(lambda log_p: (log_p.exp() * (log_p - ref_logprobs)).sum())
    forward = gradient_of(lambda log_p: (ref_logprobs.exp() * (ref_logprobs - log_p)).sum())
    torch.testing.assert_close(expected_gradient("k2"), reverse)
    torch.testing.assert_close(expected_gradient("k3"), forward)
    torch.testing.assert_close(expected_gradient("k1"), torch.zeros(5, dtype=torch.float64))
    assert reverse.abs().max() > 0.1


@pytest.mark.parametrize("algorithm,in_loss,expected", [
    ("ppo", None, "k1"), ("ppo", True, "k2"), ("rloo", True, "k2"), ("reinforce_pp", True, "k2"),
    ("grpo", None, "k3"), ("grpo", False, "k3")])
def test_the_kl_moved_into_the_loss_gets_an_estimator_with_a_gradient(algorithm, in_loss, expected):
    from step3_rlhf.ppo_trainer import PPOConfig

    assert PPOConfig(algorithm=algorithm, kl_in_loss=in_loss).kl_estimator == expected


def test_k1_asked_for_in_the_loss_is_refused_with_the_alternatives():
    from step3_rlhf.ppo_trainer import PPOConfig

    with pytest.raises(UserError, match="--kl_in_loss with --kl_estimator k1.*use k2"):
        PPOConfig(algorithm="grpo", kl_estimator="k1")
    assert PPOConfig(algorithm="ppo", kl_in_loss=True, kl_estimator="k3").kl_estimator == "k3"
    assert PPOConfig(algorithm="ppo", kl_estimator="k1").kl_estimator == "k1"  # in the reward


def test_the_kl_penalty_in_the_reward_uses_the_chosen_estimator_and_reports_the_k1_sum():
    logprobs, ref_logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.9]])), torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    mask = torch.tensor([[1, 1, 0]])
    rewards, kl = compute_rewards(torch.tensor([2.0]), logprobs, ref_logprobs, mask, 0.1, 5.0, kl_estimator="k3")
    k3 = 0.5 - 1 + math.log(2)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1 * k3, 2.0, 0.0]]))
    assert kl.item() == pytest.approx(math.log(2))
    without, _ = compute_rewards(torch.tensor([2.0]), logprobs, ref_logprobs, mask, 0.0, 5.0)
    torch.testing.assert_close(without, torch.tensor([[0.0, 2.0, 0.0]]))


@pytest.mark.parametrize("name,estimator,samples,in_loss,kl", [
    ("ppo", "gae", 1, False, "k1"), ("grpo", "group_normalized", 4, True, "k3"), ("rloo", "leave_one_out", 4, False, "k1"),
    ("reinforce_pp", "reinforce_pp", 1, False, "k1"), ("remax", "greedy_baseline", 1, False, "k1")])
def test_each_algorithm_names_a_registered_estimator_and_its_defaults(name, estimator, samples, in_loss, kl):
    algorithm = get_rl_algorithm(name)
    assert (algorithm.advantage_estimator, algorithm.n_samples_per_prompt, algorithm.kl_in_loss,
            algorithm.kl_estimator) == (estimator, samples, in_loss, kl)
    assert get_advantage_estimator(estimator).min_group_size <= samples
    assert get_advantage_estimator(estimator).needs_critic == (name == "ppo")


EOS = 2


def _model_free_trainer(config):
    """A trainer whose reward arithmetic (`baseline_scores`, `assemble_experience`) runs without its models."""
    from step3_rlhf.ppo_trainer import PPOTrainer

    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.config = config
    trainer.kl_controller = FixedKLController(config.kl_ctl)
    trainer.stop_token_ids = (EOS,)
    trainer.advantage_estimator = get_advantage_estimator(config.advantage_estimator)
    return trainer


def _rloo_experience(kl_in_loss: bool):
    """Two answers to one prompt, assembled by the trainer under RLOO at --kl_ctl 0.5: answer 0 is [5, EOS]
    (score 1), answer 1 is [EOS] (score 0)."""
    from step3_rlhf.ppo_trainer import PPOConfig, Rollout
    from step3_rlhf.scoring import Scores

    trainer = _model_free_trainer(PPOConfig(algorithm="rloo", kl_ctl=0.5, kl_in_loss=kl_in_loss))
    action_mask = torch.tensor([[1, 1], [1, 0]])
    rollout = Rollout(torch.tensor([[9, 5, EOS], [9, EOS, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]]), 1, action_mask,
                      torch.tensor([0, 0]), None, 2, True, 0.0)
    parts = {"scores": Scores(torch.tensor([1.0, 0.0]), None),
             "old_logprobs": torch.tensor([[-1.0, -2.0], [-0.8, 0.0]]),
             "ref_logprobs": torch.tensor([[-1.5, -1.0], [-1.0, 0.0]])}
    return trainer.assemble_experience(rollout, parts)


def test_a_group_baseline_compares_returns_with_the_kl_penalty_in_the_reward_and_scores_with_it_in_the_loss():
    """R, the return a group estimator compares, is the clipped score plus the KL penalty when the KL is in the reward
    (README): log-ratios [0.5, -1] and [0.2] at --kl_ctl 0.5 give R = 1 - 0.25 + 0.5 = 1.25 and 0 - 0.1 = -0.1, so
    RLOO's advantages are +-1.35; with --kl_in_loss the rewards hold the scores alone, and the advantages are +-1."""
    in_reward = _rloo_experience(kl_in_loss=False)
    torch.testing.assert_close(in_reward.rewards, torch.tensor([[-0.25, 1.5], [-0.1, 0.0]]))
    torch.testing.assert_close(in_reward.advantages, torch.tensor([[1.35, 1.35], [-1.35, 0.0]]))
    in_loss = _rloo_experience(kl_in_loss=True)
    torch.testing.assert_close(in_loss.rewards, torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(in_loss.advantages, torch.tensor([[1.0, 1.0], [-1.0, 0.0]]))
    assert in_reward.ended_with_eos.tolist() == in_loss.ended_with_eos.tolist() == [True, True]


class ConstantRewardModel(torch.nn.Module):
    """A stand-in reward model scoring every row `score`."""

    def __init__(self, score: float):
        super().__init__()
        self.score = score

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"end_scores": torch.full((input_ids.shape[0],), self.score)}


@pytest.mark.parametrize("model_score, rewards", [(7.0, [15.0, 4.0]), (None, [10.0, -1.0])])
def test_the_reward_clip_bounds_the_reward_models_score_and_not_the_weighted_reward_function(model_score, rewards):
    """--clip_reward_value clipped the reward model's score plus --reward_fn_coef x the reward function: at the
    default clip 5, builtin:math weighted 10 gave a right answer 5, no more than a wrong one beside a reward model
    scoring 7. The reward model's score alone is clipped (7 -> 5), the weighted function added after it (10 for the
    right answer) and the no-EOS penalty (1, the wrong answer is cut off) last: in the rewards and ReMax's baseline."""
    from tiny_models import make_tokenizer

    from step3_rlhf.ppo_trainer import Answers, PPOConfig, Rollout
    from step3_rlhf.scoring import RewardScorer
    from training.rewards import load_reward_fn

    tokenizer = make_tokenizer()
    assert tokenizer.eos_token_id == EOS
    trainer = _model_free_trainer(PPOConfig(algorithm="remax", kl_ctl=0.0, no_eos_penalty=1.0))
    reward_model = None if model_score is None else ConstantRewardModel(model_score)
    trainer.scorer = RewardScorer(reward_model, load_reward_fn("builtin:math"), 10.0, tokenizer)
    right, wrong = tokenizer.encode("The answer is 4.") + [EOS], tokenizer.encode("The answer is 5.")
    sequences = torch.tensor([[9, *right], [9, *wrong] + [0] * (len(right) - len(wrong))])
    attention_mask = torch.tensor([[1] * (1 + len(right)), [1] * (1 + len(wrong)) + [0] * (len(right) - len(wrong))])
    action_mask = attention_mask[:, 1:]
    metadata = [{"answer": "4"}, {"answer": "4"}]
    rollout = Rollout(sequences, attention_mask, 1, action_mask, torch.tensor([0, 1]), metadata, 1, True, 0.0,
                      greedy=Answers(sequences, attention_mask, 1, action_mask), prompt_metadata=metadata)
    zeros = torch.zeros(action_mask.shape)
    parts = {"scores": trainer.scorer(sequences, attention_mask, 1, metadata), "old_logprobs": zeros,
             "ref_logprobs": zeros, "baseline": trainer.baseline_scores(rollout)}
    experience = trainer.assemble_experience(rollout, parts)
    assert experience.rewards[torch.arange(2), action_mask.sum(-1) - 1].tolist() == rewards
    assert parts["baseline"].tolist() == rewards
    assert experience.reward_fn_scores.tolist() == [1.0, 0.0]
