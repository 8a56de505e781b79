"""The hybrid engine: the actor's DeepSpeed engine switched between training and fast generation.

Train mode is the ZeRO engine as it is. Generate mode (`HybridEngine.generate_mode()`):
1. builds a plain inference copy of the model (same architecture, constructed on the meta device,
   then materialised) and loads the actor's weights into it, gathering ZeRO-3 partitions one bounded
   group of decoder layers at a time (`tp_gather_partition_size`), with LoRA adapters folded into the
   copied weights (W + scale * B @ A) in fp32 and, in half precision, kept beside them and added to each
   adapted projection's output as the training forward adds them (`lora_terms.py`: folded into bf16 weights they
   would be rounded to the weights' precision); the training weights are never merged in place;
2. with `inference_tp_size > 1`, the copy holds only this rank's tensor-parallel shard, and the ranks
   of a tensor-parallel group decode their prompts together (`tensor_parallel.py`);
3. decodes with `KVCacheDecoder` (one preallocated KV cache, finished rows leave the batch), through
   `FusedLlama` for Llama-family models (unless `--disable_fused_decode`) and the copy's own transformers forward
   for the others; on
   CPU the copy's linear weights are prepacked for oneDNN (`cpu_linear.py`).
Leaving generate mode drops the copy (and, with `release_inference_cache`, the KV cache); the
engine's module is never modified, and its train/eval flags are left as they were. With `keep_inference_copy` the
copy and its decode path stay between rollouts instead: each rollout loads the actor's weights into the same
tensors (the fused Llama path's projections are views of its fused weights, so they land there too), so nothing is
built again and, on a GPU, the decode graphs captured (or the transformers-forward step compiled) over those
addresses keep serving; the copy is held during training meanwhile.

With `unpin_actor_parameters` no copy is built: the decoder runs on the engine's own module, whose
ZeRO-3 hooks gather each layer at every step (less memory, slower), as DeepSpeed-Chat's flag does.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field
from typing import Iterator

import deepspeed
import torch
import torch.distributed as torch_dist

from training.core.model_loading import resolve_dtype
from training.core.zero import full_numel, is_zero3_module
from training.generation.cpu_linear import pack_linear_layers
from training.generation.fast_decoder import (
    FusedCachedModel,
    HFCachedModel,
    KVCacheDecoder,
    RolloutKVCache,
    StepModel,
)
from training.generation.fused_llama import FusedLlama, fused_llama_unsupported_reason
from training.generation.lora_terms import LoRATerm, add_lora_terms
from training.generation.generator import (
    FinishedRowsHook,
    GenerationConfig,
    GenerationOutput,
    Generator,
    HFGenerator,
    eval_mode,
)
from training.generation.tensor_parallel import (
    TensorParallelGroup,
    TensorParallelPlan,
    gather_tp_shard,
)
from utils.dist import current_device, get_world_size
from utils.errors import UserError, refuse_wrong

logger = logging.getLogger(__name__)

BACKENDS = ("hybrid", "hf")
_PEFT_PREFIX = "base_model.model."


@dataclass
class HybridEngineSettings:
    """How rollouts are generated (the step-3 flags; `enable` is `--enable_hybrid_engine`)."""

    enable: bool = field(default=False, metadata={
        "flag": "enable_hybrid_engine",
        "help": "generate rollouts with the hybrid engine instead of plain generate()"})
    generation_backend: str | None = field(default=None, metadata={
        "choices": BACKENDS, "help": "override the backend: 'hybrid' (default with --enable_hybrid_engine) or 'hf'"})
    inference_tp_size: int = field(default=1, metadata={
        "help": "split generation tensor-parallel across this many ranks (Llama-style models)"})
    tp_gather_partition_size: int = field(default=8, metadata={
        "help": "decoder layers gathered at once when loading ZeRO-3 weights for generation"})
    release_inference_cache: bool = field(default=False, metadata={
        "same_result": True, "help": "free the KV cache after every rollout instead of keeping it for the next one"})
    keep_inference_copy: bool = field(default=False, metadata={
        "same_result": True,
        "help": "keep the inference copy between rollouts, loading each rollout's weights into it in place: no "
                "rebuild, and on a GPU no new capture of the decode graphs per rollout, for one more copy of the "
                "model in the generation dtype held during training"})
    unpin_actor_parameters: bool = field(default=False, metadata={
        "help": "do not gather a full inference copy of the actor; generate through ZeRO-3 hooks (less memory, slower)"})
    fused_decode: bool = field(default=True, metadata={
        "flag": "disable_fused_decode", "negated": True,
        "help": "decode Llama-family models (llama, mistral, qwen2, qwen3) through their transformers forward instead "
                "of the fused one"})
    cuda_graph: bool = field(default=True, metadata={
        "flag": "disable_cuda_graph", "negated": True, "same_result": True,
        "help": "on GPU, do not capture the decode step as a CUDA graph"})
    onednn_packing: bool = field(default=True, metadata={
        "flag": "disable_onednn_packing", "negated": True,
        "help": "on CPU, keep the inference copy's linear weights plain (torch.matmul) instead of prepacking them for "
                "oneDNN"})
    generation_dtype: str | None = field(default=None, metadata={
        "choices": ("bf16", "fp16", "fp32"), "help": "dtype of the inference copy (default: the training dtype)"})

    @property
    def backend(self) -> str:
        """`generation_backend`, else 'hybrid' with `enable` and 'hf' without."""
        if self.generation_backend is not None:
            return self.generation_backend
        return "hybrid" if self.enable else "hf"

    def check_flags(self) -> None:
        """Refuse flag combinations the hybrid engine cannot run (`Step3Settings.check_flags` calls it before
        anything loads; the engine, when it is built), every refusal at once."""
        refuse_wrong(
            (self.unpin_actor_parameters and (self.inference_tp_size > 1 or self.keep_inference_copy),
             ("--inference_tp_size > 1 and --keep_inference_copy need the gathered inference copy; drop "
              "--unpin_actor_parameters")),
            (self.tp_gather_partition_size < 1,  # it was taken as 1
             (f"--tp_gather_partition_size must be at least 1 (decoder layers gathered at once), got "
              f"{self.tp_gather_partition_size}")))

    def generation_dtype_here(self) -> torch.dtype | None:
        """`--generation_dtype` as this device computes it (None: the training dtype); a `UserError` where the
        device cannot (fp16 on a CPU)."""
        return resolve_dtype(self.generation_dtype, "--generation_dtype") if self.generation_dtype else None


def build_generator(backend: str, engine: torch.nn.Module, tokenizer, settings: HybridEngineSettings) -> Generator:
    """The generator for `backend`; a model the hybrid engine cannot serve falls back to `hf`, loudly."""
    if backend not in BACKENDS:
        raise UserError(f"unknown generation backend {backend!r}; choose one of {BACKENDS}")
    if backend == "hf":
        return HFGenerator(engine)
    reason = unsupported_reason(getattr(engine, "module", engine), settings)
    if reason is not None:
        logger.warning("hybrid engine cannot serve this model (%s); falling back to the 'hf' generation backend", reason)
        return HFGenerator(engine)
    return HybridEngine(engine, settings)


def _is_peft(module: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(module, PeftModel)


def _base_model(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_model() if _is_peft(module) else module


def _peft_reason(module: torch.nn.Module) -> str | None:
    from peft.tuners.lora import LoraLayer

    for config in module.peft_config.values():
        if getattr(config, "peft_type", None) is None or config.peft_type.value != "LORA":
            return f"peft adapter type {config.peft_type} (only LoRA is merged)"
    for name, sub in module.named_modules():
        if isinstance(sub, LoraLayer):
            if any(sub.use_dora.get(a, False) for a in sub.active_adapters) or len(sub.lora_embedding_A):
                return f"DoRA or embedding LoRA at {name}"
        elif "modules_to_save" in name:
            return "peft modules_to_save"
    return None


def unsupported_reason(module: torch.nn.Module, settings: HybridEngineSettings) -> str | None:
    """Why the hybrid engine cannot generate for this module, or None when it can."""
    from transformers import GenerationMixin, PreTrainedModel

    base = _base_model(module)
    if not isinstance(base, PreTrainedModel) or not isinstance(base, GenerationMixin):
        return f"{type(base).__name__} is not a transformers causal LM"
    if _is_peft(module) and (reason := _peft_reason(module)) is not None:
        return reason
    if settings.inference_tp_size > 1:
        return TensorParallelPlan.unsupported_reason(base, settings.inference_tp_size)
    return None


@dataclass
class _Entry:
    """One parameter of the inference copy and where its value comes from in the training module."""

    target_name: str
    source: torch.nn.Parameter
    lora_layer: torch.nn.Module | None = None
    lora_params: list[torch.nn.Parameter] = field(default_factory=list)

    @property
    def layer_name(self) -> str:
        """The name of the module holding the parameter (an adapted projection's, for its `lora_layer` weight)."""
        return self.target_name.rpartition(".")[0]


def _active_lora(layer: torch.nn.Module) -> list[str]:
    if layer.disable_adapters or layer.merged:
        return []
    return [a for a in layer.active_adapters if a in layer.lora_A]


def _lora_factors(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rank, in] and B * scaling [out, rank] of the active adapters (`LoRATerm`'s layout; B in fp32)."""
    adapters = _active_lora(layer)
    return (torch.cat([layer.lora_A[a].weight for a in adapters]),
            torch.cat([layer.lora_B[a].weight.float() * layer.scaling[a] for a in adapters], dim=1))


def _lora_delta(layer: torch.nn.Module) -> torch.Tensor | None:
    """scale * B @ A summed over active adapters, in the weight's layout (fp32)."""
    delta = None
    for adapter in _active_lora(layer):
        product = layer.lora_B[adapter].weight.float() @ layer.lora_A[adapter].weight.float()
        if layer.fan_in_fan_out:
            product = product.T
        product = product * layer.scaling[adapter]
        delta = product if delta is None else delta + product
    return delta


class WeightSource:
    """The training module's parameters, named as the plain model's, in bounded gather groups."""

    def __init__(self, module: torch.nn.Module, partition_size: int):
        self.module = module
        self.partition_size = partition_size
        peft = _is_peft(module)
        self.entries: list[_Entry] = []
        for name, param in module.named_parameters():
            if ".lora_" in name:
                continue
            target = name[len(_PEFT_PREFIX):] if peft and name.startswith(_PEFT_PREFIX) else name
            entry = _Entry(target.replace(".base_layer.", "."), param)
            if ".base_layer." in name and name.endswith(".weight"):
                layer = module.get_submodule(name.rsplit(".base_layer.", 1)[0])
                entry.lora_layer = layer
                entry.lora_params = [p for a in _active_lora(layer) for p in
                                     (layer.lora_A[a].weight, layer.lora_B[a].weight)]
            self.entries.append(entry)
        self.buffers = {
            (n[len(_PEFT_PREFIX):] if peft and n.startswith(_PEFT_PREFIX) else n): b for n, b in module.named_buffers()
        }
        self.layers_prefix = _decoder_layers_prefix(_base_model(module))

    def lora_shapes(self, plan: TensorParallelPlan | None) -> dict[str, tuple[int, int, int]]:
        """(rank, in, out) of each adapted projection's active adapters (as `plan` splits them, given one), by the
        projection's name in the plain model."""
        shapes = {}
        for entry in self.entries:
            if entry.lora_params:
                layer = entry.lora_layer
                out, inputs = layer.out_features, layer.in_features
                if plan is not None and plan.is_sharded(entry.target_name):
                    out, inputs = plan.shard_shape(entry.target_name, torch.Size([out, inputs]))
                shapes[entry.layer_name] = (sum(layer.r[a] for a in _active_lora(layer)), inputs, out)
        return shapes

    def groups(self) -> list[list[_Entry]]:
        """Non-layer parameters first, then `partition_size` decoder layers per group."""
        grouped: dict[int, list[_Entry]] = {}
        for entry in self.entries:
            key = -1
            if self.layers_prefix and entry.target_name.startswith(self.layers_prefix + "."):
                key = int(entry.target_name[len(self.layers_prefix) + 1:].split(".")[0]) // self.partition_size
            grouped.setdefault(key, []).append(entry)
        return [grouped[k] for k in sorted(grouped)]


def _decoder_layers_prefix(model: torch.nn.Module) -> str | None:
    """Name of the ModuleList holding the decoder layers (the one with the most parameters)."""
    best, best_size = None, 0
    for name, sub in model.named_modules():
        if isinstance(sub, torch.nn.ModuleList) and len(sub) > 0:
            size = sum(full_numel(p) for p in sub.parameters())
            if size > best_size:
                best, best_size = name, size
    return best


def _ties_output_to_input(model: torch.nn.Module) -> bool:
    """Whether the model's output head is its input embedding (one parameter)."""
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    return output is not None and inputs is not None and output.weight is inputs.weight


def _training_dtype(module: torch.nn.Module) -> torch.dtype:
    return next(p for p in module.parameters() if p.is_floating_point()).dtype


class InferenceCopy:
    """A plain, non-partitioned copy of the base model (optionally one tensor-parallel shard). LoRA adapters are
    folded into its weights, or, given `lora_shapes` (the adapted projections' (rank, in, out)), kept beside them as
    `lora_terms` (`lora_terms.py`), which the decode path adds."""

    def __init__(self, base: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 plan: TensorParallelPlan | None, lora_shapes: dict[str, tuple[int, int, int]] | None = None):
        config = copy.deepcopy(base.config)
        # tied as the training model is, not as its config says: transformers keeps a checkpoint's distinct output
        # head although the config asks to tie it, and a tied copy then has no lm_head to load it into
        config.tie_word_embeddings = _ties_output_to_input(base)
        with torch.device("meta"):
            model = type(base)(config)
        model.to(dtype)
        if plan is not None:
            plan.shard_skeleton(model)
        model.to_empty(device=device)
        model.tie_weights()
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.plan = plan
        self.device = device
        self.lora_terms = {name: LoRATerm.empty(*shape, dtype=dtype, device=device)
                           for name, shape in (lora_shapes or {}).items()}

    @torch.no_grad()
    def load_from(self, source: WeightSource) -> None:
        """Copy (gather, merge, shard) every parameter group by group; buffers are never partitioned."""
        targets = dict(self.model.named_parameters())
        loaded: set[str] = set()
        for group in source.groups():
            sharded = {e.target_name for e in group if self.plan is not None and self.plan.is_sharded(e.target_name)}
            gathered = [p for e in group for p in ([] if e.target_name in sharded else [e.source]) + e.lora_params]
            with deepspeed.zero.GatheredParameters(gathered, modifier_rank=None):
                for entry in group:
                    targets[entry.target_name].copy_(self._value(entry, entry.target_name in sharded))
                    loaded.add(entry.target_name)
                    term = self.lora_terms.get(entry.layer_name) if entry.lora_layer is not None else None
                    if term is not None:
                        lora_a, lora_b = _lora_factors(entry.lora_layer)
                        if self.plan is not None:
                            lora_a, lora_b = self.plan.shard_lora(entry.target_name, lora_a, lora_b)
                        term.A.copy_(lora_a)
                        term.B.copy_(lora_b)
        self._load_buffers(source.buffers)
        missing = set(targets) - loaded
        if missing:
            raise RuntimeError(f"inference copy parameters not loaded: {sorted(missing)[:5]}")

    def _load_buffers(self, sources: dict[str, torch.Tensor]) -> None:
        """Each buffer as the training module holds it, in its dtype too: the copy was cast to the generation
        dtype whole, but transformers keeps e.g. RoPE's `inv_freq` in fp32 under a bf16 model, and rounding
        it to bf16 moves every rotary angle (3e-3 relative error: a different next-token distribution at
        positions in the hundreds). A buffer already of that dtype and shape is written in place (a kept copy keeps
        its addresses)."""
        for name, current in list(self.model.named_buffers()):
            if name in sources:
                source = sources[name].detach()
                if current.dtype == source.dtype and current.shape == source.shape:
                    current.copy_(source)
                    continue
                owner_name, _, leaf = name.rpartition(".")
                owner = self.model.get_submodule(owner_name) if owner_name else self.model
                setattr(owner, leaf, source.to(self.device, copy=True))

    def _value(self, entry: _Entry, sharded: bool) -> torch.Tensor:
        folded = entry.lora_layer is not None and entry.layer_name not in self.lora_terms
        delta = _lora_delta(entry.lora_layer) if folded else None
        if sharded:
            value = gather_tp_shard(entry.source, self.plan, entry.target_name)
        else:
            value = entry.source.data
        if delta is not None:
            value = value.float() + (self.plan.shard(entry.target_name, delta) if sharded else delta)
        if self.plan is not None and not sharded:
            value = self.plan.shard(entry.target_name, value)
        return value


class HybridEngine:
    """Switches a DeepSpeed engine's actor between training and fast generation (see module doc)."""

    def __init__(self, engine: torch.nn.Module, settings: HybridEngineSettings):
        settings.check_flags()
        self.engine = engine
        self.module = getattr(engine, "module", engine)
        self.settings = settings
        self.device = current_device()
        self.dtype = settings.generation_dtype_here() or _training_dtype(self.module)
        self.tp = TensorParallelGroup.create(settings.inference_tp_size) if settings.inference_tp_size > 1 else None
        self.kv_cache = RolloutKVCache()
        self._decoder: KVCacheDecoder | None = None
        self._kept: tuple[InferenceCopy, StepModel] | None = None  # with keep_inference_copy, after the first rollout
        self._decode_path: str | None = None  # how the last generate mode decoded
        self._described = False  # the decode path is logged on the first entry into generate mode

    @property
    def decode_path(self) -> str | None:
        """How the last generate mode decoded, e.g. "fused Llama (CUDA graphs)"."""
        return self._decode_path

    @property
    def in_generate_mode(self) -> bool:
        return self._decoder is not None

    @property
    def logprobs_match_training(self) -> bool:
        """Whether a rollout's log-probs equal the training forward's within fp32 rounding (tested to 1e-4 in
        tests/test_hybrid_engine.py): an fp32 copy of an fp32 model. A half-precision copy decodes through other
        kernels, whose rounding moves log-probs by up to ~5e-2 (its parity tests' tolerance)."""
        return self.dtype == torch.float32 and _training_dtype(self.module) == torch.float32

    @contextlib.contextmanager
    def generate_mode(self) -> Iterator["HybridEngine"]:
        """Generate mode for the block: weights gathered (and merged) once for every `generate` in it."""
        if self._decoder is not None:
            yield self
            return
        with contextlib.ExitStack() as stack:
            self._decoder = self._enter(stack)
            step_model = self._decoder.model
            try:
                yield self
            finally:
                # nothing of this generate mode is held past it but a kept copy: the step model holds the inference
                # copy and views of the KV cache, which would outlive the training phase and a released cache
                self._decode_path = ("transformers forward of the engine's own module (unpinned)"
                                     if self.settings.unpin_actor_parameters else step_model.description)
                self._decoder = step_model = None
                if self.settings.release_inference_cache:
                    self.release_cache()

    @property
    def streams_finished_rows(self) -> bool:
        """Whether `generate` can hand over rows as they end (`on_finished`): not when tensor-parallel ranks decode
        their batches together."""
        return self.tp is None

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerationConfig,
                 on_finished: FinishedRowsHook | None = None) -> GenerationOutput:
        """Answers to a left-padded prompt batch; `on_finished` receives rows as they end (`FinishedRowsHook`)."""
        with self.generate_mode():
            if self.tp is not None:
                if on_finished is not None:
                    raise ValueError("on_finished needs a generator that decodes alone (inference_tp_size 1)")
                return self.tp.generate_together(self._decoder, input_ids, attention_mask, config)
            return self._decoder.decode(input_ids, attention_mask, config, on_finished)

    def _enter(self, stack: contextlib.ExitStack) -> KVCacheDecoder:
        if self.settings.unpin_actor_parameters:
            stack.enter_context(eval_mode(self.module))
            collective = get_world_size() > 1 and is_zero3_module(self.module)
            return KVCacheDecoder(HFCachedModel(self.module, self.kv_cache), self.device, no_grad_only=True,
                                  sync_done=_all_ranks_done if collective else None)
        if self._kept is not None:
            inference_copy, step_model = self._kept
            inference_copy.load_from(WeightSource(self.module, self.settings.tp_gather_partition_size))
            step_model.refresh()
        else:
            inference_copy, step_model = self._build()
            if self.settings.keep_inference_copy:
                self._kept = inference_copy, step_model
        return KVCacheDecoder(step_model, self.device,
                              sync_tokens=self.tp.broadcast_tokens if self.tp is not None else None)

    def _build(self) -> tuple[InferenceCopy, StepModel]:
        """A new inference copy loaded with the actor's weights, and the decode path over it."""
        base = _base_model(self.module)
        plan = TensorParallelPlan(base, self.tp) if self.tp is not None else None
        source = WeightSource(self.module, self.settings.tp_gather_partition_size)
        # LoRA folded in fp32, where that is exact enough; beside the weights in half precision
        lora_apart = self.dtype != torch.float32
        inference_copy = InferenceCopy(base, self.dtype, self.device, plan,
                                       source.lora_shapes(plan) if lora_apart else None)
        inference_copy.load_from(source)
        model = inference_copy.model
        # a tensor-parallel shard's projections all-reduce inside the step, which its graph would have to capture
        graphs = self.settings.cuda_graph and self.device.type == "cuda" and self.tp is None
        if self.settings.fused_decode and fused_llama_unsupported_reason(model) is None:
            step_model = FusedCachedModel(FusedLlama(model, pack=self.settings.onednn_packing,
                                                     lora_terms=inference_copy.lora_terms), self.kv_cache,
                                          cuda_graph=graphs)
            packed = sum(w.packed for w in step_model.fused.linear_weights())
        else:
            packed = pack_linear_layers(model, keep_weights=self.settings.keep_inference_copy) \
                if self.settings.onednn_packing else 0
            add_lora_terms(model, inference_copy.lora_terms)
            step_model = HFCachedModel(model, self.kv_cache, compiled=graphs)
        if not self._described:
            logger.info("hybrid engine: %s decode path on %s, %s, %d linear weights prepacked for oneDNN",
                        step_model.description, self.device, self.dtype, packed)
            self._described = True
        return inference_copy, step_model

    def release_cache(self) -> None:
        """Free the KV cache kept between rollouts."""
        if self._kept is not None:
            self._kept[1].forget_cache()
        self.kv_cache.release()


def _all_ranks_done(local_done: bool) -> bool:
    flag = torch.tensor([0 if local_done else 1], dtype=torch.int32, device=current_device())
    torch_dist.all_reduce(flag)
    return int(flag.item()) == 0
