"""Today's model families beyond the suite's six, once through each critical path (`RECENT_ARCHITECTURES` in
tests/tiny_models.py: Gemma-2, Gemma-3 text, Phi-3, Phi-4-mini, Llama-3.2): loading with a pad token added, dropout
off and ties kept; the reward model's score at each row's last real token and its save/load round trip; the hybrid
engine's decode path (fused for Llama-3.2 alone) at parity with `generate` and the training forward in fp32 and
bf16; LoRA on each family's projection names (Phi-3's fused qkv_proj and gate_up_proj); one PPO step at ZeRO-0; and
the refusal of step-3 lengths past Phi-4-mini's longrope switch.

Every folder is written with attention dropout 0.1 (so every path must turn dropout off) and a tokenizer with no
token to pad with (so loading adds one and grows the embeddings to 264 rows: 259 tokens, padded to a multiple of 8).
Gemma-2's weights are drawn with std 0.3, so that its soft caps (scaled to the tiny model) bite."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from scripts.hybrid_engine_worker import (
    PROMPTS,
    build_engine,
    check_lora_merge,
    check_parity,
    greedy_config,
    hybrid_engine,
    prompt_batch,
    train_mode_logprobs,
    train_step,
)
from supervised_data import write_arithmetic_jsonl
from test_step3_rlhf import build_engine as build_rlhf_engine
from test_step3_rlhf import prompt_batch as ppo_prompt_batch
from test_step3_rlhf import step3_argv
from tiny_models import RECENT_ARCHITECTURES, make_config, make_tiny_model_dir

from step3_rlhf.ppo_trainer import PPOConfig, PPOTrainer
from training.core.args import ModelTrainingConfig, apply_model_options
from training.core.lora import lora_target_modules
from training.core.model_loading import load_causal_lm, load_tokenizer
from training.core.reward_model import RewardModel
from training.generation.fused_llama import fused_llama_unsupported_reason
from training.generation.hybrid_engine import HybridEngine, HybridEngineSettings
from training.reliability.validation import check_sequence_lengths
from utils.errors import EXIT_USER_ERROR, UserError

FUSED = "llama3_2"  # the one family the fused decoder serves; the others decode through their transformers forward
TIED = {"gemma2", "gemma3", "phi4_mini", "llama3_2"}
PADDED_VOCABULARY = 264
DROPOUT = {"attention_dropout": 0.1}
PHI_DROPOUT = {**DROPOUT, "resid_pdrop": 0.1, "embd_pdrop": 0.1}
BF16_LOGPROB_TOLERANCE = 2e-2  # tests/test_hybrid_engine.py's bf16 parity bound


@dataclass(frozen=True)
class Family:
    """A family's causal LM folder and a step-2-style reward model folder built on another draw of it."""

    actor: str
    reward: str
    root: Path


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """`family(arch)`: that family's folders, written once per module."""

    @functools.cache
    def make(arch: str) -> Family:
        root = tmp_path_factory.mktemp(arch)
        options = dict(initializer_range=0.3 if arch == "gemma2" else 0.02, with_unk=False,
                       config_overrides=PHI_DROPOUT if arch.startswith("phi") else DROPOUT)
        actor = make_tiny_model_dir(root / "actor", arch, **options)
        tokenizer = load_tokenizer(actor)
        reward = RewardModel.from_causal_lm(make_tiny_model_dir(root / "reward_base", arch, seed=1, **options),
                                            tokenizer)
        reward.save_pretrained(root / "reward")
        tokenizer.save_pretrained(root / "reward")
        return Family(actor, str(root / "reward"), root)

    return make


def _train_mode_logits(model: torch.nn.Module, tokenizer) -> torch.Tensor:
    model.train()
    batch = tokenizer(["Human: hi there", "The quick brown fox jumps over the lazy dog."], return_tensors="pt",
                      padding=True)
    with torch.no_grad():
        return model(**batch).logits.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", RECENT_ARCHITECTURES)
def test_a_saved_model_loads_with_a_pad_token_its_ties_and_no_dropout(family, arch, dtype):
    path = family(arch).actor
    tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id not in (tokenizer.eos_token_id, None)
    model = load_causal_lm(path, tokenizer, dtype=dtype, disable_dropout_layers=True)
    assert model.get_input_embeddings().weight.shape[0] == model.config.vocab_size == PADDED_VOCABULARY
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == (arch in TIED)
    logits = _train_mode_logits(model, tokenizer)
    assert torch.equal(logits, _train_mode_logits(model, tokenizer)), "dropout left on in train mode"
    if arch == "gemma2":  # the final soft cap holds the logits under it, and they reach for it
        cap = model.config.final_logit_softcapping
        assert cap / 2 < logits.abs().max() <= cap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", RECENT_ARCHITECTURES)
def test_the_reward_model_scores_each_rows_last_real_token_and_round_trips(family, arch, dtype, tmp_path):
    """Left- or right-padded, a row's score is the value head on the backbone's last hidden state of the row alone
    (bf16: within a few roundings of the padded batch's other kernel shapes; a score read at another token is off by
    whole units under this head)."""
    path = family(arch).actor
    tokenizer = load_tokenizer(path)
    model = RewardModel.from_causal_lm(path, tokenizer, dtype=dtype, disable_dropout_layers=True).eval()
    with torch.no_grad():
        model.v_head.weight.normal_()
    texts = ["Human: hi", "The quick brown fox jumps over the lazy dog.", "0 1 2 3 4 5"]
    tolerance = dict(rtol=0, atol=1e-4) if dtype == torch.float32 else dict(rtol=0, atol=0.25)
    with torch.no_grad():
        alone = torch.cat([model.v_head(model.backbone(**tokenizer([text], return_tensors="pt"))[0][:, -1, :])[:, 0]
                           for text in texts])
        for side in ("left", "right"):
            tokenizer.padding_side = side
            batch = tokenizer(texts, return_tensors="pt", padding=True)
            torch.testing.assert_close(model(**batch)["end_scores"], alone, **tolerance)
        model.save_pretrained(tmp_path)
        loaded = RewardModel.from_pretrained(tmp_path, dtype=dtype).eval()
        assert type(loaded.backbone) is type(model.backbone)
        assert torch.equal(loaded(**batch)["end_scores"], model(**batch)["end_scores"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", RECENT_ARCHITECTURES)
def test_the_hybrid_engine_decodes_on_the_familys_path_at_parity(distributed, family, arch, dtype):
    """fp32: greedy tokens are `generate`'s and the log-probs the training forward's within 1e-4 (two continuations
    per prompt repeating each answer); bf16: the log-probs within 2e-2. Gemma-2 (soft caps, sliding layers), Gemma-3
    (sliding layers) and Phi-3 (a window; fused projections, partial rotary and longrope in Phi-4-mini) decode through
    their transformers forward; Llama-3.2 (llama3 rope scaling, tied head) through the fused decoder."""
    engine, tokenizer = build_engine(family(arch).actor, stage=0, dtype=dtype)
    assert (fused_llama_unsupported_reason(engine.module) is None) == (arch == FUSED)
    hybrid = hybrid_engine(engine)
    if dtype == "fp32":
        check_parity(engine, hybrid, tokenizer, PROMPTS)
    else:
        out = hybrid.generate(*prompt_batch(tokenizer, PROMPTS), greedy_config(tokenizer))
        torch.testing.assert_close(out.logprobs, train_mode_logprobs(engine, out) * out.answer_mask, rtol=0,
                                   atol=BF16_LOGPROB_TOLERANCE)
    assert hybrid.decode_path == ("fused Llama" if arch == FUSED else "transformers forward")


@pytest.mark.parametrize("arch", RECENT_ARCHITECTURES)
def test_the_default_lora_module_name_adapts_every_projection_of_the_decoder_layers(family, arch):
    """Phi-3's fused qkv_proj and gate_up_proj among them; never the LM head (tied or not)."""
    path = family(arch).actor
    model = load_causal_lm(path, load_tokenizer(path))
    adapted = {name.rpartition(".")[2] for name in lora_target_modules(model, ModelTrainingConfig().lora_module_name)}
    assert adapted == ({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if arch.startswith("phi") else
                       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    assert apply_model_options(model, ModelTrainingConfig(lora_dim=4)).peft_config


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lora_on_phi3s_fused_projections_is_served_by_the_hybrid_engine(distributed, family, dtype):
    """After two training steps the rollouts carry the adapters of qkv_proj and gate_up_proj: folded into the
    weights in fp32 (`check_lora_merge`: parity, and the training weights untouched), beside them in bf16."""
    engine, tokenizer = build_engine(family("phi3").actor, stage=0, lora_arch="phi3", lora_alpha=16, dtype=dtype)
    if dtype == "fp32":
        check_lora_merge(engine, hybrid_engine(engine), tokenizer)
        return
    for _ in range(2):
        train_step(engine, tokenizer)
    out = hybrid_engine(engine).generate(*prompt_batch(tokenizer, PROMPTS), greedy_config(tokenizer))
    torch.testing.assert_close(out.logprobs, train_mode_logprobs(engine, out) * out.answer_mask, rtol=0,
                               atol=BF16_LOGPROB_TOLERANCE)


@pytest.mark.parametrize("arch", RECENT_ARCHITECTURES)
def test_one_ppo_step_starts_on_policy_and_trains_actor_and_critic(distributed, family, arch):
    """Rollouts by the hybrid engine, scored by the family's reward model and critic, the reference a frozen copy of
    the actor: the fp32 rollout log-probs are taken as the old ones, the first update starts at ratio 1 (nothing
    clipped), the KL to the reference is 0, and the step moves both trained models."""
    models = family(arch)
    engine = build_rlhf_engine({"actor": models.actor, "reward": models.reward, "root": models.root},
                               reference_dir=models.actor)
    trainer = PPOTrainer(engine, HybridEngine(engine.actor, HybridEngineSettings(enable=True)),
                         PPOConfig(max_answer_seq_len=8))
    assert trainer.reuse_rollout_logprobs
    experience = trainer.generate_experience(ppo_prompt_batch(engine.tokenizer, 4))
    assert experience.action_mask.sum() > 0 and experience.kl.abs().max() < 1e-4
    before = {name: next(model.parameters()).detach().clone()
              for name, model in (("actor", engine.actor.module), ("critic", engine.critic.module))}
    stats = trainer.train_rlhf(experience)
    assert stats["approx_kl"] < 1e-6 and stats["clip_fraction"] == 0.0
    assert all(torch.isfinite(torch.tensor(stats[key])) for key in ("actor_loss", "critic_loss"))
    for name, model in (("actor", engine.actor.module), ("critic", engine.critic.module)):
        assert not torch.equal(next(model.parameters()), before[name]), f"the {name} did not move"


def test_step3_lengths_past_a_longrope_switch_are_refused():
    """Phi-4-mini's longrope rotates every sequence of a batch with its long factors once the batch's longest passes
    original_max_position_embeddings (4096; 256 here): a rollout decoded across it, the training forward of its
    batch, and the same answer in another batch would each see other frequencies. Within it, lengths pass; the
    positions past it are still the model's for steps 1 and 2 (--max_seq_len)."""
    config = make_config("phi4_mini", vocab_size=64)
    check_sequence_lengths(config, max_prompt_seq_len=200, max_answer_seq_len=56)
    check_sequence_lengths(config, max_seq_len=1024)
    with pytest.raises(UserError, match=r"--max_prompt_seq_len 200 \+ --max_answer_seq_len 100 = 300 tokens pass the "
                                        r"256 positions after which the rotary embedding of the phi model "
                                        r"\(longrope\) switches .*lower them so they sum to at most 256"):
        check_sequence_lengths(config, max_prompt_seq_len=200, max_answer_seq_len=100, model="the phi model")
    for arch in RECENT_ARCHITECTURES:  # no switch elsewhere: Llama-3.2's rope scaling names an original length (16
        if arch != "phi4_mini":        # here) too, but rotates alike at every length
            check_sequence_lengths(make_config(arch, vocab_size=64), max_prompt_seq_len=200, max_answer_seq_len=56)


def test_step3_refuses_a_phi4_mini_actor_whose_rollouts_cross_its_switch(distributed, family, tmp_path, capsys):
    from step3_rlhf.main import main

    models = family("phi4_mini")
    inputs = {"actor": models.actor, "reward": models.reward, "root": tmp_path,
              "data": write_arithmetic_jsonl(tmp_path / "prompts.jsonl", 8)}
    with pytest.raises(SystemExit) as stop:
        main([*step3_argv(inputs, tmp_path / "run", "--max_steps", "1"), "--max_answer_seq_len", "200"])
    assert stop.value.code == EXIT_USER_ERROR
    assert f"the rotary embedding of {models.actor} (longrope) switches" in capsys.readouterr().err
