"""TRL's PPO as a peer for `bench/step3.py --peer trl` (issue 18): the same actor, reward model and critic, the
same prompt token ids, timed per phase in the same process.

- `convert_scored_model` turns this project's reward model / critic folder (backbone + `v_head`) into the
  `AutoModelForSequenceClassification` folder (`score` head, num_labels=1) that TRL's PPO scores with.
- `check_conversion` proves a converted folder scores what ours does, through TRL's own `get_reward`.
- `run_trl_ppo` runs `trl.experimental.ppo.PPOTrainer` (trl==1.12.0, the `bench` extra) and returns per-step
  phase seconds, measured by wrapping TRL's module-level `batch_generation`, `forward` and `get_reward`, the
  accelerator's `backward` and the optimizer's `step`, not by re-implementing its loop.
"""
from __future__ import annotations

import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    TrainerCallback,
    get_scheduler,
)

from training.core.model_loading import load_tokenizer, resolve_model_path
from training.core.reward_model import RewardModel

PHASES = ("generation_s", "reference_s", "reward_s", "critic_s", "train_s")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def convert_scored_model(folder: str, out_dir: str) -> str:
    """Write `folder` (a step-2 reward model or a critic: backbone + `v_head`) as a sequence-classification folder.

    The class is whatever the backbone's config maps to (`LlamaForSequenceClassification` for Llama); its
    backbone weights are ours, its `score.weight` is our `v_head.weight`, weights are saved in fp32 (exact for a
    bf16 source), and the tokenizer is copied. Returns `out_dir`.
    """
    source = resolve_model_path(folder)
    scored = RewardModel.from_pretrained(source)
    tokenizer = load_tokenizer(source)
    config = AutoConfig.from_pretrained(source)
    config.num_labels = 1
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no `score` head; TRL's get_reward needs one")
    getattr(model, model.base_model_prefix).load_state_dict(scored.backbone.state_dict())
    with torch.no_grad():
        model.score.weight.copy_(scored.v_head.weight)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def check_conversion(
    folder: str, converted: str, query_responses: torch.Tensor, context_length: int, tolerance: float = 1e-4
) -> float:
    """Max |TRL - ours| over end scores and per-token values (fp32); raises ValueError above `tolerance`.

    `query_responses` is TRL's layout: prompts left-padded to `context_length`, responses after them, right-padded
    with the pad id. What had to agree:
    - mask: TRL derives it as `ids != pad_token_id`; ours is given that same mask. So pad must differ from EOS and
      from every real token, or TRL drops those tokens (with pad == EOS it would score the token before EOS);
    - last token: TRL takes the position before the first pad in the response (the last position when there is
      none), we take the last 1 of the mask; equal because after TRL truncates at the stop token the real tokens
      of a response are contiguous from `context_length` on (an empty response falls back to the last prompt
      token in both);
    - position ids: TRL `cumsum(mask) - mask`, ours `(cumsum(mask) - 1).clamp(min=0)`: the same on real tokens
      (they differ only on pads, whose outputs neither side uses, so values are compared on real tokens only);
    - hidden state: TRL scores `hidden_states[-1]`, we score the backbone's `last_hidden_state`; under
      transformers 5 both are after the final norm. TRL also feeds token id 0 on pads: masked, no effect.
    """
    from trl.experimental.utils import get_reward

    tokenizer = AutoTokenizer.from_pretrained(converted)
    pad_token_id = tokenizer.pad_token_id
    ours = RewardModel.from_pretrained(resolve_model_path(folder)).eval()
    theirs = AutoModelForSequenceClassification.from_pretrained(converted, dtype=torch.float32).eval()
    mask = query_responses != pad_token_id
    with torch.no_grad():
        their_values, their_scores, _ = get_reward(theirs, query_responses, pad_token_id, context_length)
        mine = ours(query_responses, mask.long())
    value_diff = (their_values.squeeze(-1) - mine["values"])[mask].abs().max().item()
    score_diff = (their_scores - mine["end_scores"]).abs().max().item()
    difference = max(value_diff, score_diff)
    if difference > tolerance:
        raise ValueError(
            f"{converted} does not score like {folder}: max difference {difference:.3g} (end scores {score_diff:.3g}, "
            f"per-token values {value_diff:.3g}) is above {tolerance:g}"
        )
    return difference


@dataclass
class TRLPeerSettings:
    """What the bench passes on; `reward_path` and `critic_path` are folders written by `convert_scored_model`.

    `bench/step3.py` passes its run's step-3 settings (PPO coefficients, learning rates, schedule); the defaults
    serve a run on its own. `vf_coef` is TRL's weight on the value loss in its single actor+critic loss (TRL's
    default 0.1).
    """

    actor_path: str
    reward_path: str
    critic_path: str
    batch_size: int = 8
    max_answer_tokens: int = 128
    dtype: str = "fp32"
    temperature: float = 1.0
    kl_coef: float = 0.1
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    vf_coef: float = 0.1
    actor_learning_rate: float = 3e-5
    critic_learning_rate: float = 1e-5
    weight_decay: float = 0.0
    lr_scheduler_type: str = "cosine"
    num_warmup_steps: int = 0
    seed: int = 1234


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class _PhaseClock(TrainerCallback):
    """Adds wrapped calls' seconds to the running step; a step ends at TRL's `on_step_end`."""

    def __init__(self, eos_token_id: int, pad_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)
        self.step_started = 0.0

    def timed(self, function: Callable, phase_of: Callable[..., str]) -> Callable:
        """`function` that adds its run time to the phase `phase_of(*args)` names."""

        def wrapper(*args, **kwargs):
            started = _now()
            result = function(*args, **kwargs)
            self.current[phase_of(*args)] += _now() - started
            return result

        return wrapper

    def count_generated(self, queries: torch.Tensor, query_responses: torch.Tensor) -> None:
        """Response tokens up to and including the first EOS (pads after a finished row are not counted)."""
        responses = query_responses[:, queries.shape[1]:]
        is_eos = responses == self.eos_token_id
        after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0
        self.current["generated_tokens"] += ((responses != self.pad_token_id) & ~after_eos).sum().item()

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self.step_started = _now()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        ended = _now()
        step = {phase: self.current[phase] for phase in PHASES}
        step["step_s"] = ended - self.step_started
        step["generated_tokens"] = float(self.current["generated_tokens"])
        step["threads"] = torch.get_num_threads()
        self.steps.append(step)
        self.current = defaultdict(float)
        self.step_started = ended


@contextmanager
def _timed_trl(trainer, clock: _PhaseClock) -> Iterator[None]:
    """Wrap TRL's phase calls with `clock` for the duration of `trainer.train()`; restore them after."""
    from trl.experimental.ppo import ppo_trainer

    originals = {name: getattr(ppo_trainer, name) for name in ("batch_generation", "forward", "get_reward")}
    generate = originals["batch_generation"]

    def batch_generation(model, queries, *args, **kwargs):
        query_responses, logits = generate(model, queries, *args, **kwargs)
        clock.count_generated(queries, query_responses)
        return query_responses, logits

    ppo_trainer.batch_generation = clock.timed(batch_generation, lambda *args: "generation_s")
    ppo_trainer.forward = clock.timed(
        originals["forward"], lambda model, *args: "reference_s" if model is trainer.ref_model else "train_s"
    )
    ppo_trainer.get_reward = clock.timed(
        originals["get_reward"], lambda model, *args: "reward_s" if model is trainer.reward_model else "critic_s"
    )
    backward, optimizer_step = trainer.accelerator.backward, trainer.optimizer.step
    trainer.accelerator.backward = clock.timed(backward, lambda *args: "train_s")
    trainer.optimizer.step = clock.timed(optimizer_step, lambda *args: "train_s")
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(ppo_trainer, name, function)
        trainer.accelerator.backward, trainer.optimizer.step = backward, optimizer_step


def _left_padding_tokenizer(path: str) -> PreTrainedTokenizerBase:
    tokenizer = load_tokenizer(path)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(
            f"the tokenizer of {path} needs a pad token other than EOS: TRL's PPO treats every pad id as padding"
        )
    tokenizer.padding_side = "left"
    return tokenizer


def run_trl_ppo(settings: TRLPeerSettings, prompt_ids: list[list[int]]) -> list[dict[str, float]]:
    """Run TRL's PPO over `prompt_ids` in order, one step per `batch_size` prompts; one dict per step.

    Each dict: `generation_s`, `reference_s`, `reward_s`, `critic_s` (value forward over the rollout), `train_s`
    (TRL trains actor and critic together: one forward through its PolicyAndValueWrapper, one backward and one
    optimizer step over both; this is their sum, the loss arithmetic between them excluded), `step_s` (wall time
    of the whole step), `generated_tokens` (response tokens up to and including EOS) and `threads` (torch's, this
    process's count as it was before TRL was set up).

    One PPO epoch over one mini-batch, sampling at `temperature`, stop at EOS, no eval, saving or reporting.
    `dtype` "bf16" loads all four models in bf16 and TRL's AdamW trains those weights directly (TRL's PPOTrainer
    builds its own Accelerator without mixed precision, so there is no fp32 master copy).
    """
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    if not prompt_ids or len(prompt_ids) % settings.batch_size:
        raise ValueError(f"{len(prompt_ids)} prompts do not make whole batches of {settings.batch_size}")
    if settings.dtype not in _DTYPES:
        raise ValueError(f"dtype {settings.dtype!r} is not one of {sorted(_DTYPES)}")
    dtype = _DTYPES[settings.dtype]
    steps = len(prompt_ids) // settings.batch_size
    actor_path = resolve_model_path(settings.actor_path)
    tokenizer = _left_padding_tokenizer(actor_path)
    torch.manual_seed(settings.seed)
    actor = AutoModelForCausalLM.from_pretrained(actor_path, dtype=dtype)
    reference = AutoModelForCausalLM.from_pretrained(actor_path, dtype=dtype)
    reward = AutoModelForSequenceClassification.from_pretrained(settings.reward_path, dtype=dtype)
    critic = AutoModelForSequenceClassification.from_pretrained(settings.critic_path, dtype=dtype)
    optimizer = torch.optim.AdamW(
        [
            {"params": actor.parameters(), "lr": settings.actor_learning_rate},
            {"params": critic.parameters(), "lr": settings.critic_learning_rate},
        ],
        weight_decay=settings.weight_decay,
        fused=True,  # the kernel this project's CPU training uses too, so the update compares like with like
    )
    scheduler = get_scheduler(settings.lr_scheduler_type, optimizer, settings.num_warmup_steps, steps)
    dataset = Dataset.from_dict({"input_ids": prompt_ids})
    clock = _PhaseClock(tokenizer.eos_token_id, tokenizer.pad_token_id)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="trl_peer_") as output_dir:
        config = PPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=settings.batch_size,
            gradient_accumulation_steps=1,
            num_mini_batches=1,
            num_ppo_epochs=1,
            local_rollout_forward_batch_size=settings.batch_size,
            total_episodes=len(prompt_ids),
            response_length=settings.max_answer_tokens,
            stop_token="eos",
            temperature=settings.temperature,
            kl_coef=settings.kl_coef,
            cliprange=settings.cliprange,
            cliprange_value=settings.cliprange_value,
            vf_coef=settings.vf_coef,
            gamma=settings.gamma,
            lam=settings.lam,
            seed=settings.seed,
            bf16=settings.dtype == "bf16",
            use_cpu=not torch.cuda.is_available(),
            gradient_checkpointing=False,
            num_sample_generations=0,
            eval_strategy="no",
            save_strategy="no",
            report_to="none",
        )
        trainer = PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=actor,
            ref_model=reference,
            reward_model=reward,
            value_model=critic,
            train_dataset=dataset,
            optimizers=(optimizer, scheduler),
            callbacks=[clock],
        )
        # the accelerate state TRL sets up sets its own thread count where OMP_NUM_THREADS is unset (the host's
        # physical cores over the ranks, whatever cores this process may use): TRL runs with this process's
        torch.set_num_threads(threads)
        # TRL's own dataloader shuffles; the bench needs the prompts in the order it gave them.
        trainer.dataloader = trainer.accelerator.prepare(
            DataLoader(dataset, batch_size=settings.batch_size, shuffle=False, collate_fn=trainer.data_collator,
                       drop_last=True)
        )
        with _timed_trl(trainer, clock):
            trainer.train()
    return clock.steps
