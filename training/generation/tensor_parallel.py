"""Tensor-parallel generation for the hybrid engine (`--inference_tp_size N`).

Ranks are grouped N consecutive ranks at a time. In a group, each rank holds one shard of every
attention and MLP projection (Megatron-style: q/k/v and gate/up split by output rows, o/down split by
input columns and summed with an all-reduce inside the layer, a `ReducedLinear`: in fp32, rounded once after the
sum as the whole product is); norms, embeddings and the LM head stay whole. In half precision, LoRA adapters stay
beside the shards (`lora_terms.py`), split with them: B by rows for a column-parallel projection, A by columns for a
row-parallel one. The ranks of a group decode their prompts as one batch and share every drawn token.

Under ZeRO-3 a rank fetches only the part of each sharded weight it needs: the shard is a set of flat
indices into the weight, ZeRO-3 keeps the flat weight split in contiguous partitions across ranks, so
each rank sends every other rank exactly the elements of its partition that rank's shard contains
(point-to-point), instead of all-gathering the whole matrix.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from training.core.zero import is_zero3_param
from training.generation.cpu_linear import ReducedLinear
from training.generation.fast_decoder import KVCacheDecoder
from training.generation.generator import (
    GenerationConfig,
    GenerationOutput,
    assemble_output,
    repeat_per_prompt,
)
from utils.dist import get_rank, get_world_size
from utils.errors import UserError

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class TensorParallelGroup:
    """This rank's tensor-parallel group: N consecutive ranks that decode one joint batch."""

    _groups: dict[int, "TensorParallelGroup"] = {}

    def __init__(self, size: int, group: dist.ProcessGroup, ranks: list[int]):
        self.size = size
        self.group = group
        self.ranks = ranks
        self.rank = ranks.index(get_rank())

    @classmethod
    def create(cls, size: int) -> "TensorParallelGroup":
        """Every rank must call this (new_group is collective); groups are made once per size."""
        if size in cls._groups:
            return cls._groups[size]
        world = get_world_size()
        if size < 1 or world % size:
            raise UserError(f"--inference_tp_size {size} must divide the number of ranks ({world})")
        mine = None
        for start in range(0, world, size):
            ranks = list(range(start, start + size))
            group = dist.new_group(ranks)
            if get_rank() in ranks:
                mine = cls(size, group, ranks)
        cls._groups[size] = mine
        return mine

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def broadcast_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tokens, src=self.leader, group=self.group)
        return tokens

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (the row-parallel projections' partial outputs)."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        pieces = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self.group)
        return pieces

    def generate_together(
        self, decoder: KVCacheDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: GenerationConfig
    ) -> GenerationOutput:
        """Decode the group's prompts as one batch (left-padded to a common length) and keep this rank's rows
        (with K continuations per prompt, the K rows of each of its prompts: the joint output is prompt-major)."""
        # NCCL gathers device tensors only
        input_ids, attention_mask = input_ids.to(decoder.device), attention_mask.to(decoder.device)
        batch, prompt_len = input_ids.shape
        sizes = self._all_gather(torch.tensor([batch, prompt_len], dtype=torch.long, device=decoder.device))
        max_batch = max(int(s[0]) for s in sizes)
        max_len = max(int(s[1]) for s in sizes)
        padded_ids = input_ids.new_full((max_batch, max_len), config.pad_token_id)
        padded_mask = attention_mask.new_zeros((max_batch, max_len))
        padded_ids[:batch, max_len - prompt_len:] = input_ids
        padded_mask[:batch, max_len - prompt_len:] = attention_mask
        all_ids, all_masks = self._all_gather(padded_ids), self._all_gather(padded_mask)
        counts = [int(s[0]) for s in sizes]
        joint = decoder.decode(
            torch.cat([ids[:n] for ids, n in zip(all_ids, counts)]),
            torch.cat([mask[:n] for mask, n in zip(all_masks, counts)]),
            config,
        )
        per_prompt = config.num_return_sequences
        first = sum(counts[: self.rank]) * per_prompt
        mine = slice(first, first + batch * per_prompt)
        return assemble_output(
            repeat_per_prompt(input_ids, per_prompt),
            repeat_per_prompt(attention_mask, per_prompt),
            joint.answers[mine].to(input_ids.device),
            joint.logprobs[mine],
            joint.answer_mask[mine],
            config.pad_token_id,
        )


class TensorParallelPlan:
    """Which parameters of a Llama-style model are split, along which dimension, for one rank."""

    def __init__(self, model: torch.nn.Module, group: TensorParallelGroup):
        self.group = group
        self.size = group.size
        self.rank = group.rank

    @staticmethod
    def unsupported_reason(model: torch.nn.Module, size: int) -> str | None:
        config = model.config
        if getattr(config, "model_type", None) not in _SUPPORTED_MODEL_TYPES:
            return f"tensor-parallel generation supports {_SUPPORTED_MODEL_TYPES}, not {config.model_type!r}"
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        for what, count in (("attention heads", heads), ("key/value heads", kv_heads),
                            ("intermediate size", config.intermediate_size)):
            if count % size:
                return f"{what} ({count}) not divisible by --inference_tp_size {size}"
        return None

    @staticmethod
    def _kind(name: str) -> tuple[str | None, str]:
        """('column'|'row'|None, 'weight'|'bias') for a parameter name."""
        module, _, leaf = name.rpartition(".")
        proj = module.rpartition(".")[2]
        if proj in _COLUMN_PARALLEL:
            return "column", leaf
        if proj in _ROW_PARALLEL:
            return "row", leaf
        return None, leaf

    def is_sharded(self, name: str) -> bool:
        kind, leaf = self._kind(name)
        return kind == "column" or (kind == "row" and leaf == "weight")

    def _dim(self, name: str) -> int:
        return 0 if self._kind(name)[0] == "column" else 1

    def shard_shape(self, name: str, shape: torch.Size) -> torch.Size:
        dim = self._dim(name)
        return torch.Size(s // self.size if d == dim else s for d, s in enumerate(shape))

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full tensor (a row-parallel bias stays whole: it is added after the sum)."""
        if not self.is_sharded(name):
            return full
        dim = self._dim(name)
        step = full.shape[dim] // self.size
        return full.narrow(dim, self.rank * step, step)

    def shard_lora(self, name: str, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the LoRA factors A [rank, in] and B [out, rank] adapting the weight `name`: a
        column-parallel shard's output rows are B's rows; a row-parallel shard's input columns are A's columns
        (its x_r @ A_r.T is then summed over the group with the product: `reduced_linear`)."""
        if not self.is_sharded(name):
            return lora_a, lora_b
        if self._kind(name)[0] == "column":
            return lora_a, self.shard(name, lora_b)
        return self.shard(name, lora_a), lora_b

    def flat_indices(self, name: str, shape: torch.Size, tp_rank: int) -> torch.Tensor:
        """Ascending flat indices of `tp_rank`'s shard within the full tensor of `shape`."""
        dim = self._dim(name)
        step = shape[dim] // self.size
        if dim == 0:
            inner = int(torch.Size(shape[1:]).numel())
            return torch.arange(tp_rank * step * inner, (tp_rank + 1) * step * inner)
        rows, cols = shape[0], shape[1]
        return (torch.arange(rows)[:, None] * cols + torch.arange(tp_rank * step, (tp_rank + 1) * step)[None, :]).reshape(-1)

    def shard_skeleton(self, model: torch.nn.Module) -> None:
        """Give the (meta) model shard-sized projections; the row-parallel ones become `ReducedLinear`
        layers that all-reduce their partial outputs over the group."""
        for module_name, module in list(model.named_modules()):
            if not isinstance(module, torch.nn.Linear):
                continue
            weight_name = f"{module_name}.weight"
            if not self.is_sharded(weight_name):
                continue
            out_features, in_features = self.shard_shape(weight_name, module.weight.shape)
            options = dict(bias=module.bias is not None, device="meta", dtype=module.weight.dtype)
            if self._kind(weight_name)[0] == "row":
                shard = ReducedLinear(in_features, out_features, self.group.all_reduce, **options)
            else:
                shard = torch.nn.Linear(in_features, out_features, **options)
            shard.requires_grad_(False)
            parent_name, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, shard)


def gather_tp_shard(param: torch.nn.Parameter, plan: TensorParallelPlan, name: str) -> torch.Tensor:
    """This rank's TP shard of `param`; for a ZeRO-3 parameter, fetched point-to-point from the
    partitions that hold it (collective over the parameter's ZeRO group), on the accelerator: an offloaded
    partition (ZeRO-3 --offload) lives in CPU memory, which NCCL cannot send."""
    if not is_zero3_param(param):
        return plan.shard(name, param.data)
    group = param.ds_process_group
    world, me = dist.get_world_size(group), dist.get_rank(group)
    shape, numel = param.ds_shape, param.ds_numel
    per_rank = param.ds_tensor.numel()
    local = param.ds_tensor.data.reshape(-1).to(get_accelerator().current_device_name())
    tp_size = plan.size

    def needed(group_rank: int) -> torch.Tensor:
        return plan.flat_indices(name, shape, dist.get_global_rank(group, group_rank) % tp_size)

    mine = needed(me)
    pieces: dict[int, torch.Tensor] = {}
    ops = []
    low, high = me * per_rank, min((me + 1) * per_rank, numel)
    for other in range(world):
        wanted = needed(other)
        send = local[wanted[(wanted >= low) & (wanted < high)] - low]
        other_low, other_high = other * per_rank, min((other + 1) * per_rank, numel)
        receive_count = int(((mine >= other_low) & (mine < other_high)).sum())
        if other == me:
            pieces[other] = send
            continue
        peer = dist.get_global_rank(group, other)
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send.contiguous(), peer, group))
        if receive_count:
            pieces[other] = torch.empty(receive_count, dtype=local.dtype, device=local.device)
            ops.append(dist.P2POp(dist.irecv, pieces[other], peer, group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return torch.cat([pieces[r] for r in sorted(pieces)]).view(plan.shard_shape(name, shape))
