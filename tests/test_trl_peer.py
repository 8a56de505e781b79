"""bench/trl_peer.py on tiny Llama models: a converted reward model scores like ours through TRL's get_reward,
a wrong head is caught, and TRL PPO takes the prompts in order and reports every phase."""
import pytest
import torch

pytest.importorskip("trl.experimental.ppo")

from bench.trl_peer import PHASES, TRLPeerSettings, check_conversion, convert_scored_model, run_trl_ppo  # noqa: E402
from tiny_models import make_tiny_model_dir  # noqa: E402
from training.core.model_loading import load_tokenizer  # noqa: E402
from training.core.reward_model import RewardModel  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

CONTEXT = 6


@pytest.fixture
def models(tmp_path):
    """(actor folder, our reward model folder, its TRL conversion): tiny Llama with a pad token other than EOS."""
    actor = make_tiny_model_dir(tmp_path / "actor", "llama", with_pad=True)
    tokenizer = load_tokenizer(actor)
    torch.manual_seed(1)
    reward = RewardModel.from_causal_lm(actor, tokenizer)
    reward.save_pretrained(tmp_path / "reward")
    tokenizer.save_pretrained(tmp_path / "reward")
    converted = convert_scored_model(str(tmp_path / "reward"), str(tmp_path / "reward-trl"))
    return actor, str(tmp_path / "reward"), converted


def trl_layout(pad: int, eos: int) -> torch.Tensor:
    """TRL's rollout layout: prompts (3, 6, 4, 5 tokens) left-padded to CONTEXT, then answers right-padded: one
    ending in EOS, one filling the width (no pad at all), one of EOS alone, one empty."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for prompt_length, answer in ((3, [None, None, eos]), (6, [None] * 5), (4, [eos]), (5, [])):
        tokens = torch.randint(max(pad, eos) + 1, 200, (prompt_length + len(answer),), generator=generator).tolist()
        prompt, body = tokens[:prompt_length], tokens[prompt_length:]
        answer = [token if token is not None else body[i] for i, token in enumerate(answer)]
        rows.append([pad] * (CONTEXT - prompt_length) + prompt + answer + [pad] * (5 - len(answer)))
    return torch.tensor(rows)


def test_converted_reward_model_scores_like_ours_through_trl(models):
    _, reward, converted = models
    model = AutoModelForSequenceClassification.from_pretrained(converted)
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    tokenizer = load_tokenizer(converted)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    difference = check_conversion(reward, converted, trl_layout(tokenizer.pad_token_id, tokenizer.eos_token_id),
                                  CONTEXT)
    assert difference <= 1e-4


def test_a_wrong_head_fails_the_check(models, tmp_path):
    _, reward, converted = models
    model = AutoModelForSequenceClassification.from_pretrained(converted)
    with torch.no_grad():
        model.score.weight.mul_(1.01)
    model.save_pretrained(tmp_path / "wrong")
    tokenizer = load_tokenizer(converted)
    tokenizer.save_pretrained(tmp_path / "wrong")
    with pytest.raises(ValueError, match="max difference"):
        check_conversion(reward, str(tmp_path / "wrong"), trl_layout(tokenizer.pad_token_id, tokenizer.eos_token_id),
                         CONTEXT)


def test_trl_ppo_takes_the_prompts_in_order_and_times_every_phase(models, monkeypatch):
    from trl.experimental.ppo import ppo_trainer

    actor, _, converted = models
    pad = load_tokenizer(actor).pad_token_id
    prompts = [[20, 21, 22], [30, 31, 32, 33, 34], [40, 41], [50, 51, 52, 53]]
    generate, seen = ppo_trainer.batch_generation, []

    def recording_generation(model, queries, *args, **kwargs):
        seen.extend([token for token in row if token != pad] for row in queries.tolist())
        return generate(model, queries, *args, **kwargs)

    monkeypatch.setattr(ppo_trainer, "batch_generation", recording_generation)
    settings = TRLPeerSettings(actor_path=actor, reward_path=converted, critic_path=converted, batch_size=2,
                               max_answer_tokens=6)
    steps = run_trl_ppo(settings, prompts)
    assert seen == prompts, "TRL must take the prompts unshuffled, in order"
    assert len(steps) == 2
    for step in steps:
        for phase in PHASES:
            assert 0 < step[phase] < step["step_s"], phase
        assert 1 <= step["generated_tokens"] <= 2 * 6
