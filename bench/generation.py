"""Time the two generation backends on the same prompts: the hybrid engine and plain `generate`.

    python bench/generation.py --zero_stage 3 --batch_size 8 --max_new_tokens 128 --dtype fp32 \
        --output bench/results/generation_cpu_avx2_zero3_b8_fp32.json

Both backends decode greedily by default, so they must produce the same tokens (the JSON says
whether they did) and do the same amount of work; each backend's reported log-probs are compared
with the train-mode forward's over the generated tokens (max and mean absolute difference); tokens/s counts generated
answer tokens (through the token that ends each row's turn, as in step 3: the EOS, the chat template's end-of-turn
token, or another id the model's generation config stops at); each backend runs `--repeats` times, alternating, and its fastest run counts. The hybrid timing includes
entering and leaving generate mode (gathering, LoRA merging, building the inference copy), since every rollout pays it.

Each backend also runs, after each timed run, the same prompts to two new tokens (the prefill, the first decode
step, which is where a CUDA graph is captured, and for the hybrid engine entering generate mode):
`first_step_seconds` is its fastest, and `decode_step_s`, the fastest run less it over the run's decode steps after
the first (answer length - 2), is the steady time per decode step.
`decode_floor_s` is the time one such step must take at least on this device (bench/decode_floor.py): the bytes it
reads (every weight but an untied input embedding, `decode_weight_bytes` in the generation dtype, and each row's
KV cache at the decode's mean context, in the dtype the backend decodes in: `hf`'s is `--dtype`) over `copy_bandwidth_gb_s`, the device's rate on a `--copy_mib` tensor copy
counting bytes read and written. `decode_vs_floor` is their ratio (1 would be a step at the copy rate). The floor
counts every row at every step: pass `--ignore_eos` (rows that end early make it an overestimate).

`weight_pass_tokens_per_s` is the other ceiling a decode step bound by its weight products can reach on
this machine: one `batch_size`-row product with every weight matrix (the input embedding excluded
unless tied to the output head), timed on the same device in the generation dtype through the
fastest kernel here, the one the hybrid engine uses by default (oneDNN-prepacked on CPU where
available, see training/cpu_linear.py; the same with `--disable_onednn_packing`, so runs compare).
`weight_pass_matmul_tokens_per_s` is the same pass through `torch.matmul`, the kernel the `hf`
backend's linear layers use. At small batches a decode step streams every weight once, so neither
backend can beat its kernel's ceiling by much.

`--transformers_forward_baseline` adds the hybrid engine decoding a Llama-family model through the model's own
transformers forward (`--disable_fused_decode`) beside it: what the fused decode path gains, in the same run.

`--kept_copy_variant` adds the hybrid engine keeping its inference copy between calls (`--keep_inference_copy`,
as step 3 can): its fastest call is one that loads the weights into the kept copy, reusing the decode graphs
captured over it, where the `hybrid` row builds the copy anew in every call.

`--static_compiled_baseline` adds transformers at its fastest beside them: a plain copy of the model on the
device (no ZeRO), `generate` with a static KV cache and its decode step compiled by `generate` itself
(torch.compile's "reduce-overhead" mode, `fullgraph`: CUDA graphs on a GPU). It runs once untimed first: the
compilation (`compile_seconds`) is paid once per process, not per rollout. On CUDA each backend's peak memory
(`peak_memory_gib`, allocated by PyTorch during its fastest run's call) is reported too.

The actor is a training engine, as in step 3: DeepSpeed gives its optimizer (never stepped here) its state at
`deepspeed.initialize` (at ZeRO-3 fp32 master partitions and a gradient buffer; at ZeRO-0 in bf16
`MasterWeightAdamW`'s fp32 masters). `--frozen_actor` builds it inference-only instead, as the reference model is
built (`create_frozen_engine`): the same weights, partitioned alike at ZeRO-3, and the same generation code.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import CompileConfig, PreTrainedTokenizerBase  # noqa: E402

from bench.common import device_name, provenance  # noqa: E402
from bench.decode_floor import (  # noqa: E402
    DecodeWork,
    copy_bandwidth_bytes_per_s,
    mean_decode_context,
    weight_pass_tokens_per_s,
)
from training.core.engine import (  # noqa: E402
    OptimizationSettings,
    create_frozen_engine,
    create_train_engine,
    load_frozen_causal_lm,
)
from training.core.lora import apply_lora  # noqa: E402
from training.core.model_loading import (  # noqa: E402
    EMBEDDED_MODEL_NAME,
    answer_stop_ids,
    folder_stop_ids,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
)
from training.core.sequences import answer_logprobs  # noqa: E402
from training.generation.generator import GenerationConfig, GenerationOutput, HFGenerator  # noqa: E402
from training.generation.hybrid_engine import HybridEngineSettings, build_generator  # noqa: E402
from utils.data import PromptFormatter  # noqa: E402
from utils.data.samples import KIND_PROMPTS, Sample  # noqa: E402
from utils.data.tokenization import TokenLimits, tokenize_samples  # noqa: E402
from utils.dist import current_device, init_distributed, is_main_process  # noqa: E402
from utils.errors import UserError, run_cli  # noqa: E402

STATIC_COMPILED = "hf_static_compiled"  # the backend name of --static_compiled_baseline
TRANSFORMERS_FORWARD = "hybrid_transformers_forward"  # the backend name of --transformers_forward_baseline
KEPT_COPY = "hybrid_kept_copy"  # the backend name of --kept_copy_variant
QUESTIONS = [
    "Explain how a reward model is trained from human preference pairs.",
    "Write a short poem about the sea at night.",
    "What are the main differences between Python lists and tuples?",
    "Give me three tips for learning to cook at home.",
    "Summarise the causes of the French Revolution.",
    "How does a transformer language model generate text one token at a time?",
    "Describe a good morning routine for a busy student.",
    "Why is the sky blue? Answer for a ten-year-old.",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL_NAME, help="model name or folder")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--prompt_length", type=int, default=64, help="longest prompt, in tokens")
    parser.add_argument("--context_tokens", type=int, default=0,
                        help="put this many tokens of text before each question (generation then runs at positions "
                             "past it: the bf16 numerics far from position 0); raise --prompt_length to keep them")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--zero_stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--generation_dtype", default=None, choices=("fp32", "bf16", "fp16"),
                        help="dtype of the hybrid engine's inference copy (default: --dtype)")
    parser.add_argument("--frozen_actor", action="store_true",
                        help="the actor as an inference-only DeepSpeed engine, no optimizer or gradient state, as "
                             "training/core/engine.create_frozen_engine makes the reference model (generation runs "
                             "the same code): what lets a 7B shape fit one GPU at ZeRO-3. ZeRO stage 0 or 3 only")
    parser.add_argument("--lora_dim", type=int, default=0)
    parser.add_argument("--do_sample", action="store_true", help="sample instead of greedy (outputs then differ)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature with --do_sample (log-probs are compared at it)")
    parser.add_argument("--ignore_eos", action="store_true",
                        help="always generate max_new_tokens (else an answer ends where step 3 ends it: the EOS, the "
                             "chat template's end-of-turn token, and any other id the model's generation config "
                             "stops at)")
    parser.add_argument("--tp_gather_partition_size", type=int, default=8)
    parser.add_argument("--disable_cuda_graph", action="store_true",
                        help="on GPU, do not capture the hybrid engine's decode step as a CUDA graph")
    parser.add_argument("--disable_onednn_packing", action="store_true",
                        help="on CPU, the hybrid engine keeps its linear weights plain (torch.matmul)")
    parser.add_argument("--transformers_forward_baseline", action="store_true",
                        help="also time the hybrid engine decoding a Llama-family model through its transformers "
                             "forward (--disable_fused_decode) instead of the fused one, in the same run")
    parser.add_argument("--kept_copy_variant", action="store_true",
                        help="also time the hybrid engine keeping its inference copy between calls "
                             "(--keep_inference_copy): each timed call after its first loads weights into it instead "
                             "of building it (and on a GPU capturing its graphs) again, in the same run")
    parser.add_argument("--static_compiled_baseline", action="store_true",
                        help="also time transformers' generate with a static cache and torch.compile on a plain copy")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs per backend, alternating; the fastest counts (the CPU is shared)")
    parser.add_argument("--copy_mib", type=int, default=512,
                        help="size of the tensor copied to measure the device's copy bandwidth (beyond its caches)")
    parser.add_argument("--output", default="bench_generation.json", help="where to write the JSON result")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise UserError(f"--repeats {args.repeats}: each backend needs at least one timed run; pass 1 or more")
    if args.frozen_actor and args.zero_stage in (1, 2):
        raise UserError(f"--frozen_actor with --zero_stage {args.zero_stage}: ZeRO-1 and 2 shard only optimizer state "
                        "and gradients, which a frozen actor has none of; pass --zero_stage 0 or 3")
    return args


def make_prompts(tokenizer, batch_size: int, prompt_length: int, context_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Questions made into prompts as step 3 makes its own (`tokenize_samples`: rendered by `PromptFormatter`, auto,
    with the tokenizer's special tokens where there is no chat template, left-truncated to `prompt_length` tokens
    keeping a lone BOS in front), each after `context_tokens` tokens of context text (the other questions, repeated);
    left-padded."""
    context = ""
    if context_tokens:
        passage = tokenizer(" ".join(QUESTIONS), add_special_tokens=False)["input_ids"]
        context = tokenizer.decode((passage * (context_tokens // len(passage) + 1))[:context_tokens]) + "\n\n"
    questions = [context + QUESTIONS[i % len(QUESTIONS)] + " Please be detailed." * (i // len(QUESTIONS))
                 for i in range(batch_size)]
    items = tokenize_samples([Sample(({"role": "user", "content": question},)) for question in questions],
                             KIND_PROMPTS, PromptFormatter(tokenizer), tokenizer,
                             TokenLimits(max_prompt_seq_len=prompt_length, prompt_overflow="left_truncate"))
    rows = [item["input_ids"].tolist() for item in items]
    width = max(len(r) for r in rows)
    ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(batch_size, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


@torch.no_grad()
def logprob_diff_vs_train_forward(module: torch.nn.Module, out: GenerationOutput,
                                  config: GenerationConfig) -> dict[str, float]:
    """Max and mean |reported log-prob - train forward's| over the generated tokens (at the sampling temperature,
    over the tokenizer's ids: the distribution `config` draws from, as step 3's trainer computes it)."""
    train_logprobs = answer_logprobs(module, out.sequences, out.attention_mask, out.prompt_length,
                                     config.logprob_temperature, tokenizer_size=config.tokenizer_size)
    diff = (train_logprobs - out.logprobs).abs()[out.answer_mask.bool()]
    return {"max": float(diff.max()), "mean": float(diff.mean())}


def with_lora(model: torch.nn.Module, lora_dim: int) -> torch.nn.Module:
    return apply_lora(model, lora_dim) if lora_dim else model


def build_actor(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> deepspeed.DeepSpeedEngine:
    """The actor's engine: by default a training engine, whose optimizer is never stepped but whose state DeepSpeed
    may allocate up front (ZeRO's fp32 partitions and gradient buffers; fp32 masters in half precision at ZeRO-0);
    with `--frozen_actor` an inference-only one."""
    if args.frozen_actor:
        model = load_frozen_causal_lm(args.model, tokenizer, args.dtype, args.zero_stage)
        return create_frozen_engine(with_lora(model, args.lora_dim), args.zero_stage, offload=False, dtype=args.dtype)
    settings = OptimizationSettings(learning_rate=1e-5, num_training_steps=1, zero_stage=args.zero_stage,
                                    dtype=args.dtype, micro_batch_size=args.batch_size, optimizer="torch_adamw")
    model = load_causal_lm(args.model, tokenizer, dtype=resolve_dtype(args.dtype), ds_config=settings.ds_config(),
                           disable_dropout_layers=True)
    return create_train_engine(with_lora(model, args.lora_dim), settings)


def static_compiled_generator(model_name: str, tokenizer, dtype: torch.dtype, device: torch.device) -> HFGenerator:
    """transformers' fastest generate, as transformers runs it: the whole model on the device, a static KV cache and
    the decode step compiled by `generate` itself (`CompileConfig`: torch.compile's "reduce-overhead" mode, CUDA graphs
    on a GPU, one graph). The prefill runs eagerly: that is where transformers allocates the static cache and marks
    it a static address; the older recipe of compiling `model.forward` whole allocates it inside the compiled
    prefill, unmarked (transformers skips the mark while compiling), and its decode steps then write tensors the
    CUDA graphs do not own. transformers compiles by itself only on accelerators; the flag it keeps for tests makes
    it compile on every device alike."""
    model = load_causal_lm(model_name, tokenizer, dtype=dtype, disable_dropout_layers=True).to(device).eval()
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True
    return HFGenerator(model, cache_implementation="static", compile_config=compile_config)


def bench_generation_config(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """The generation every backend runs: an answer ends where step 3's rollouts end it, at any token that ends the
    model's turn (`PromptFormatter.stop_token_ids`: the EOS, and a chat template's end-of-turn token where that is
    another) and any other id `--model`'s generation config stops at (`folder_stop_ids`), or nowhere with
    `--ignore_eos`."""
    stop_token_ids = -1 if args.ignore_eos else answer_stop_ids(PromptFormatter(tokenizer).stop_token_ids,
                                                                folder_stop_ids(args.model))
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        seed=0,
        eos_token_id=stop_token_ids,
        pad_token_id=tokenizer.pad_token_id,
        tokenizer_size=len(tokenizer),
    )


def decode_dtype(args: argparse.Namespace, backend: str) -> torch.dtype:
    """The dtype `backend` decodes in, whose bytes its floor counts: `hf` runs the engine's own model (`--dtype`),
    the others a copy in the generation dtype (the hybrid engine's inference copy, the static baseline's plain one)."""
    return resolve_dtype(args.dtype if backend == "hf" else args.generation_dtype or args.dtype)


def time_backend(generator, ids, mask, config) -> tuple[float, object, float | None]:
    """Seconds, output and, on CUDA, the peak GiB PyTorch allocated during the call."""
    cuda = torch.cuda.is_available() and current_device().type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    output = generator.generate(ids, mask, config)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, output, round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None


def decode_figures(seconds: float, first_step_seconds: float, output: GenerationOutput, work: DecodeWork,
                   copy_bandwidth: float) -> dict:
    """A backend's steady decode step (its run less its two-token run, over the run's decode steps after the first)
    beside the floor of such a step on this device (`work`'s bytes at `copy_bandwidth` bytes/s); None without such
    a step."""
    steps = output.answer_mask.shape[1] - 1
    if steps < 2:
        return {"first_step_seconds": first_step_seconds, "decode_steps": steps, "decode_step_s": None,
                "decode_floor_s": None, "decode_vs_floor": None}
    step_s = (seconds - first_step_seconds) / (steps - 1)
    context = mean_decode_context(output.prompt_length, steps, first_step=2)
    floor_s = work.step_bytes(output.sequences.shape[0], context) / copy_bandwidth
    return {"first_step_seconds": first_step_seconds, "decode_steps": steps, "decode_step_s": step_s,
            "decode_floor_s": floor_s, "decode_vs_floor": round(step_s / floor_s, 3)}


def beside_hybrid(results: dict, outputs: dict, backend: str, name: str) -> dict:
    """Another backend's run beside the hybrid engine's: its tokens/s, the hybrid's speedup over it, and whether the
    two decoded the same sequences (keys named after `name`)."""
    return {
        f"{name}_tokens_per_s": results[backend]["tokens_per_s"],
        f"speedup_vs_{name}": round(results["hybrid"]["tokens_per_s"] / results[backend]["tokens_per_s"], 2),
        f"identical_sequences_vs_{name}": bool(torch.equal(outputs["hybrid"].sequences.cpu(),
                                                           outputs[backend].sequences.cpu())),
    }


@run_cli
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    init_distributed()
    copy_bandwidth = copy_bandwidth_bytes_per_s(current_device(), args.copy_mib << 20)  # before the model is there
    tokenizer = load_tokenizer(args.model)
    engine = build_actor(args, tokenizer)
    generation_dtype = decode_dtype(args, "hybrid")
    work = DecodeWork.of(engine.module, generation_dtype)
    bound_tokens_per_s, matmul_bound_tokens_per_s = (
        round(weight_pass_tokens_per_s(engine.module, args.batch_size, generation_dtype, current_device(), pack), 2)
        for pack in (True, False))
    ids, mask = make_prompts(tokenizer, args.batch_size, args.prompt_length, args.context_tokens)
    config = bench_generation_config(args, tokenizer)
    hybrid_settings = HybridEngineSettings(enable=True, tp_gather_partition_size=args.tp_gather_partition_size,
                                           cuda_graph=not args.disable_cuda_graph,
                                           onednn_packing=not args.disable_onednn_packing,
                                           generation_dtype=args.generation_dtype)
    generators = {backend: build_generator(backend, engine, tokenizer, hybrid_settings) for backend in ("hybrid", "hf")}
    if args.transformers_forward_baseline:
        generators[TRANSFORMERS_FORWARD] = build_generator(
            "hybrid", engine, tokenizer, dataclasses.replace(hybrid_settings, fused_decode=False))
    if args.kept_copy_variant:
        generators[KEPT_COPY] = build_generator(
            "hybrid", engine, tokenizer, dataclasses.replace(hybrid_settings, keep_inference_copy=True))
    compile_seconds = None
    if args.static_compiled_baseline:
        generators[STATIC_COMPILED] = static_compiled_generator(args.model, tokenizer, generation_dtype, current_device())
        compile_seconds = round(time_backend(generators[STATIC_COMPILED], ids, mask, config)[0], 3)
    first_step_config = dataclasses.replace(config, max_new_tokens=2)
    runs: dict[str, list[tuple[float, float | None]]] = {backend: [] for backend in generators}
    first_step_runs: dict[str, list[float]] = {backend: [] for backend in generators}
    outputs = {}
    for _ in range(args.repeats):
        for backend, generator in generators.items():
            seconds, outputs[backend], peak = time_backend(generator, ids, mask, config)
            runs[backend].append((round(seconds, 3), peak))
            first_step_runs[backend].append(round(time_backend(generator, ids, mask, first_step_config)[0], 3))
    results = {}
    for backend, timed in runs.items():
        tokens = int(outputs[backend].answer_mask.sum())
        seconds, peak = min(timed, key=lambda run: run[0])
        results[backend] = {"seconds": seconds, "runs_seconds": [s for s, _ in timed], "tokens": tokens,
                            "tokens_per_s": round(tokens / seconds, 2), "peak_memory_gib": peak,
                            **decode_figures(seconds, min(first_step_runs[backend]), outputs[backend],
                                             DecodeWork.of(engine.module, decode_dtype(args, backend)),
                                             copy_bandwidth)}
    fast = outputs["hybrid"]
    logprob_error = {backend: logprob_diff_vs_train_forward(engine.module, out, config)
                     for backend, out in outputs.items()}
    summary = {
        **provenance(device_name(current_device())),
        "model": args.model,
        "zero_stage": args.zero_stage,
        "frozen_actor": args.frozen_actor,
        "dtype": args.dtype,
        "generation_dtype": args.generation_dtype or args.dtype,
        "batch_size": args.batch_size,
        "prompt_tokens": int(ids.shape[1]),
        "max_new_tokens": args.max_new_tokens,
        "lora_dim": args.lora_dim,
        "do_sample": args.do_sample,
        "temperature": config.logprob_temperature,
        "cuda_graph": hybrid_settings.cuda_graph,
        "onednn_packing": hybrid_settings.onednn_packing,
        "hybrid_decode_path": getattr(generators["hybrid"], "decode_path", None),
        "repeats": args.repeats,
        "hybrid_tokens_per_s": results["hybrid"]["tokens_per_s"],
        "hf_tokens_per_s": results["hf"]["tokens_per_s"],
        "speedup": round(results["hybrid"]["tokens_per_s"] / results["hf"]["tokens_per_s"], 2),
        "weight_pass_tokens_per_s": bound_tokens_per_s,
        "weight_pass_matmul_tokens_per_s": matmul_bound_tokens_per_s,
        "hybrid_share_of_weight_pass": round(results["hybrid"]["tokens_per_s"] / bound_tokens_per_s, 3),
        "hf_share_of_weight_pass": round(results["hf"]["tokens_per_s"] / bound_tokens_per_s, 3),
        "copy_bandwidth_gb_s": round(copy_bandwidth / 1e9, 2),
        "decode_weight_bytes": work.weight_bytes,
        "decode_kv_bytes_per_token": work.kv_bytes_per_token,
        "backends": results,
        "identical_sequences": bool(torch.equal(fast.sequences, outputs["hf"].sequences)),
        **({**beside_hybrid(results, outputs, STATIC_COMPILED, "static_compiled"), "compile_seconds": compile_seconds}
           if args.static_compiled_baseline else {}),
        **({**beside_hybrid(results, outputs, TRANSFORMERS_FORWARD, "transformers_forward"),
            "transformers_forward_decode_path": generators[TRANSFORMERS_FORWARD].decode_path}
           if args.transformers_forward_baseline else {}),
        **(beside_hybrid(results, outputs, KEPT_COPY, "kept_copy") if args.kept_copy_variant else {}),
        # on a GPU, the compiled steps (the baseline's, the transformers-forward path's) that ran without CUDA graphs
        "torch_compile_cudagraph_skips": counters["inductor"]["cudagraph_skips"]
        if current_device().type == "cuda" else None,
        "max_logprob_diff_vs_train_forward": {backend: error["max"] for backend, error in logprob_error.items()},
        "mean_logprob_diff_vs_train_forward": {backend: error["mean"] for backend, error in logprob_error.items()},
    }
    if is_main_process():
        print(f"{'backend':<27} {'seconds':>9} {'tokens':>7} {'tokens/s':>9} {'decode ms':>10} {'floor ms':>9} "
              f"{'x floor':>8}")
        for backend, row in results.items():
            decode = (f"{row['decode_step_s'] * 1e3:>10.3f} {row['decode_floor_s'] * 1e3:>9.3f} "
                      f"{row['decode_vs_floor']:>8.2f}" if row["decode_step_s"] is not None else "")
            print(f"{backend:<27} {row['seconds']:>9.2f} {row['tokens']:>7d} {row['tokens_per_s']:>9.2f} {decode}")
        print(f"speedup {summary['speedup']}x; identical sequences: {summary['identical_sequences']}; "
              f"|logprob - train forward| max / mean: hybrid {logprob_error['hybrid']['max']:.2e} / "
              f"{logprob_error['hybrid']['mean']:.2e}, hf {logprob_error['hf']['max']:.2e} / {logprob_error['hf']['mean']:.2e}")
        if args.static_compiled_baseline:
            print(f"hybrid vs transformers' static cache + torch.compile: {summary['speedup_vs_static_compiled']}x "
                  f"(compiled in {compile_seconds:.1f} s); identical sequences: "
                  f"{summary['identical_sequences_vs_static_compiled']}")
        if args.transformers_forward_baseline:
            print(f"hybrid ({summary['hybrid_decode_path']}) vs its transformers forward: "
                  f"{summary['speedup_vs_transformers_forward']}x; identical sequences: "
                  f"{summary['identical_sequences_vs_transformers_forward']}")
        if args.kept_copy_variant:
            print(f"hybrid building its inference copy per call vs keeping it (--keep_inference_copy): "
                  f"{summary['speedup_vs_kept_copy']}x; identical sequences: "
                  f"{summary['identical_sequences_vs_kept_copy']}")
        print(f"weight-streaming ceiling {summary['weight_pass_tokens_per_s']:.2f} tokens/s "
              f"({summary['weight_pass_matmul_tokens_per_s']:.2f} with torch.matmul): hybrid reaches "
              f"{summary['hybrid_share_of_weight_pass']:.0%}, hf {summary['hf_share_of_weight_pass']:.0%}")
        print(f"decode floor: {work.weight_bytes / 1e9:.3f} GB of weights and {work.kv_bytes_per_token} KV bytes per "
              f"cached token a step, at a copy bandwidth of {summary['copy_bandwidth_gb_s']} GB/s")
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
