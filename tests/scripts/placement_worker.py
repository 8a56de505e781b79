"""Run under `torch.distributed.run`: step 3 on tiny models once per placement (same seed), then, on rank 0,
compare each run's trained models (the actor, the critic and the actor's EMA, those the co-located run wrote)
and its held-out figures with the co-located run's.

    placement_worker.py INPUTS_JSON OUT_DIR PLACEMENT[:RATIO] ...   (the first one is the reference run)
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from step3_rlhf.main import main
from utils.dist import barrier, is_main_process


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def run(inputs: dict, out: Path, spec: str) -> dict:
    name, _, ratio = spec.partition(":")
    output_dir = out / spec.replace(":", "_").replace(",", "_").replace("=", "")
    argv = ["--actor_model_name_or_path", inputs["actor"], "--critic_model_name_or_path", inputs["reward"],
            "--output_dir", str(output_dir), "--data_path", inputs["data"], "--data_split", "0,0,1",
            "--data_output_path", str(out / "cache"), "--max_prompt_seq_len", "96", "--max_answer_seq_len", "8",
            "--eval_samples", "4", "--dtype", inputs.get("dtype", "fp32"), "--max_steps", "2",
            "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "1",
            "--actor_learning_rate", "1e-3", *inputs.get("critic_flags", ["--critic_learning_rate", "1e-3"]),
            "--enable_hybrid_engine", "--placement", name, *(["--placement_ratio", ratio] if ratio else []),
            *inputs.get("extra", [])]
    summary = main(argv)
    barrier()
    return {"dir": output_dir, "summary": summary}


def main_worker() -> None:
    inputs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    specs = sys.argv[3:]
    results = {spec: run(inputs, out, spec) for spec in specs}
    if not is_main_process():
        return
    reference = results[specs[0]]
    tolerance = inputs.get("tolerance", 1e-5)
    for spec in specs[1:]:
        result = results[spec]
        assert result["summary"]["placement"].startswith(spec.partition(":")[0]), result["summary"]["placement"]
        models = [model for model in ("actor", "critic", "actor_ema") if (reference["dir"] / model).exists()]
        for model in models:
            assert (result["dir"] / model).is_dir(), f"{spec}: no {model} folder"
            expected, got = weights(reference["dir"] / model), weights(result["dir"] / model)
            assert expected.keys() == got.keys()
            worst = max((expected[k].float() - got[k].float()).abs().max().item() for k in expected)
            if model == "actor":
                start = weights(Path(inputs["actor"]))
                changed = max((expected[k].float() - start[k].float()).abs().max().item() for k in expected)
                assert changed > 0, "the actor did not train"
            assert worst <= tolerance, f"{spec}: {model} weights differ from {specs[0]}'s by {worst}"
        for key in ("reward_first", "reward_last", "kl_exact_last", "rollout_reward_last", "rollout_kl_last"):
            expected, got = reference["summary"][key], result["summary"][key]
            assert abs(expected - got) <= 1e-4 * max(1.0, abs(expected)), f"{spec}: {key} {got} != {expected}"
        trained = [record for record in map(json.loads, (result["dir"] / "metrics.jsonl").read_text().splitlines())
                   if "train/actor_loss" in record]
        skipped = [f"train/{model}_skipped_steps" for model in models if model != "actor_ema"]
        assert trained and all(record[key] == 0 for record in trained for key in skipped), \
            f"{spec}: the skipped updates' counts are not logged"
        # the std over every rank's scores, gathered co-located, every chunk's on each rank under a placement
        expected_stds, stds = score_stds(reference["dir"]), [record["reward/score_std"] for record in trained]
        assert len(stds) == len(expected_stds) and all(
            abs(got - expected) <= 1e-4 * max(1.0, abs(expected)) for got, expected in zip(stds, expected_stds)
        ), f"{spec}: score std {stds} != {expected_stds}"
        print(f"PLACEMENT_OK {spec} {result['summary']['placement']}", flush=True)


def score_stds(run_dir: Path) -> list[float]:
    """The logged `reward/score_std` of each PPO step of a run."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [record["reward/score_std"] for record in records if "train/actor_loss" in record]


if __name__ == "__main__":
    main_worker()
