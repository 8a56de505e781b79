"""Step 3's PPO step, phase by phase, beside the machine's floor for each phase and (with `--peer trl`) TRL's
PPO on the same prompt token ids, in the same process.

    python bench/step3.py                                   # the quick run's models in runs/default
    python bench/step3.py --peer trl --output bench/results/step3_cpu_fp32.json
    python bench/step3.py --dtype bf16 --backend hf --num_prompts 32    # 4 PPO steps of 8

Defaults follow issue 18's setting: SmolLM2-135M after the quick run's step 1 as actor and reference, its step-2
reward model as reward model and critic, the first 48 hh-rlhf harmless prompts of at most 128 tokens, batch 8,
answers up to 128 tokens, one PPO epoch, fp32, ZeRO-0, the hybrid engine. Each phase's time is the median over
the steps after the first; its floor (bench/step3_work.py) is the time the work it must do takes at this
machine's measured matmul throughput and weight-streaming rate (the best of a measurement after each system's
steps), from the real token counts of that step. One more step, run again on the last batch under
torch.profiler, gives each phase's time in matrix-product kernels alone over that step's floor ("matmul kernels /
floor"): how close the phase could get by removing everything else.
`--peer trl` needs `pip install .[bench]` (trl 1.12.0): the reward model and critic are converted to the
transformers classes TRL reads and checked to give this project's scores within 1e-4 first.
On a GPU the rates are the GPU's, the profiled step counts its matrix-product kernels' device time, and the JSON
adds the peak memory PyTorch allocated over this project's steps (`peak_gpu_memory_gib`, after the engines were
built: their weights and optimizer states included); its run on an H200 is
`bench/results/step3_h200_smollm2_zero3_bf16.json`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import REPO_ROOT, device_name, print_table, write_report
from bench.step3_work import (
    MachineRates,
    ModelShape,
    RolloutShape,
    generation_floor,
    scoring_floor,
    training_floor,
)
from step3_rlhf.main import parse_args as parse_step3_args
from step3_rlhf.ppo_trainer import PPOTrainer
from step3_rlhf.rlhf_engine import RLHFEngine, build_rlhf_engine
from training.core.model_loading import load_causal_lm, load_config, load_tokenizer, resolve_dtype
from training.core.optim import OPTIMIZER_CHOICES
from training.generation.cpu_linear import onednn_packing_available
from training.generation.hybrid_engine import build_generator
from utils.data import PromptCollator
from utils.data.formatting import PromptFormatter
from utils.data.rows import read_rows
from utils.dist import current_device, init_distributed
from utils.errors import UserError, run_cli

SHARED_PROMPTS = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf-harmless" / "pairs.jsonl"
# phase -> this project's timed calls in it (PPOTrainer.PHASES) and TRL's (bench/trl_peer.py)
PHASES = {
    "generation": (("generation",), ("generation_s",)),
    "score actor (old log-probs)": (("score_actor",), ()),
    "score reference": (("score_reference",), ("reference_s",)),
    "score reward": (("score_reward",), ("reward_s",)),
    "score critic": (("score_critic",), ("critic_s",)),
    "train actor + critic": (("train_actor", "train_critic"), ("train_s",)),
}
# the kernels that do a forward's or backward's matrix products on CPU (prepacked oneDNN linears included)
MATMUL_KERNELS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise"})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actor", default=str(REPO_ROOT / "runs" / "default" / "step1"))
    parser.add_argument("--reward", default=str(REPO_ROOT / "runs" / "default" / "step2"),
                        help="step-2 reward model folder: the reward model and the critic's start")
    parser.add_argument("--prompts", default=str(SHARED_PROMPTS), help="hh-rlhf pairs JSONL (its prompts are used)")
    parser.add_argument("--num_prompts", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128, help="prompts longer than this are skipped")
    parser.add_argument("--answer_len", type=int, default=128)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--backend", default="hybrid", choices=("hybrid", "hf"))
    parser.add_argument("--optimizer", default="auto", choices=OPTIMIZER_CHOICES,
                        help="this project's optimizer (auto: FusedAdam on GPU, compiled at first use)")
    parser.add_argument("--recompute_old_logprobs", action="store_true",
                        help="this project: an actor forward for the old log-probs even where the rollout's are reused")
    parser.add_argument("--compile_layers", action="store_true",
                        help="this project: every model's decoder layers through torch.compile (a candidate, not "
                             "what train.py does; compiled in the first step, which the medians leave out)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--peer", default="none", choices=("none", "trl"))
    parser.add_argument("--output", default=str(REPO_ROOT / "bench" / "results" / "step3_cpu_fp32.json"))
    args = parser.parse_args(argv)
    if args.batch < 1:
        raise UserError(f"--batch {args.batch}: a PPO step needs at least one prompt")
    if args.num_prompts < 2 * args.batch:
        raise UserError("--num_prompts must give at least two batches (the first step is a warm-up)")
    if args.num_prompts % args.batch:
        raise UserError(f"--num_prompts {args.num_prompts} is not a multiple of --batch {args.batch}: each PPO step "
                        "takes a whole batch of prompts (TRL's peer refuses the rest)")
    for path in (args.actor, args.reward):
        if not Path(path).exists():
            raise UserError(f"{path} does not exist: run the quick run (python train.py) first, or pass --actor "
                            "and --reward")
    if not Path(args.prompts).is_file():
        raise UserError(f"{args.prompts} not found: the hh-rlhf harmless pairs ship in ../shared/data; pass --prompts")
    if args.peer == "trl":
        require_trl()
    return args


def require_trl() -> None:
    """Refuse `--peer trl` without TRL before this project's steps run: TRL's run comes after them."""
    try:
        import trl  # noqa: F401
    except ImportError as error:
        raise UserError(f"--peer trl needs TRL 1.12.0: pip install -c constraints.txt -e '.[bench]' ({error})")


def on_cuda() -> bool:
    return current_device().type == "cuda"


def load_prompt_ids(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """The first `num_prompts` prompts of the pairs file that fit `prompt_len` tokens, rendered as step 3 does."""
    formatter = PromptFormatter(tokenizer, "auto")
    prompts = []
    for row in read_rows(args.prompts, tokenizer):
        ids = tokenizer(row["prompt"], add_special_tokens=formatter.style == "human_assistant")["input_ids"]
        if len(ids) <= args.prompt_len and ids not in prompts:
            prompts.append(ids)
        if len(prompts) == args.num_prompts:
            return prompts
    raise UserError(f"{args.prompts} has only {len(prompts)} distinct prompts of at most {args.prompt_len} tokens")


def step3_settings(args: argparse.Namespace, output_dir: str):
    return parse_step3_args([
        "--actor_model_name_or_path", args.actor, "--critic_model_name_or_path", args.reward,
        "--output_dir", output_dir, "--dtype", args.dtype, "--seed", str(args.seed),
        "--per_device_generation_batch_size", str(args.batch), "--per_device_training_batch_size", str(args.batch),
        "--max_prompt_seq_len", str(args.prompt_len), "--max_answer_seq_len", str(args.answer_len),
        "--actor_zero_stage", str(args.zero_stage), "--critic_zero_stage", str(args.zero_stage),
        "--generation_backend", args.backend, "--enable_hybrid_engine", "--optimizer", args.optimizer,
        *(["--recompute_old_logprobs"] if args.recompute_old_logprobs else []),
    ])


def run_this_project(args: argparse.Namespace, prompt_ids: list[list[int]]) -> tuple[list[dict], dict]:
    """PPO steps of this project on the prompts in order: per step, the phase seconds, the step's wall time and
    its real token counts; and about the run: the models' shapes (for the floors), whether the old log-probs
    were the rollout's, the last rollout's rows (prompt + answer ids and the prompt width) for the TRL check."""
    with tempfile.TemporaryDirectory() as output_dir:
        settings = step3_settings(args, output_dir)
        tokenizer = load_tokenizer(args.actor)
        steps = len(prompt_ids) // args.batch
        engine = build_rlhf_engine(settings, tokenizer, steps, steps)
        if args.compile_layers:
            print(f"--compile_layers: {compile_decoder_layers(engine)} decoder layers compiled", flush=True)
        trainer = PPOTrainer(engine, build_generator(settings.hybrid.backend, engine.actor, tokenizer,
                                                     settings.hybrid), settings.ppo)
        collate = PromptCollator(tokenizer.pad_token_id)
        records = []
        torch.manual_seed(args.seed)
        if on_cuda():
            torch.cuda.reset_peak_memory_stats()
        for step in range(steps):
            batch = collate([{"input_ids": torch.tensor(ids), "attention_mask": torch.ones(len(ids), dtype=torch.long)}
                             for ids in prompt_ids[step * args.batch:(step + 1) * args.batch]])
            trainer.clock.take()
            started = time.perf_counter()
            experience = trainer.generate_experience(batch)
            stats = trainer.train_rlhf(experience)
            step_s = time.perf_counter() - started
            phases = {f"{name}_s": call["s"] for name, call in trainer.clock.take().items()}
            records.append({"step_s": step_s, **phases,
                            "prompt_lengths": batch["attention_mask"].sum(-1).tolist(),
                            "answer_lengths": experience.action_mask.sum(-1).tolist(),
                            "score_mean": experience.scores.mean().item(), "actor_loss": stats["actor_loss"],
                            # so far: DeepSpeed skips an update whose gradients are not finite
                            **trainer.skipped_steps()})
            print(f"step {step + 1}/{steps}: {step_s:.2f} s, {sum(records[-1]['answer_lengths'])} answer tokens",
                  flush=True)
        peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_cuda() else None
        shapes = {"actor": ModelShape.of(engine.actor.module, load_config(args.actor), lm_head=True),
                  "critic": ModelShape.of(engine.critic.module, engine.critic.module.config, lm_head=False)}
        profiled = profile_matmul_kernels(trainer, batch)
        run = {"shapes": shapes, "reused_logprobs": trainer.reuse_rollout_logprobs, "settings": settings,
               "rows": (experience.sequences.cpu(), experience.prompt_length), "profiled": profiled,
               "peak_gpu_memory_gib": peak}
        engine.destroy()
    return records, run


def compile_decoder_layers(engine: RLHFEngine) -> int:
    """Each model's decoder layers through torch.compile (inductor, dynamic shapes: one compiled layer serves
    every layer and model of the same shape, batch and length): fused elementwise work around the matrix
    products of scoring and training. The hybrid engine's inference copy is another model, untouched."""
    compiled = 0
    models = [getattr(m, "module", m) for m in (engine.actor, engine.reference, engine.critic, engine.reward)
              if m is not None]
    for model in models:
        for name, layers in model.named_modules():
            if isinstance(layers, torch.nn.ModuleList) and name.endswith("layers"):
                for layer in layers:
                    layer.compile(dynamic=True)
                    compiled += 1
    return compiled


def profile_matmul_kernels(trainer: PPOTrainer, batch: dict) -> dict:
    """One more PPO step on `batch` under torch.profiler: per timed call, the self time of its matrix-product
    kernels (`MATMUL_KERNELS`; on CUDA their kernels' device time), and the step's real token counts (for its
    floors). This step decodes without CUDA graphs: a replayed graph's kernels have no operator to credit them to
    (generation's figure would count the prefill alone), and none is captured under the profiler."""
    cuda = on_cuda()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    hybrid_settings = getattr(trainer.generator, "settings", None)
    if hybrid_settings is not None:
        trainer.generator.settings = dataclasses.replace(hybrid_settings, cuda_graph=False)
    try:
        with torch.profiler.profile(activities=activities) as profile:
            experience = trainer.generate_experience(batch)
            trainer.train_rlhf(experience)
    finally:
        if hybrid_settings is not None:
            trainer.generator.settings = hybrid_settings
    trainer.clock.take()
    calls = {name for timed, _ in PHASES.values() for name in timed}
    seconds = dict.fromkeys(calls, 0.0)
    for event in profile.events():
        if event.name not in MATMUL_KERNELS:
            continue
        call = event.cpu_parent
        while call is not None and call.name not in calls:
            call = call.cpu_parent
        if call is not None:
            seconds[call.name] += (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e6
    return {"matmul_s": seconds, "prompt_lengths": batch["attention_mask"].sum(-1).tolist(),
            "answer_lengths": experience.action_mask.sum(-1).tolist()}


def matmul_over_floor(profiled: dict, shapes: dict, rates: MachineRates) -> dict[str, float | None]:
    """Per phase, its matmul kernels' seconds in the profiled step over that step's floor (None: no kernel ran)."""
    floors = phase_floors(profiled, shapes, rates)
    out = {}
    for phase, (calls, _) in PHASES.items():
        kernels = sum(profiled["matmul_s"][call] for call in calls)
        out[phase] = round(kernels / floors[phase], 2) if kernels else None
    # the step's floor leaves out the actor's scoring forward, as `median_floors` does
    step_floor = sum(floors.values()) - floors["score actor (old log-probs)"]
    out["step"] = round(sum(profiled["matmul_s"].values()) / step_floor, 2)
    return out


def measure_rates(args: argparse.Namespace, tokenizer, records: list[dict]) -> MachineRates:
    """This machine's rates on the actor's own weight shapes, at a scoring batch's token count (the median of
    `records`' steps). Taken after each system's steps: this shared machine's rates drift by 10-25% over minutes,
    and the floor takes the best of them."""
    dtype = resolve_dtype(args.dtype)
    actor_model = load_causal_lm(args.actor, tokenizer, dtype=dtype)
    tokens = statistics.median(sum(record["prompt_lengths"]) + sum(record["answer_lengths"]) for record in records)
    return MachineRates.measure(actor_model, args.batch, int(tokens), dtype, onednn_packing_available(dtype),
                                current_device())


def rates_report(rates: MachineRates) -> dict:
    return {"matmul_gflops": round(rates.matmul_flops_per_s / 1e9, 2),
            "stream_gb_per_s": round(rates.stream_bytes_per_s / 1e9, 2),
            "weight_pass_ms": {rows: round(s * 1e3, 3) for rows, s in rates.weight_pass_s.items()}}


def phase_floors(record: dict, shapes: dict, rates: MachineRates) -> dict[str, float]:
    rollout = RolloutShape(record["prompt_lengths"], record["answer_lengths"])
    actor, critic = shapes["actor"], shapes["critic"]
    return {
        "generation": generation_floor(actor, rollout, rates)[1],
        "score actor (old log-probs)": scoring_floor(actor, rollout, rates)[1],
        "score reference": scoring_floor(actor, rollout, rates)[1],
        "score reward": scoring_floor(critic, rollout, rates)[1],
        "score critic": scoring_floor(critic, rollout, rates)[1],
        "train actor + critic": training_floor(actor, rollout, rates)[1] + training_floor(critic, rollout, rates)[1],
    }


def median_phases(records: list[dict], keys_of: int) -> dict[str, float]:
    """Per phase, the median seconds over the steps after the first (0 for a phase with no timed call, e.g. the
    old log-probs taken from the rollout); `step` the median step time."""
    timed = records[1:]
    out = {phase: statistics.median(sum(record.get(name if keys_of else f"{name}_s", 0.0) for name in keys[keys_of])
                                    for record in timed)
           for phase, keys in PHASES.items()}
    out["step"] = statistics.median(record["step_s"] for record in timed)
    return out


def median_floors(records: list[dict], shapes: dict, rates: MachineRates) -> dict[str, float]:
    """Per phase, the median floor over the steps after the first, from each step's real token counts."""
    floors = [phase_floors(record, shapes, rates) for record in records[1:]]
    out = {phase: statistics.median(floor[phase] for floor in floors) for phase in PHASES}
    out["step"] = statistics.median(sum(floor.values()) - floor["score actor (old log-probs)"] for floor in floors)
    return out


def run_trl(args: argparse.Namespace, prompt_ids: list[list[int]], rows: tuple[torch.Tensor, int],
            step3) -> tuple[list[dict], float]:
    """TRL's PPO steps on the same prompts (bench/trl_peer.py) with this project's run's PPO coefficients,
    learning rates and schedule (`step3`, its parsed settings), after checking that the converted reward model
    scores this project's last rollout as ours does; and that check's largest difference."""
    from bench import trl_peer

    with tempfile.TemporaryDirectory() as workdir:
        reward = trl_peer.convert_scored_model(args.reward, str(Path(workdir) / "reward"))
        difference = trl_peer.check_conversion(args.reward, reward, *rows)
        print(f"converted reward model: max difference to this project's scores {difference:.2g}", flush=True)
        return trl_peer.run_trl_ppo(trl_peer_settings(args, step3, reward), prompt_ids), difference


def trl_peer_settings(args: argparse.Namespace, step3, reward: str):
    """TRL's settings: the bench's shapes and this project's run's step-3 settings (`step3`: PPO coefficients,
    sampling temperature, learning rates, schedule), so both systems train the same PPO."""
    from bench.trl_peer import TRLPeerSettings

    ppo = step3.ppo
    return TRLPeerSettings(
        actor_path=args.actor, reward_path=reward, critic_path=reward, batch_size=args.batch,
        max_answer_tokens=args.answer_len, dtype=args.dtype, seed=args.seed, temperature=step3.sampling.temperature,
        kl_coef=ppo.kl_ctl, cliprange=ppo.cliprange, cliprange_value=ppo.cliprange_value, gamma=ppo.gamma,
        lam=ppo.lam, actor_learning_rate=step3.actor.learning_rate, critic_learning_rate=step3.critic.learning_rate,
        weight_decay=step3.actor.weight_decay, lr_scheduler_type=step3.schedule.lr_scheduler_type,
        num_warmup_steps=step3.schedule.num_warmup_steps)


@run_cli
def main(argv: list[str] | None = None) -> dict:
    started = time.time()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    init_distributed()
    tokenizer = load_tokenizer(args.actor)
    prompt_ids = load_prompt_ids(args, tokenizer)
    ours, run = run_this_project(args, prompt_ids)
    measurements = [measure_rates(args, tokenizer, ours)]
    peer, peer_measured, conversion_difference = None, None, None
    if args.peer == "trl":
        peer, conversion_difference = run_trl(args, prompt_ids, run["rows"], run["settings"])
        peer_measured = median_phases(peer, 1)
        measurements.append(measure_rates(args, tokenizer, ours))
    rates = MachineRates.best(measurements)
    measured, floors = median_phases(ours, 0), median_floors(ours, run["shapes"], rates)
    kernels = matmul_over_floor(run["profiled"], run["shapes"], rates)
    rows = []
    for phase in [*PHASES, "step"]:
        row = {"phase": phase, "this project s": round(measured[phase], 3), "floor s": round(floors[phase], 3),
               "this project / floor": round(measured[phase] / floors[phase], 2) if measured[phase] else "-"}
        row["matmul kernels / floor"] = kernels[phase] if kernels[phase] is not None else "-"
        if peer_measured is not None:
            row["TRL s"] = round(peer_measured[phase], 3) if phase in peer_measured else "-"
            row["TRL / this project"] = round(peer_measured[phase] / measured[phase], 2) \
                if measured[phase] and peer_measured[phase] else "-"
        rows.append(row)
    # the two systems sample their own answers, so their token counts differ: totals over the timed steps too
    totals = {"this project": {"step_s": sum(record["step_s"] for record in ours[1:]),
                               "answer_tokens": sum(sum(record["answer_lengths"]) for record in ours[1:])}}
    if peer is not None:
        totals["TRL 1.12.0"] = {"step_s": sum(record["step_s"] for record in peer[1:]),
                                "answer_tokens": sum(record["generated_tokens"] for record in peer[1:])}
    print_table(rows, tuple(rows[0]))
    for name, total in totals.items():
        print(f"{name}: {total['step_s']:.1f} s for {total['answer_tokens']:.0f} answer tokens over steps 2-"
              f"{len(ours)} ({total['step_s'] / total['answer_tokens'] * 1e3:.1f} ms per answer token)")
    speedup = rows[-1].get("TRL / this project")
    per_token = None
    if speedup is not None:
        ms_per_token = {name: total["step_s"] / total["answer_tokens"] for name, total in totals.items()}
        per_token = round(ms_per_token["TRL 1.12.0"] / ms_per_token["this project"], 2)
        print(f"step 3 is {speedup}x TRL's median step time ({per_token}x per answer token)")
    report = write_report(
        "step3", args, rows, started,
        device=device_name(current_device()),
        model=args.actor,
        batch_size=args.batch,
        dtype=args.dtype,
        zero_stage=args.zero_stage,
        seconds_per_ppo_step=round(measured["step"], 3),
        phase_seconds={phase: round(measured[phase], 3) for phase in PHASES},
        peak_gpu_memory_gib=run["peak_gpu_memory_gib"],
        speedup_vs_trl=speedup,
        speedup_vs_trl_per_answer_token=per_token,
        rates=rates_report(rates),
        rate_measurements=[rates_report(measurement) for measurement in measurements],
        old_logprobs="from the rollout" if run["reused_logprobs"] else "recomputed",
        totals_after_first_step=totals,
        trl_reward_conversion_max_difference=conversion_difference,
        steps={"this project": ours, **({"TRL 1.12.0": peer} if peer is not None else {})},
        profiled_step=run["profiled"],
    )
    print(json.dumps({"speedup_vs_trl": speedup, "output": args.output}))
    return report


if __name__ == "__main__":
    main()
