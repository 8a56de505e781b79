"""Deployment types: hostfile validation, the settings each type picks, launch commands, dry runs."""
import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pytest
from conftest import REPO_ROOT
from crash_resume import step_env

from training.pipeline.deployment import (
    CpuQuickRun,
    DeploymentType,
    MemoryChoice,
    ModelSizes,
    Workload,
    detect_deployment,
    host_bytes_per_node,
    state_bytes_per_gpu,
)
from training.pipeline.hardware import Hardware, ModelSize
from training.pipeline.hostfile import Host, read_hostfile
from training.pipeline.launch import Launcher
from training.pipeline.planning import plan_cpu, plan_gpu
from utils.dist import free_port
from utils.errors import UserError

SMALL = ModelSize(parameters=135_000_000, hidden_size=576, num_layers=30, vocab_size=49152)
B7 = ModelSize(parameters=7_000_000_000, hidden_size=4096, num_layers=32, vocab_size=32000)
B70 = ModelSize(parameters=70_000_000_000, hidden_size=8192, num_layers=80, vocab_size=32000)
H100 = Hardware(num_gpus=8, gpu_memory_gib=80, cpu_memory_gib=1000, cpu_cores=96, bf16=True)
LAPTOP_GPU = Hardware(num_gpus=1, gpu_memory_gib=24, cpu_memory_gib=64, cpu_cores=8, bf16=True)
TWO_CORES = Hardware(num_gpus=0, gpu_memory_gib=None, cpu_memory_gib=24, cpu_cores=2, bf16=True)


def write(path, text):
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- hostfile


def test_a_good_hostfile_is_read_with_comments_and_blank_lines(tmp_path):
    hostfile = write(tmp_path / "hosts", "# two nodes\nworker-1 slots=8\n\nworker-2 slots=4  # smaller\n")
    assert read_hostfile(hostfile) == [Host("worker-1", 8), Host("worker-2", 4)]


def test_a_hostfile_of_mpi_style_lines_is_read_as_deepspeeds_launcher_reads_it(tmp_path):
    """A cluster's hostfile written for MPI too ('node slots=8 max_slots=8') was refused as malformed, though
    DeepSpeed's launcher reads it (the slots, and nothing after)."""
    from deepspeed.launcher.runner import _parse_hostfile

    lines = ["worker-1 slots=8 max_slots=8", "worker-2\tslots=4   # smaller", "  worker-3 slots=2"]
    hostfile = write(tmp_path / "hosts", "\n".join(lines) + "\n")
    assert {host.name: host.slots for host in read_hostfile(hostfile)} == dict(_parse_hostfile(lines))


@pytest.mark.parametrize(
    "text, message",
    [
        ("worker-1 slots=8\nworker-1 slots=8\n", r"hosts:2: host worker-1 is listed twice \(first on line 1\);"),
        # two nodes to DeepSpeed's launcher, one machine to ssh: both lines' ranks on its GPUs from 0
        ("worker-1 slots=8\nWorker-1 slots=8\n", r"host Worker-1 is listed twice \(first on line 1, as worker-1"),
        ("worker-1 slots=0\n", "positive"),
        ("worker-1 slots=-2\n", "positive"),
        ("worker-1\n", "expected 'HOST slots=N'"),
        ("worker-1 gpus=8\n", "expected 'HOST slots=N'"),
        ("worker-1 slots=eight\n", "expected 'HOST slots=N'"),
        ("worker-1 slots = 8\n", "expected 'HOST slots=N'"),  # DeepSpeed's launcher refuses it
        ("# nothing\n\n", "lists no hosts"),
        ("node[1-4] slots=8\n", r"node\[1-4\]' would reach pdsh as a list of hosts"),  # one node to DeepSpeed, 4 to pdsh
        ("worker-1,worker-2 slots=8\n", "would reach pdsh as a list of hosts"),
    ],
)
def test_a_malformed_hostfile_is_a_user_error_naming_the_problem(tmp_path, text, message):
    with pytest.raises(UserError, match=message):
        read_hostfile(write(tmp_path / "hosts", text))


def test_a_missing_hostfile_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_hostfile(tmp_path / "nope")


def test_a_long_hostfile_asks_for_this_machines_names_once(tmp_path, monkeypatch):
    """Telling this machine's lines in a hostfile asked socket.getfqdn, which may wait on the system's resolver,
    once a line (64 times for 64 nodes); once a process now."""
    asked = []
    monkeypatch.setattr(socket, "getfqdn", lambda name="": asked.append(name) or "gpu-node-7.cluster.example")
    hostfile = write(tmp_path / "hosts", "".join(f"worker-{n} slots=8\n" for n in range(64)))
    assert len(read_hostfile(hostfile)) == 64
    assert len(asked) == 1


def _an_interface_address() -> str | None:
    """One of this machine's non-loopback IPv4 addresses (None: it has none)."""
    addresses = [address.address for nic in psutil.net_if_addrs().values() for address in nic
                 if address.family == socket.AF_INET and not address.address.startswith("127.")]
    return addresses[0] if addresses else None


@pytest.mark.parametrize("first, second", [
    ("localhost", "127.0.0.1"),
    ("GPU-NODE-7", "localhost"),  # its host name, in any case
    ("gpu-node-7.cluster.example", "::1"),  # its fully qualified name; an IPv6 loopback
    ("127.0.1.1", "0:0:0:0:0:0:0:1"),
    ("localhost", "interface"),  # one of its interfaces' addresses
])
def test_a_hostfile_naming_this_machine_twice_is_refused_naming_both_lines(tmp_path, monkeypatch, first, second):
    """`localhost` and `127.0.0.1` (or this machine's name) on two lines were read as two nodes: DeepSpeed's launcher
    starts each line's ranks on this machine from GPU 0, two ranks on a GPU, which NCCL refuses as a duplicate GPU
    only once the ranks start. Refused now when the hostfile is read, naming both lines."""
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-7")
    monkeypatch.setattr(socket, "getfqdn", lambda name="": "gpu-node-7.cluster.example")
    if second == "interface":
        second = _an_interface_address()
        if second is None:
            pytest.skip("this machine has no non-loopback IPv4 address")
    hostfile = write(tmp_path / "hosts", f"{first} slots=2\nworker-1 slots=2\n{second} slots=2\n")
    with pytest.raises(UserError, match=re.escape(f"{hostfile}: line 1 ({first}) and line 3 ({second}) both name "
                                                  "this machine")):
        read_hostfile(hostfile)
    assert read_hostfile(write(tmp_path / "other", f"{first} slots=2\nworker-1 slots=2\nworker-2 slots=2\n")) == \
        [Host(first, 2), Host("worker-1", 2), Host("worker-2", 2)]  # this machine once, beside other nodes


_NAME_SERVER = {"node1": "10.1.0.1", "node1.cluster.example": "10.1.0.1", "10.1.0.1": "10.1.0.1",
                "node2": "10.1.0.2", "gpu-node-7-ib": "127.0.1.1", "localhost": "127.0.0.1"}


def _stand_in_resolver(host, *args, **kwargs):
    """socket.getaddrinfo answering from `_NAME_SERVER`."""
    if host not in _NAME_SERVER:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (_NAME_SERVER[host], 0))]


@pytest.mark.parametrize("first, second, machine", [
    ("node1", "10.1.0.1", "10.1.0.1"),  # a node and its address
    ("node1", "node1.cluster.example", "10.1.0.1"),  # its short and fully qualified names
    ("localhost", "gpu-node-7-ib", "this machine"),  # a name of this machine its own names do not tell
])
def test_a_hostfile_naming_one_machine_under_two_names_is_refused_naming_both_lines(tmp_path, monkeypatch, first,
                                                                                    second, machine):
    """Two lines whose hosts resolve to one machine were read as two nodes: DeepSpeed's launcher starts each line's
    ranks there on its GPUs from 0, two ranks on each GPU, which NCCL refuses only once the ranks start. Refused when
    the hostfile is read, naming both lines and the address they share."""
    monkeypatch.setattr(socket, "getaddrinfo", _stand_in_resolver)
    hostfile = write(tmp_path / "hosts", f"{first} slots=2\nnode2 slots=2\n{second} slots=2\n")
    with pytest.raises(UserError, match=re.escape(f"{hostfile}: line 1 ({first}) and line 3 ({second}) name the same "
                                                  f"machine (both resolve to {machine})")):
        read_hostfile(hostfile)
    assert len(read_hostfile(write(tmp_path / "other", f"{first} slots=2\nnode2 slots=2\nworker-9 slots=2\n"))) == 3


# what str.splitlines breaks a line at, where DeepSpeed's launcher (open, readlines) breaks it at \n and \r alone
NOT_LINE_BREAKS_TO_DEEPSPEED = ["\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@pytest.mark.parametrize("kept", NOT_LINE_BREAKS_TO_DEEPSPEED)
def test_a_hostfile_is_read_in_the_lines_deepspeeds_launcher_reads(tmp_path, monkeypatch, kept):
    """read_hostfile broke lines with str.splitlines: `worker-1 slots=1<form feed>worker-2 slots=1` was read as two
    nodes where DeepSpeed's launcher reads one line, worker-1's, and launches on it alone. Read as it reads them now."""
    from deepspeed.launcher.runner import fetch_hostfile

    monkeypatch.setattr(socket, "getaddrinfo", _stand_in_resolver)
    path = write(tmp_path / "hosts", f"worker-1 slots=1{kept}worker-2 slots=1\nworker-3 slots=2\n")
    assert {host.name: host.slots for host in read_hostfile(path)} == dict(fetch_hostfile(path)) == \
        {"worker-1": 1, "worker-3": 2}


@pytest.mark.parametrize("read", ["hostfile", ".deepspeed_env"])
def test_a_hostfile_or_deepspeed_env_that_is_not_text_is_refused_naming_it(tmp_path, monkeypatch, read):
    """A hostfile or .deepspeed_env with a byte its encoding does not read (a Latin-1 `\\xe9`, in UTF-8) ended
    train.py in a UnicodeDecodeError's traceback; DeepSpeed's launcher reads both in the same encoding and fails on it
    too. Refused naming the file."""
    from training.pipeline.launch import env_for_other_nodes

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    path = tmp_path / read
    path.write_bytes(b"worker-1 slots=1\nHF_HOME=/data/caf\xe9 slots=1\n")
    with pytest.raises(UserError, match=re.escape(f"{path} is not ") + r"\S+ text \(a byte 0xe9: .*\); DeepSpeed's "
                       r"launcher reads it as \S+ text and would fail on it"):
        read_hostfile(path) if read == "hostfile" else env_for_other_nodes({}, tmp_path / "deepspeed_env")


# --------------------------------------------------------------------------- planning


def test_deployment_is_detected_from_the_machine():
    assert detect_deployment(TWO_CORES, hostfile_given=False) is DeploymentType.CPU
    assert detect_deployment(LAPTOP_GPU, hostfile_given=False) is DeploymentType.SINGLE_GPU
    assert detect_deployment(H100, hostfile_given=False) is DeploymentType.SINGLE_NODE
    assert detect_deployment(TWO_CORES, hostfile_given=True) is DeploymentType.MULTI_NODE


def test_zero_partitions_the_training_states_across_ranks():
    thousand = dataclasses.replace(SMALL, parameters=1_000)
    full = state_bytes_per_gpu(thousand, 1, MemoryChoice(0))
    assert full == 16_000  # 2 weights + 2 grads + 12 Adam bytes per parameter
    assert state_bytes_per_gpu(thousand, 8, MemoryChoice(1)) == 2_000 + 2_000 + 1_500
    assert state_bytes_per_gpu(thousand, 8, MemoryChoice(2)) == 2_000 + 1_750
    assert state_bytes_per_gpu(thousand, 8, MemoryChoice(3)) == 2_000
    assert state_bytes_per_gpu(thousand, 1, MemoryChoice(2, offload=True)) == 4_000


def test_a_small_model_on_one_big_gpu_trains_plainly_with_large_batches():
    plan = plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(SMALL, SMALL), H100, None)
    sft = plan.steps[1].flags
    assert (sft["zero_stage"], sft["offload"], sft["lora_dim"]) == (0, False, 0)
    assert sft["per_device_train_batch_size"] == 16 and sft["gradient_accumulation_steps"] == 4
    assert plan.world_size == 1
    assert plan.steps[3].flags["enable_hybrid_engine"] is True


def test_a_7b_model_on_one_24gb_gpu_needs_lora_and_offload():
    plan = plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(B7, SMALL), LAPTOP_GPU, None)
    sft = plan.steps[1].flags
    assert sft["zero_stage"] == 3 and sft["offload"] is True and sft["lora_dim"] > 0
    assert plan.steps[2].flags["lora_dim"] == 0  # the 135M reward model still trains fully
    assert plan.steps[3].flags["actor_lora_dim"] > 0
    assert plan.steps[3].flags["critic_lora_dim"] > 0  # LoRA on every model step 3 trains, the 135M critic too
    # the memory model counts the adapters alone as trained: the steps must train only them
    from step1_sft.main import build_parser as step1_parser
    from step3_rlhf.main import parse_args as step3_args

    assert step1_parser().parse_args(["--output_dir", "o", *plan.steps[1].argv()]).training.only_optimize_lora
    assert not step1_parser().parse_args(["--output_dir", "o", *plan.steps[2].argv()]).training.only_optimize_lora
    actor = step3_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
                        *plan.steps[3].argv()]).actor
    assert actor.lora_dim > 0 and actor.only_optimize_lora


def test_a_plan_with_offload_keeps_the_frozen_models_in_cpu_memory():
    """The memory model counts the frozen models (step 3's reference and reward model, DPO's reference) as held in CPU
    memory under an offload choice, but the plan offloaded step 3's reference alone: 7B models on one 24 GB GPU planned
    their activations beside a reward model (or DPO's reference) that took 13 GiB of it. Without offload, or without a
    reward model, the flag is not planned on."""
    from step2_reward.dpo.main import parse_args as dpo_args
    from step3_rlhf.main import parse_args as step3_args

    def frozen(plan):
        return step3_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
                           *plan.steps[3].argv()]).frozen

    workstation = dataclasses.replace(LAPTOP_GPU, cpu_memory_gib=256)  # the four 7B models' weights in its memory
    offloaded = frozen(plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(B7, B7), workstation, None))
    assert offloaded.offload_reference_model and offloaded.offload_reward_model
    on_gpus = frozen(plan_gpu(DeploymentType.SINGLE_NODE, ModelSizes(B7, B7), H100, None))
    assert not on_gpus.offload_reference_model and not on_gpus.offload_reward_model
    no_reward_model = plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(B7, B7), workstation, None,
                               Workload(critic=False, reward_model=False))
    assert no_reward_model.steps[3].flags["offload_reference_model"]
    assert "offload_reward_model" not in no_reward_model.steps[3].flags
    for plan, offloaded in ((plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(B7, B7), workstation, None), True),
                            (plan_gpu(DeploymentType.SINGLE_NODE, ModelSizes(B7, B7), H100, None), False)):
        dpo = dpo_args(["--model_name_or_path", "a", "--output_dir", "o", *plan.steps[4].argv()])
        assert (dpo.training.offload, dpo.dpo.offload_reference_model) == (offloaded, offloaded)
    assert "offload_reference_model" not in {**plan.steps[1].flags, **plan.steps[2].flags}


def test_planned_lora_adapts_the_models_own_decoder_blocks(tiny_model_dir):
    """The default --lora_module_name "layers." matches nothing in GPT-2, Falcon or BLOOM ("transformer.h.N"): a plan
    that needed LoRA for them stopped at load. Plans name each model's decoder blocks, as its meta model lists them."""
    from dataclasses import replace

    from step3_rlhf.main import parse_args as step3_args
    from training.pipeline.hardware import model_size

    assert [model_size(tiny_model_dir(arch)).blocks_name for arch in ("llama", "gpt2", "opt")] == \
        ["layers.", "h.", "layers."]
    gpt2_7b, small_gpt2 = replace(B7, blocks_name="h."), replace(SMALL, blocks_name="h.")
    plan = plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(gpt2_7b, small_gpt2), LAPTOP_GPU, None)
    assert plan.steps[1].flags["lora_module_name"] == "h." and "lora_module_name" not in plan.steps[2].flags
    step3 = step3_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
                        *plan.steps[3].argv()])
    assert (step3.actor.lora_module_name, step3.critic.lora_module_name) == ("h.", "h.")


def test_a_lora_choice_counts_the_adapters_lora_makes_at_the_rank_it_runs(tiny_model_dir):
    """The GPU plan and the host-memory check took a LoRA choice to train 1% of the model's parameters whatever the
    rank: a rank-128 adapter on every block of a 7B Llama trains 4.6%. They count the plan's rank-128 adapters, or
    the rank a step's --lora_dim sets, from the model's linear layers (`lora_trainable_parameters`)."""
    from training.pipeline.deployment import HostModel, trained_parameters
    from training.pipeline.hardware import lora_trainable_parameters, model_size

    size = model_size(tiny_model_dir("llama"))
    planned = MemoryChoice(3, offload=True, lora=True)
    assert trained_parameters([size], planned) == lora_trainable_parameters(size, 128) > 0.01 * size.parameters
    flags = {"zero_stage": 3, "offload": True, "lora_dim": 8, "only_optimize_lora": True}
    # 12 B of Adam state and 2 B of gradients a trained parameter, the 2-byte weights of ZeRO-3's parameter offload
    assert HostModel(size).host_bytes(flags, 1, 1) == 14 * lora_trainable_parameters(size, 8) + 2 * size.parameters


def test_the_host_need_counts_the_adapters_on_the_layers_lora_module_name_selects(tiny_model_dir):
    """The host-memory check read a step's --lora_dim but not its --lora_module_name: adapters on the attention alone
    (`--lora_module_name self_attn`) were counted on every block's layers, as many as the MLP's too (review RV2: a 7B
    Llama at ZeRO-3 offload, rank 128, counted 16.7 GiB for 14.3). Step 3's critic reads its prefixed flag."""
    from training.pipeline.deployment import HostModel
    from training.pipeline.hardware import lora_trainable_parameters, model_size

    size = model_size(tiny_model_dir("llama"))
    attention = lora_trainable_parameters(size, 8, "self_attn")
    assert 0 < attention < lora_trainable_parameters(size, 8)
    flags = {"zero_stage": 3, "offload": True, "lora_dim": 8, "only_optimize_lora": True, "lora_module_name": "self_attn"}
    assert HostModel(size).host_bytes(flags, 1, 1) == 14 * attention + 2 * size.parameters
    critic_flags = {f"critic_{name}": value for name, value in flags.items()}
    assert HostModel(size, "critic_").host_bytes(critic_flags, 1, 1) == 14 * attention + 2 * size.parameters


@pytest.mark.parametrize("gpus, step1_global, step2_global",
                         [(8, 64, 32), (3, 63, 30), (1, 64, 32), (48, 48, 48), (128, 128, 128)])
def test_the_global_batch_is_the_planned_one_on_any_number_of_gpus(gpus, step1_global, step2_global):
    """64 samples an optimizer step in step 1 and 32 pairs in step 2: on 8 GPUs the micro-batch that fit memory
    made 128 and 64; where the GPUs do not divide it, at most that; where they outnumber it, one sample a GPU, as
    README says."""
    node = Hardware(num_gpus=gpus, gpu_memory_gib=80, cpu_memory_gib=1000, cpu_cores=96, bf16=True)
    plan = plan_gpu(DeploymentType.SINGLE_NODE, ModelSizes(SMALL, SMALL), node, None)

    def global_batch(step: int) -> int:
        flags = plan.steps[step].flags
        return flags["per_device_train_batch_size"] * flags["gradient_accumulation_steps"] * plan.world_size

    assert (global_batch(1), global_batch(2)) == (step1_global, step2_global)


def test_one_node_of_eight_gpus_shards_a_7b_model_with_zero2():
    plan = plan_gpu(DeploymentType.SINGLE_NODE, ModelSizes(B7, B7), H100, None)
    assert plan.world_size == 8
    assert plan.steps[1].flags["zero_stage"] == 2 and plan.steps[1].flags["lora_dim"] == 0


def test_more_nodes_let_a_70b_model_train_fully_without_offload():
    one_node = plan_gpu(DeploymentType.SINGLE_NODE, ModelSizes(B70, SMALL), H100, None)
    hosts = [Host(f"worker-{i}", 8) for i in range(4)]
    four_nodes = plan_gpu(DeploymentType.MULTI_NODE, ModelSizes(B70, SMALL), H100, hosts)
    # on one node its Adam states fit neither the GPUs nor (offloaded) 1000 GiB of host memory: LoRA
    assert one_node.steps[1].flags["lora_dim"] > 0
    assert four_nodes.world_size == 32
    assert four_nodes.steps[1].flags["zero_stage"] == 3
    assert four_nodes.steps[1].flags["offload"] is False and four_nodes.steps[1].flags["lora_dim"] == 0


def test_gpu_nodes_planned_from_a_machine_without_a_gpu_take_their_own_precision():
    """A multi_node run planned on a login node fixed its CPU's precision for every GPU: fp32 (or bf16 from an
    AVX512-BF16 CPU, which a V100 node cannot run)."""
    hosts = [Host(f"worker-{i}", 8) for i in range(2)]
    for login_node in (TWO_CORES, Hardware(num_gpus=0, gpu_memory_gib=None, cpu_memory_gib=24, cpu_cores=2, bf16=False)):
        plan = plan_gpu(DeploymentType.MULTI_NODE, ModelSizes(B7, B7), login_node, hosts)
        assert {plan.steps[step].flags["dtype"] for step in (1, 2, 3)} == {"auto"}
        assert any("--dtype auto" in note for note in plan.notes)
    assert plan_gpu(DeploymentType.MULTI_NODE, ModelSizes(B7, B7), H100, hosts).steps[1].flags["dtype"] == "bf16"


def test_sequence_lengths_stay_within_the_models_positions():
    short = ModelSize(parameters=1_000_000, hidden_size=64, num_layers=2, vocab_size=1000, max_positions=256)
    for plan in (plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(short, SMALL), H100, None),
                 plan_cpu(ModelSizes(SMALL, short), TWO_CORES)):
        rlhf = plan.steps[3].flags
        assert rlhf["max_prompt_seq_len"] + rlhf["max_answer_seq_len"] <= 256
        assert rlhf["max_prompt_seq_len"] > 0 and rlhf["max_answer_seq_len"] > 0
    gpu = plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(short, SMALL), H100, None)
    assert gpu.steps[1].flags["max_seq_len"] == 256 and gpu.steps[2].flags["max_seq_len"] == 512
    assert plan_cpu(ModelSizes(SMALL, short), TWO_CORES).steps[2].flags["max_seq_len"] <= 256


def test_an_offload_plan_fits_the_offloaded_weights_in_host_memory():
    """Offload at ZeRO-3 keeps every weight in CPU memory (2 bytes each), the frozen models' too, but the host check
    counted the trained weights' optimizer state alone, model by model: a 180B model fitted one 24 GB GPU with 64 GB
    of RAM under ZeRO-3, offload and LoRA (its bf16 weights alone take 335 GiB), to fail once its step loaded it."""
    b180 = ModelSize(parameters=180_000_000_000, hidden_size=14848, num_layers=80, vocab_size=32000)
    with pytest.raises(UserError, match=r"^step 1: 180\.0B parameters fit 1 accelerator\(s\) of 24 GiB only with "
                                        r"offload, which puts 371\.0 GiB in host memory"):
        plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(b180, SMALL), LAPTOP_GPU, None)
    big_host = dataclasses.replace(LAPTOP_GPU, cpu_memory_gib=1024)
    sft = plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(b180, SMALL), big_host, None).steps[1].flags
    assert (sft["zero_stage"], sft["offload"], sft["lora_dim"] > 0) == (3, True, True)
    lora_offload = MemoryChoice(3, offload=True, lora=True)
    two_trained = host_bytes_per_node([B7, B7], [B7], lora_offload, nodes=2)  # every model counts, per node
    adapters = 128 * 18 * 4096 * 32  # rank 128 on 32 blocks, estimated at 18 x 4096 linear features each
    assert two_trained == pytest.approx((14 * 2 * adapters + 2 * 3 * 7e9) / 2)
    assert host_bytes_per_node([B7], [B7], MemoryChoice(2, offload=True), nodes=1) == 14 * 7e9 + 2 * 7e9
    assert host_bytes_per_node([B7], [B7], MemoryChoice(3, lora=True), nodes=1) == 0


HOST_NEED_SIZES = (ModelSize(parameters=500_000_000, hidden_size=1024, num_layers=24, vocab_size=32000),
                   ModelSize(parameters=3_000_000_000, hidden_size=3072, num_layers=28, vocab_size=32000), B7, B70)
HOST_NEED_MACHINES = {
    "single_gpu": (LAPTOP_GPU, None),
    "single_gpu_80": (dataclasses.replace(H100, num_gpus=1, cpu_memory_gib=256), None), "single_node": (H100, None),
    "multi_node": (H100, [Host("worker-1", 8), Host("worker-2", 8)])}
HOST_NEED_RUNS = ((1, Workload()), (2, Workload()), (3, Workload()), (3, Workload(critic=False, samples_per_prompt=4)),
                  (4, Workload(critic=False, reward_model=False)))
HOST_NEED_FLAGS = ({}, {"zero_stage": 3, "offload": True}, {"offload": "false"}, {"lora_dim": 0},
                   {"only_optimize_lora": False, "lora_dim": 16}, {"offload_reference_model": True},
                   {"offload_reference_model": "0"}, {"actor_zero_stage": "3", "actor_offload": "yes"},
                   {"critic_offload": True, "critic_zero_stage": 2, "offload_reward_model": False},
                   {"actor_lora_dim": 0, "critic_lora_dim": 0, "actor_offload": False},
                   {"enable_ema": True, "actor_zero_stage": 2, "actor_offload": True})


def _plans_with_host_needs():
    """(plan, step) for every step HOST_NEED_* plans: each size on each machine, each step's workload."""
    for sizes in HOST_NEED_SIZES:
        for deployment, (hardware, hosts) in HOST_NEED_MACHINES.items():
            for step, workload in HOST_NEED_RUNS:
                try:
                    plan = plan_gpu(DeploymentType(deployment.removesuffix("_80")), ModelSizes(sizes, sizes),
                                    hardware, hosts, workload, [step])
                except UserError:
                    continue
                yield plan, step


def test_a_steps_host_need_adds_up_each_models_need_as_run_and_as_planned():
    """A step's host need as run and as planned is the sum of its models' needs, each from its own flags, over plans
    of several sizes, machines and workloads (offload planned and not), with user flags over the plan's."""
    from training.pipeline.planning import _host_need

    def each_model(plan, step: int, flags) -> float:
        return sum(model.host_bytes(flags, plan.world_size, plan.nodes) for model in plan.host_models[step])

    checked = set()
    for plan, step in _plans_with_host_needs():
        for user in HOST_NEED_FLAGS:
            runs_with = {**plan.steps[step].flags, **user}
            need = _host_need(plan, step, runs_with)
            assert (need.as_run, need.as_planned) == (each_model(plan, step, runs_with),
                                                      each_model(plan, step, plan.steps[step].flags))
            checked.add((step, need.as_planned > 0, need.as_run > 0, need.as_run == need.as_planned))
    assert len(checked) >= 16  # offload planned or not, raised, lowered and kept by the user's flags, in every step


@pytest.mark.parametrize("user, total", [
    ({"actor_zero_stage": 3, "offload_reference_model": False, "offload_reward_model": False}, "fell"),
    ({"actor_zero_stage": 3, "offload_reference_model": False}, "kept")])
def test_a_flag_that_raised_a_models_need_is_advised_against_where_the_total_did_not_rise(user, total):
    """A 7B GRPO step 3 planned as ZeRO-2 with every model offloaded (117.3 GiB), run at --actor_zero_stage 3 (the
    actor's weights too: +13.0 GiB) with a frozen model on the GPU (-13.0 GiB each): the warning named
    --actor_zero_stage as setting the need but advised "plan less offload" alone, where leaving it to the plan lowers
    the need by 13.0 GiB."""
    from training.pipeline.planning import host_memory_warnings

    node = Hardware(num_gpus=1, gpu_memory_gib=80, cpu_memory_gib=256, cpu_cores=8, bf16=True,
                    cpu_memory_available_gib=100)
    plan = plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(B7, B7), node, None,
                    Workload(critic=False, samples_per_prompt=4), [3])
    assert (plan.steps[3].flags["actor_zero_stage"], plan.steps[3].flags["offload_reward_model"]) == (2, True)
    (warning,) = host_memory_warnings(plan, node, None, {3: {**plan.steps[3].flags, **user}})
    advice = "offload less: leave those flags to the plan, or a smaller model, more GPUs or nodes"
    if total == "fell":
        assert warning.startswith("step 3's offload, as your --actor_zero_stage set it, puts 104.3 GiB")
        assert warning.endswith(f"{advice} (your --offload_reference_model, --offload_reward_model lowered it from "
                                "the plan's 117.3 GiB)")
    else:
        assert warning.startswith("step 3's offload, as your --actor_zero_stage set it, puts 117.3 GiB")
        assert warning.endswith(advice)


@pytest.mark.parametrize("deployment, stage, lora, offload, copies", [
    ("single_gpu", 2, False, True, 1), ("single_node", 2, False, True, 8), ("multi_node", 2, False, True, 8),
    ("single_node", 3, False, True, 1), ("multi_node", 3, False, True, 1 / 2), ("single_node", 3, True, True, 1),
    ("single_node", 2, False, False, 0)])
def test_step_3s_ema_of_an_offloaded_actor_is_counted_in_host_memory_as_each_rank_holds_it(deployment, stage, lora,
                                                                                           offload, copies):
    """--enable_ema keeps an fp32 copy of the actor's trained parameters in CPU memory where the actor is offloaded
    (step3_rlhf/ema.py): each rank its ZeRO-3 partition, or at ZeRO 0-2 a whole copy. Neither the warning nor its
    flags counted it: a 7B GRPO step 3 at ZeRO-2 with offload on one 80 GiB GPU, 200 GiB available, put 117.3 GiB in
    host memory by the warning's count and 143.4 GiB with the EMA, unwarned; on 8 GPUs the EMA alone is 208.6 GiB."""
    from training.pipeline.deployment import trained_parameters
    from training.pipeline.planning import _host_need

    node = Hardware(num_gpus=8, gpu_memory_gib=80, cpu_memory_gib=256, cpu_cores=8, bf16=True)
    hosts = [Host("worker-1", 8), Host("worker-2", 8)] if deployment == "multi_node" else None
    plan = plan_gpu(DeploymentType(deployment), ModelSizes(B7, B7), node, hosts,
                    Workload(critic=False, samples_per_prompt=4), [3])
    runs_with = {**plan.steps[3].flags, "actor_zero_stage": stage, "actor_offload": offload,
                 "actor_lora_dim": 128 if lora else 0, "actor_only_optimize_lora": lora}
    ema = _host_need(plan, 3, {**runs_with, "enable_ema": True}).as_run - _host_need(plan, 3, runs_with).as_run
    assert ema == pytest.approx(4 * trained_parameters([B7], MemoryChoice(stage, offload, lora)) * copies)
    if copies:
        assert _host_need(plan, 3, {**runs_with, "enable_ema": True}).raised_by[-1] == "--enable_ema"


@pytest.mark.parametrize("deployment, placement, copies", [
    ("single_node", {"placement": "disaggregate"}, 4), ("single_node", {"placement_ratio": "actor=0.25"}, 2),
    ("multi_node", {"placement": "disaggregate"}, 8), ("single_node", {"placement": "colocate"}, 8)])
def test_step_3s_ema_is_counted_on_the_ranks_the_placement_gives_the_actor(deployment, placement, copies):
    """ModelEMA is built only on the ranks that hold the actor, but the warning counted a whole copy (ZeRO 0-2) on
    every rank (review RV2): `--placement disaggregate` gives the actor 4 of 8 ranks, whose EMA was counted twice
    over (200.8 GiB for 100.4). On two nodes of 8 it gives it the first node's 8: that node holds 8 copies. (Under
    --placement auto, which may pick any layout, every rank counts: test_step_3_under_placement_auto_...)"""
    from training.pipeline.deployment import trained_parameters
    from training.pipeline.planning import _host_need

    node = Hardware(num_gpus=8, gpu_memory_gib=80, cpu_memory_gib=256, cpu_cores=8, bf16=True)
    hosts = [Host("worker-1", 8), Host("worker-2", 8)] if deployment == "multi_node" else None
    plan = plan_gpu(DeploymentType(deployment), ModelSizes(B7, B7), node, hosts, Workload(), [3])
    runs_with = {**plan.steps[3].flags, "actor_zero_stage": 2, "actor_offload": True, "actor_lora_dim": 0,
                 "critic_zero_stage": 2, **placement}
    ema = _host_need(plan, 3, {**runs_with, "enable_ema": True}).as_run - _host_need(plan, 3, runs_with).as_run
    assert ema == pytest.approx(4 * trained_parameters([B7], MemoryChoice(2, True)) * copies)


def test_an_ema_that_needs_more_host_memory_than_is_available_is_warned_of_naming_enable_ema():
    from training.pipeline.planning import host_memory_warnings

    node = Hardware(num_gpus=1, gpu_memory_gib=80, cpu_memory_gib=256, cpu_cores=8, bf16=True,
                    cpu_memory_available_gib=200)
    plan = plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(B7, B7), node, None,
                    Workload(critic=False, samples_per_prompt=4), [3])
    assert (plan.steps[3].flags["actor_zero_stage"], plan.steps[3].flags["actor_offload"]) == (2, True)
    assert host_memory_warnings(plan, node, None, {3: {**plan.steps[3].flags, "enable_ema": False}}) == []
    (warning,) = host_memory_warnings(plan, node, None, {3: {**plan.steps[3].flags, "enable_ema": True}})
    assert warning.startswith("step 3's offload, as your --enable_ema set it, puts 143.4 GiB in host memory")
    assert warning.endswith("offload less: leave those flags to the plan, or a smaller model, more GPUs or nodes")


@pytest.mark.parametrize("gpus, gpu_memory, available, ema, planned, most", [
    (2, 40, 180, False, 117.3, 130.4),  # planned at ZeRO-2: auto may pick ZeRO-3, which offloads the weights too
    (8, 24, 250, True, 156.5, 326.0)])  # planned at ZeRO-3: auto may pick ZeRO-1/2, an EMA copy on each rank
def test_step_3_under_placement_auto_is_counted_at_the_zero_stages_it_may_pick(gpus, gpu_memory, available, ema,
                                                                              planned, most):
    """--placement auto picks the actor's and critic's ZeRO stages as step 3 starts (any of 1-3 for an offloaded
    model on several ranks), but the warning counted the stages on the command line: a 7B GRPO step 3 on 2 GPUs
    planned at ZeRO-2 with offload (117.3 GiB) may run at ZeRO-3 (130.4 GiB) and went unwarned with 180 GiB
    available; one on 8 GPUs at ZeRO-3 with --enable_ema (156.5 GiB) may run at ZeRO-2, a whole EMA copy on each
    rank (326.0 GiB). It is counted at the stages that put the most there, naming --placement auto."""
    from training.pipeline.planning import host_memory_warnings

    node = Hardware(num_gpus=gpus, gpu_memory_gib=gpu_memory, cpu_memory_gib=256, cpu_cores=8, bf16=True,
                    cpu_memory_available_gib=available)
    plan = plan_gpu(DeploymentType.SINGLE_NODE, ModelSizes(B7, B7), node, None,
                    Workload(critic=False, samples_per_prompt=4), [3])
    assert plan.steps[3].flags["actor_offload"]
    runs_with = {**plan.steps[3].flags, "enable_ema": ema, "placement": "colocate"}
    assert host_memory_warnings(plan, node, None, {3: runs_with}) == []
    (warning,) = host_memory_warnings(plan, node, None, {3: {**runs_with, "placement": "auto"}})
    flags = "--placement auto, --enable_ema" if ema else "--placement auto"
    assert warning.startswith(f"step 3's offload, as your {flags} set it, puts up to {most} GiB in host memory")
    assert warning.endswith("offload less: leave those flags to the plan, or a smaller model, more GPUs or nodes")
    if ema:
        (without_auto,) = host_memory_warnings(plan, dataclasses.replace(node, cpu_memory_available_gib=200), None,
                                               {3: runs_with})
        assert f"puts {planned} GiB" in without_auto

def test_a_run_plans_its_own_steps_alone(tmp_path, tiny_model_dir, monkeypatch):
    """Every registered step was planned, whichever ran: a 70B actor that step 1 fits on one 80 GB GPU of a 256 GB
    machine (its weights offloaded there) but step 3 does not (its frozen copy's weights too) refused `--step 1`."""
    from training.pipeline import runner
    from training.pipeline.cli import parse_config

    monkeypatch.setattr(runner, "model_size", lambda *args, **kwargs: B70)
    node = Hardware(num_gpus=1, gpu_memory_gib=80, cpu_memory_gib=256, cpu_cores=32, bf16=True)
    with pytest.raises(UserError, match=r"^step 3: .* fit 1 accelerator\(s\) of 80 GiB only with offload"):
        plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(B70, B70), node, None)
    argv = ["--deployment-type", "single_gpu", "--actor-model", tiny_model_dir("llama"), "--output-dir",
            str(tmp_path / "out"), "--dry-run", "--step", "1"]
    command = runner.run_pipeline(parse_config(argv), hardware=node)["commands"][1]
    assert command[command.index("--zero_stage") + 1] == "3" and "--offload" in command


LLAMA_2 = {name: ModelSize(parameters=params, hidden_size=hidden, num_layers=layers, vocab_size=32000,
                           max_positions=4096)
           for name, params, hidden, layers in (("7B", 6_738_415_616, 4096, 32), ("13B", 13_015_864_320, 5120, 40),
                                                ("70B", 68_976_648_192, 8192, 80))}


@pytest.mark.parametrize("gpu_memory, host_memory, size, planned", [
    (24, 64, "7B", {"step 1", "step 2", "grpo", "dpo"}), (24, 64, "13B", {"step 1", "step 2"}), (24, 64, "70B", set()),
    (80, 256, "7B", {"step 1", "step 2", "ppo", "grpo", "dpo"}),
    (80, 256, "13B", {"step 1", "step 2", "ppo", "grpo", "dpo"}), (80, 256, "70B", {"step 1", "step 2"}),
])
def test_one_gpu_plans_the_llama_2_steps_readme_lists(gpu_memory, host_memory, size, planned):
    """README's One GPU lists what one GPU plans for Llama-2's sizes (actor and reward model alike); offload counting
    every model's weights in host memory (bc1d7a0) refused PPO's step 3 of 7B on 24 GiB with 64 GiB, which it planned
    before, and moved 13B's step 1 on 80 GiB with 256 GiB from offload to LoRA without it."""
    gpu = Hardware(num_gpus=1, gpu_memory_gib=gpu_memory, cpu_memory_gib=host_memory, cpu_cores=8, bf16=True)
    runs = {"step 1": (1, Workload()), "step 2": (2, Workload()), "ppo": (3, Workload()),
            "grpo": (3, Workload(critic=False, samples_per_prompt=4)),
            "dpo": (4, Workload(critic=False, reward_model=False))}

    def plans(step: int, workload: Workload) -> bool:
        try:
            plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(LLAMA_2[size], LLAMA_2[size]), gpu, None, workload, [step])
        except UserError:
            return False
        return True

    assert {run for run, (step, workload) in runs.items() if plans(step, workload)} == planned
    if (gpu_memory, size) == (80, "13B"):
        supervised = plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(LLAMA_2[size], LLAMA_2[size]), gpu, None).steps
        assert [(supervised[step].flags["offload"], supervised[step].flags["lora_dim"]) for step in (1, 2)] == \
            [(False, 128), (False, 128)]


def test_the_readmes_refusal_of_ppo_with_llama_2_7b_on_one_gpu_is_the_planners():
    """README's One GPU quotes the refusal of PPO's step 3 with Llama-2-7B on one 24 GiB GPU with 64 GiB of memory; it
    kept the figures of a 1% LoRA share (52.0 GiB, 75 GiB) after the planner counted the adapters (58.1, 83)."""
    readme = " ".join((REPO_ROOT / "README.md").read_text().split())
    (quoted,) = re.findall(r"PPO with Llama-2-7B as actor and reward model, one 24 GiB GPU, 64 GiB of memory: "
                           r"`(step 3: [^`]*), \.\.\.`", readme)
    with pytest.raises(UserError) as refused:
        plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(LLAMA_2["7B"], LLAMA_2["7B"]), LAPTOP_GPU, None, steps=[3])
    assert str(refused.value).startswith(quoted)


def test_a_refusal_names_the_memory_that_is_short_and_what_would_do():
    """Every refusal said the models did not fit the accelerators, also where their memory was not the limit: step 3's
    7B actor and 7B reward model fit one 24 GB GPU with offload, which 64 GB of RAM cannot hold (512 GB plans it), so
    its user bought a bigger GPU where more RAM would do. The refusal names the memory short, by how much, and what
    helps; a model no choice fits on the accelerators says more RAM would not."""
    sevens = ModelSizes(B7, B7)
    with pytest.raises(UserError) as host_short:
        plan_gpu(DeploymentType.SINGLE_GPU, sevens, LAPTOP_GPU, None, steps=[1, 2, 3])
    assert str(host_short.value).startswith(
        "step 3: 28.0B parameters fit 1 accelerator(s) of 24 GiB only with offload, which puts 60.0 GiB in host "
        "memory, more than 70% of this machine's 64 GiB (44.8 GiB); use a machine with 86 GiB of memory or more")
    assert "a smaller actor or reward model, or leave step 3 out (--step)" in str(host_short.value)
    more_memory = dataclasses.replace(LAPTOP_GPU, cpu_memory_gib=86)  # the memory it names plans step 3
    assert plan_gpu(DeploymentType.SINGLE_GPU, sevens, more_memory, None).steps[3].flags["actor_offload"]
    assert set(plan_gpu(DeploymentType.SINGLE_GPU, sevens, LAPTOP_GPU, None, steps=[1, 2]).steps) == {1, 2}
    two_nodes = [Host("worker-1", 1), Host("worker-2", 1)]
    with pytest.raises(UserError, match=r"^step 3: .* 30\.0 GiB in host memory, more than 70% of each node's 32 GiB"):
        plan_gpu(DeploymentType.MULTI_NODE, sevens, dataclasses.replace(LAPTOP_GPU, cpu_memory_gib=32), two_nodes)
    huge = ModelSize(parameters=2_000_000_000_000, hidden_size=16384, num_layers=200, vocab_size=32000)
    for host_memory in (64, 100_000):
        with pytest.raises(UserError, match=r"^step 1: 2000\.0B parameters do not fit the memory of 1 accelerator\(s\) "
                                            r"of 24 GiB, even with ZeRO-3, offload and LoRA \(more host memory would "
                                            r"not help\); use more GPUs"):
            plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(huge, SMALL),
                     dataclasses.replace(LAPTOP_GPU, cpu_memory_gib=host_memory), None)


def test_the_cpu_quick_run_fits_the_embedded_model_in_the_time_budget():
    quick = CpuQuickRun()
    plan = plan_cpu(ModelSizes(SMALL, SMALL), TWO_CORES, quick)
    sft, reward, rlhf = (plan.steps[i].flags for i in (1, 2, 3))
    assert sft["dtype"] == "bf16" and sft["max_seq_len"] == 256 and sft["zero_stage"] == 0
    assert sft["max_train_samples"] == sft["max_steps"] * sft["per_device_train_batch_size"]
    assert 0 < sft["num_warmup_steps"] < sft["max_steps"] and 0 < reward["num_warmup_steps"] < reward["max_steps"]
    # the reward model needs ~600 pairs for high held-out accuracy, at a learning rate above step 1's
    assert reward["max_steps"] * reward["per_device_train_batch_size"] >= 600
    assert reward["learning_rate"] > sft["learning_rate"]
    assert reward["max_seq_len"] >= rlhf["max_prompt_seq_len"] + rlhf["max_answer_seq_len"]
    assert 20 <= rlhf["max_steps"] <= 60 and rlhf["max_answer_seq_len"] <= 64
    seconds_per_step = (quick.sft_step_s, quick.reward_step_s, quick.ppo_step_s)
    planned = sum(quick.step_overhead_s[i] + plan.steps[i + 1].flags["max_steps"] * seconds_per_step[i] for i in range(3))
    assert planned <= 27 * 60  # README's main command: all three steps within 30 minutes, with start-up to spare


def test_the_cpu_quick_run_takes_fewer_steps_for_bigger_models_and_fp32():
    base = plan_cpu(ModelSizes(SMALL, SMALL), TWO_CORES).steps[1].flags["max_steps"]
    bigger = ModelSize(parameters=4 * SMALL.parameters, hidden_size=1024, num_layers=30, vocab_size=49152)
    no_bf16 = Hardware(num_gpus=0, gpu_memory_gib=None, cpu_memory_gib=24, cpu_cores=2, bf16=False)
    assert plan_cpu(ModelSizes(bigger, SMALL), TWO_CORES).steps[1].flags["max_steps"] < base
    fp32 = plan_cpu(ModelSizes(SMALL, SMALL), no_bf16).steps[1].flags
    assert fp32["max_steps"] < base and fp32["dtype"] == "fp32"


# --------------------------------------------------------------------------- launching


LAUNCHER = [sys.executable, "-m", "deepspeed.launcher.runner", "--no_local_rank"]


def test_launch_commands_start_the_deepspeed_launcher_with_this_python(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    script = tmp_path / "main.py"
    single = Launcher(DeploymentType.SINGLE_NODE, num_gpus=4).command(script, ["--zero_stage", "2"])
    assert single == LAUNCHER + ["--hostfile", os.devnull, "--num_gpus", "4", str(script), "--zero_stage", "2"]
    local = Launcher(DeploymentType.SINGLE_GPU, num_gpus=1, master_port=29611).command(script, [])
    assert local == LAUNCHER + ["--hostfile", os.devnull, "--num_gpus", "1", "--master_port", "29611", str(script)]
    multi = Launcher(DeploymentType.MULTI_NODE, hostfile="/h", nodes=2).command(script, [])
    assert multi == LAUNCHER + ["--hostfile", "/h", str(script)]


def test_a_node_restricted_by_cuda_visible_devices_launches_on_those_gpus(tmp_path, monkeypatch, caplog):
    """DeepSpeed's launcher drops CUDA_VISIBLE_DEVICES when given --num_gpus and numbers the GPUs from 0: a run
    restricted to GPUs 2 and 3 (or two runs sharing a node) landed on 0 and 1. They are named in --include."""
    script = tmp_path / "main.py"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert Launcher(DeploymentType.SINGLE_NODE, num_gpus=2).command(script, []) == \
        LAUNCHER + ["--hostfile", os.devnull, "--include", "localhost:2,3", str(script)]
    assert Launcher(DeploymentType.SINGLE_GPU, num_gpus=1).command(script, [])[6:8] == ["--include", "localhost:2"]
    assert Launcher(DeploymentType.MULTI_NODE, hostfile="/h").command(script, [])[4:6] == ["--hostfile", "/h"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8a1b2c3d")  # not selectable: the launcher's own way, said
    assert Launcher(DeploymentType.SINGLE_GPU, num_gpus=1).command(script, [])[6:8] == ["--num_gpus", "1"]
    assert "names GPUs by UUID" in caplog.text


@pytest.mark.parametrize("deployment", [DeploymentType.SINGLE_GPU, DeploymentType.MULTI_NODE])
def test_a_gpu_plan_says_cuda_visible_devices_lets_it_see_no_gpu_where_it_does(monkeypatch, deployment):
    """A GPU machine whose CUDA_VISIBLE_DEVICES hides every GPU was planned as one without GPUs (each GPU sized as
    this machine's memory, 'no GPU found here'), its dry run giving no reason. The reason then said the variable
    'hides every GPU', untrue where the machine has none (CUDA_VISIBLE_DEVICES='' keeps a CI job on the CPU): it
    holds either way now."""
    hosts = [Host("worker-1", 1)] if deployment is DeploymentType.MULTI_NODE else None
    for value in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        notes = plan_gpu(deployment, ModelSizes(SMALL, SMALL), TWO_CORES, hosts).notes
        said = (f"CUDA_VISIBLE_DEVICES={value!r} lets this process see no GPU, whether or not this machine has any, "
                "so none is counted here; where it has some, unset the variable")
        assert any(note.startswith(said) for note in notes)
        assert not any("CUDA_VISIBLE_DEVICES" in note for note in plan_gpu(deployment, ModelSizes(SMALL, SMALL),
                                                                            LAPTOP_GPU, hosts).notes)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not any("CUDA_VISIBLE_DEVICES" in note for note in plan_gpu(deployment, ModelSizes(SMALL, SMALL),
                                                                        TWO_CORES, hosts).notes)


@pytest.mark.parametrize("value, included", [("-1", None), ("", None), ("1,-1,0", "localhost:1"), ("3, -1", "localhost:3")])
def test_a_cuda_visible_devices_that_hides_gpus_is_read_as_cuda_reads_it(tmp_path, monkeypatch, value, included):
    """CUDA reads CUDA_VISIBLE_DEVICES up to its first invalid entry: `-1` hides every GPU. It was taken for GPUs named
    by UUID (a warning saying so) and the ranks launched with --num_gpus, for which DeepSpeed's launcher drops the
    variable: the run took GPU 0 on a node where the user had hidden them all. The refusal said the variable 'hides
    every GPU from this process', untrue on a machine without GPUs; it is worded as the plan's note is."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    single = Launcher(DeploymentType.SINGLE_GPU, num_gpus=1)
    if included is None:
        with pytest.raises(UserError) as refused:
            single.command_now(tmp_path / "main.py", [])
        assert str(refused.value) == (
            f"CUDA_VISIBLE_DEVICES={value!r} lets this process see no GPU, whether or not this machine has any, and "
            "DeepSpeed's launcher would drop it and start the ranks on the GPUs from 0; where this machine has some, "
            "unset the variable or list the GPUs to run on (nvidia-smi -L gives their indices), else run with "
            "--deployment-type cpu")
        # a dry run launches nothing: it shows the command a machine without the restriction would run
        assert single.command_now(tmp_path / "main.py", [], check_gpus=False)[6:8] == ["--num_gpus", "1"]
    else:
        assert single.command_now(tmp_path / "main.py", [])[6:8] == ["--include", included]

def test_the_launcher_starts_without_a_deepspeed_script_on_path(tmp_path):
    """An unactivated virtual environment: its python runs train.py, but its bin/ is not on PATH."""
    from training.pipeline.launch import run_subprocess

    script = tmp_path / "main.py"
    script.write_text("import os, sys\nprint('rank', os.environ['LOCAL_RANK'], 'of', os.environ['WORLD_SIZE'], sys.argv[1:])\n")
    env = {**step_env(), "PATH": "/usr/bin:/bin"}
    assert shutil.which("deepspeed", path=env["PATH"]) is None
    log = tmp_path / "step1.log"
    command = Launcher(DeploymentType.SINGLE_GPU, num_gpus=1, master_port=free_port()).command(script, ["--x", "1"])
    run_subprocess(command, log, "step 1", env=env)
    assert "rank 0 of 1 ['--x', '1']" in log.read_text()


RANK_THAT_SAVES_ON_A_STOP = """
import sys, time
from training.reliability.signals import GracefulInterrupt
with GracefulInterrupt() as stop:
    print("ready", flush=True)
    waited_until = time.monotonic() + 30
    while not stop.requested:
        if time.monotonic() > waited_until:
            sys.exit("no stop request reached this rank")
        time.sleep(0.05)
    time.sleep(1.0)  # the checkpoint's save, printing as it goes (a closed pipe killed the rank here)
    print("saved, after", stop.received.name, flush=True)
    time.sleep(0.5)
    print("still here: no second signal aborted the save", flush=True)
    stop.exit_for_resume(1, "checkpoints/step1")
"""

PARENT = """
import sys
from training.pipeline.launch import StepStopped, run_subprocess
from training.reliability.signals import take_received_signal
try:
    run_subprocess(sys.argv[2:], __import__("pathlib").Path(sys.argv[1]), "step 1")
except StepStopped:
    print("PARENT: step stopped on", take_received_signal().name, flush=True)
"""


def _output_once_stopped_when_ready(parent: subprocess.Popen, sig: signal.Signals, to_the_group: bool) -> str:
    """The output of `parent` (started in a session of its own), sent `sig` once it prints "ready": to its process
    group (a terminal's Ctrl-C) or to it alone (`kill`); it must then exit 0."""
    for line in parent.stdout:
        if line.strip() == "ready":
            if to_the_group:
                os.killpg(parent.pid, sig)
            else:
                parent.send_signal(sig)
            break
    output = parent.communicate(timeout=120)[0]
    assert parent.returncode == 0, output[-3000:]
    return output


@pytest.mark.slow
@pytest.mark.parametrize("sig, to_the_group, the_ranks_see", [
    (signal.SIGINT, True, signal.SIGINT),  # Ctrl-C in a terminal: train.py's whole process group, the ranks too
    (signal.SIGTERM, False, signal.SIGTERM),  # `kill`, a scheduler: train.py alone
    (signal.SIGINT, False, signal.SIGTERM),  # `kill -INT`: train.py alone
], ids=["ctrl_c", "kill", "kill_int"])
def test_a_stop_request_under_the_launcher_reaches_the_ranks_once_and_their_save_completes(tmp_path, sig, to_the_group,
                                                                                           the_ranks_see):
    """Under the launcher, a Ctrl-C killed train.py with a KeyboardInterrupt (a SIGTERM, silently) while it read the
    ranks' output: their next print hit the closed pipe (BrokenPipeError) and the step died before its checkpoint.
    A SIGINT sent to train.py alone was not passed on: the step ran to its end. The ranks take a stop request as a
    SIGTERM, which a Ctrl-C's own SIGINT then does not make a second interrupt (that would abort their save)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_THAT_SAVES_ON_A_STOP)
    command = Launcher(DeploymentType.SINGLE_GPU, num_gpus=1, master_port=free_port()).command(script, [])
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "step1.log"), *command], cwd=REPO_ROOT,
                              env=step_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)  # its own group, as a terminal's foreground job
    output = _output_once_stopped_when_ready(parent, sig, to_the_group)
    assert f"saved, after {the_ranks_see.name}" in output and "still here" in output, output[-3000:]
    assert f"PARENT: step stopped on {sig.name}" in output
    assert "BrokenPipeError" not in output


STEP_THAT_SAVES_ON_A_STOP = """
import os, signal, sys, time
marker = sys.argv[1]
signal.signal(signal.SIGTERM, lambda signum, frame: open(marker, "w").write("SIGTERM"))
print("ready", flush=True)
waited_until = time.monotonic() + 20
while not os.path.exists(marker) and time.monotonic() < waited_until:
    time.sleep(0.05)
print("saved", flush=True)
sys.exit(3 if os.path.exists(marker) else 0)
"""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a file every write to fails")
@pytest.mark.parametrize("through_pdsh", [False, True], ids=["launcher", "pdsh"])
def test_a_step_whose_output_cannot_be_copied_is_stopped_and_waited_for(tmp_path, through_pdsh, capfd):
    """A failed write of the step's output (the log's disk full) left run_subprocess at once: train.py ended with the
    launcher and its ranks running on unwatched (and the stop command's thread waiting). They now get a stop request
    (the launcher's processes a SIGTERM, or through pdsh the stop command) and train.py waits for them before the
    error goes on."""
    from training.pipeline.launch import run_subprocess

    marker = tmp_path / "stopped"
    stop_ranks = [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('stop command')"] if through_pdsh else None
    with pytest.raises(OSError, match="No space left"):
        run_subprocess([sys.executable, "-c", STEP_THAT_SAVES_ON_A_STOP, str(marker)], Path("/dev/full"), "step 1",
                       stop_ranks=stop_ranks)
    assert marker.read_text() == ("stop command" if through_pdsh else "SIGTERM")
    assert psutil.Process().children(recursive=True) == []
    assert "stop-ranks" not in [thread.name for thread in threading.enumerate()]
    assert "step 1: copying its output failed" in capfd.readouterr().err


def _train(*args, timeout=300):
    """train.py run with `args`; `timeout` guards against a hang alone (its start-up took over 60 s on a loaded 2-core
    machine)."""
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO_ROOT, env=step_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_multi_node_with_a_bad_hostfile_fails_fast_with_a_clear_message(tmp_path):
    """The hostfile is refused before anything starts: no launcher, pdsh or ssh to worker-1 waiting on the network.
    Timed in this process, past the imports: the check takes milliseconds, while train.py's start-up alone, in a
    subprocess, took 36 s to over 60 s on a loaded 2-core machine and would make any bound on it a measure of the
    load. The subprocess run checks what the user sees."""
    from training.pipeline.cli import run

    hostfile = write(tmp_path / "hosts", "worker-1 slots=8\nworker-2 slots=0\n")
    argv = ["--deployment-type", "multi_node", "--hostfile", hostfile, "--output-dir", str(tmp_path / "out")]
    started = time.perf_counter()
    with pytest.raises(UserError, match="worker-2 has slots=0"):
        run(argv)
    assert time.perf_counter() - started < 10
    result = _train(*argv)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {hostfile}:2: worker-2 has slots=0; slots must be a positive GPU count"
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()

    missing = _train("--deployment-type", "multi_node", "--output-dir", str(tmp_path / "out"))
    assert missing.returncode == 2 and "needs --hostfile" in missing.stderr


def test_dry_run_prints_the_multi_node_launch_commands(tmp_path, tiny_model_dir, capsys):
    from training.pipeline.cli import run

    model = tiny_model_dir("llama")
    hostfile = write(tmp_path / "hosts", "worker-1 slots=2\nworker-2 slots=2\n")
    out = tmp_path / "out"
    summary = run(["--deployment-type", "multi_node", "--hostfile", hostfile, "--actor-model", model,
                   "--reward-model", model, "--output-dir", str(out), "--dry-run", "--learning_rate", "3e-5"])
    printed = capsys.readouterr().out
    assert "deployment: multi_node (4 processes)" in printed
    for step, script in ((1, "step1_sft/main.py"), (2, "step2_reward/main.py"), (3, "step3_rlhf/main.py")):
        command = summary["commands"][step]
        assert command[:6] == LAUNCHER + ["--hostfile", hostfile]
        assert command[6].endswith(script)
        assert f"step {step}: {shlex.join(LAUNCHER)} --hostfile {hostfile} " in printed
    step3 = summary["commands"][3]
    assert step3[step3.index("--actor_model_name_or_path") + 1] == str(out / "step1")
    assert step3[step3.index("--critic_model_name_or_path") + 1] == str(out / "step2")
    assert summary["commands"][1][-2:] == ["--learning_rate", "3e-5"]  # passed through to the steps that take it
    assert not out.exists()  # nothing was run


@pytest.mark.slow
def test_single_gpu_launches_a_step_through_the_deepspeed_launcher(tmp_path, tiny_model_dir, monkeypatch):
    """On this CPU machine the launcher starts one CPU rank; the path is the one a GPU machine takes."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    model = tiny_model_dir("llama")
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(
        f'{{"prompt": " Human: count to {i} Assistant:", "chosen": " {i} {i + 1}"}}\n' for i in range(30)
    ))
    out = tmp_path / "out"
    result = _train("--step", "1", "--deployment-type", "single_gpu", "--actor-model", model, "--output-dir", str(out),
                    "--data_path", str(data), "--data_output_path", str(tmp_path / "cache"), "--max_steps", "1",
                    "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--dtype", "fp32",
                    "--max_eval_samples", "2", timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"step 1: {shlex.join(LAUNCHER)} --hostfile {os.devnull} --num_gpus 1 --master_port " in result.stdout
    log = (out / "logs" / "step1.log").read_text()
    assert log.startswith(f"$ {shlex.join(LAUNCHER)}") and "step1_sft" in log  # the step's own output, teed
    assert (out / "step1" / "model" / "config.json").is_file()
    assert json.loads((out / "summary.json").read_text())["deployment"] == "single_gpu"


def test_the_quick_run_on_the_task_sizes_step3_by_answers_and_the_algorithms_models():
    grpo = plan_cpu(ModelSizes(SMALL, SMALL), TWO_CORES,
                    workload=Workload(critic=False, reward_model=False, samples_per_prompt=4, verifiable_task=True))
    ppo = plan_cpu(ModelSizes(SMALL, SMALL), TWO_CORES,
                   workload=Workload(critic=True, reward_model=False, samples_per_prompt=1, verifiable_task=True))
    quick = CpuQuickRun()
    for plan, prompts in ((grpo, 8), (ppo, 32)):  # 32 answers a step either way
        flags = plan.steps[3].flags
        assert flags["per_device_generation_batch_size"] == prompts and flags["per_device_training_batch_size"] == 16
        assert (flags["max_prompt_seq_len"], flags["max_answer_seq_len"], flags["eval_samples"]) == (64, 32, 80)
    usable = quick.step_budget_s[2] - quick.step_overhead_s[2]
    assert grpo.steps[3].flags["max_steps"] == int(usable / (32 * quick.task_answer_s))
    assert ppo.steps[3].flags["max_steps"] == int(usable / (32 * quick.task_answer_s * quick.task_critic_factor))


def test_a_critic_free_algorithm_plans_gpu_memory_for_the_actor_alone_and_k_answers_per_prompt():
    def plan(memory_gib, workload=Workload()):
        gpu = Hardware(num_gpus=1, gpu_memory_gib=memory_gib, cpu_memory_gib=512, cpu_cores=32, bf16=True)
        return plan_gpu(DeploymentType.SINGLE_GPU, ModelSizes(B7, B7), gpu, None, workload).steps[3].flags

    grpo = Workload(critic=False, reward_model=False, samples_per_prompt=4)
    # 7B actor + critic (trained) + reference + reward (frozen) need LoRA on 40 GiB; the actor and its
    # reference alone train in full; on 80 GiB they step down from ZeRO-3 to ZeRO-2
    assert plan(40)["actor_lora_dim"] == 128 and plan(40, grpo)["actor_lora_dim"] == 0
    assert plan(80)["actor_zero_stage"] == 3 and plan(80, grpo)["actor_zero_stage"] == 2
    flags = plan(80, grpo)
    assert flags["per_device_generation_batch_size"] * 4 == flags["per_device_training_batch_size"]


@pytest.mark.parametrize("deployment", ["cpu", "single_gpu", "single_node"])
def test_train_py_under_a_launcher_of_several_ranks_refuses_before_planning(tmp_path, monkeypatch, deployment):
    """`deepspeed train.py` or `torchrun --nproc_per_node 8 train.py`: every rank planned the run and started a
    launcher of its own on every GPU (or ran the steps in a world the plan did not size), all in one folder."""
    from training.pipeline.cli import run

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"started by a launcher as rank 1 of 2 processes.*Run it once"):
        run(["--deployment-type", deployment, "--step", "1", "--output-dir", str(out), "--dry-run"])
    assert not out.exists()


def test_steps_launched_by_train_py_that_torchrun_started_as_its_only_rank_get_none_of_torchruns_variables(monkeypatch):
    """`torchrun --nproc_per_node 1 train.py`: the variables torchrun set for train.py reached the step's ranks under
    DeepSpeed's launcher, which sets RANK, MASTER_PORT and the like anew but not TORCHELASTIC_*: with torchrun's
    agent-store flag every rank, rank 0 too, waited for a store no one served (init_process_group hung until its
    30-minute timeout)."""
    from training.pipeline.launch import launcher_env
    from utils.dist import launcher_variables

    torchrun_set = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": "29400", "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "none"}
    for name, value in torchrun_set.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", "/site")
    env = launcher_env(REPO_ROOT)
    assert launcher_variables(env) == []
    assert env["PYTHONPATH"] == f"{REPO_ROOT}{os.pathsep}/site" and env["HOME"] == os.environ["HOME"]


def _as_each_node_reads(script: str, user_args: list[str]) -> list[str] | None:
    """The script and flags each node's shell gives the step, from the command line DeepSpeed's own PDSH runner
    hands pdsh (None: the shell fails on it)."""
    import argparse

    from deepspeed.launcher.multinode_runner import PDSHRunner

    args = argparse.Namespace(user_args=user_args, user_script=script, ssh_port=None, launcher_args="",
                              master_addr="10.0.0.1", master_port=29500, venv_script=None, no_python=False, module=False,
                              no_local_rank=True, save_pid=False, enable_each_rank_log=None)
    command = PDSHRunner(args, "e30=").get_cmd({}, {"worker-1": [0], "worker-2": [0]})[0]
    remote = " ".join(command[command.index(f"--master_port={args.master_port}") + 2:])  # after --no_local_rank
    shown = subprocess.run(["bash", "-c", f"printf '%s\\0' {_as_pdsh_formats(remote)}"], capture_output=True, text=True)
    return shown.stdout.split("\0")[:-1] if shown.returncode == 0 else None


def _as_pdsh_formats(command: str, host: str = "worker-2", user: str = "me", node_rank: int = 1) -> str:
    """The command pdsh runs on a node: it rewrites %h, %u and %n (the node, the user, its rank: DeepSpeed's
    `--node_rank=%n`) and %% in it."""
    values = {"h": host, "u": user, "n": str(node_rank), "%": "%"}
    return re.sub(r"%([hun%])", lambda match: values[match[1]], command)


@pytest.mark.parametrize("value, reaches_the_step", [
    ("/runs/my run/step1", True),  # a space: DeepSpeed double-quotes it
    ('say "hi" (twice)', True),
    ("a=0.5,b=0.25", True),
    ("/data/o'brien.jsonl", False),  # the shell fails on the quote
    ("/data/set(1).jsonl", False),
    ("data/*.jsonl", False),  # a glob: the files it matches there
    ("$HOME/cost is $5", False),  # expanded even in double quotes
    ("", False),  # an empty value disappears
    ("/data/50%noise.jsonl", False),  # pdsh puts the node's rank for %n
    ("/runs/100%% clean", False),
])
def test_a_multi_node_command_is_refused_where_each_nodes_shell_would_misread_it(tmp_path, monkeypatch, value,
                                                                                 reaches_the_step):
    """On several nodes DeepSpeed's launcher starts every node's ranks through pdsh, one unquoted command line that
    each node's shell parses: a flag value with a quote failed there, after the ssh checks, on the cluster."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "data" / name).write_text("")
    script, argv = str(REPO_ROOT / "step1_sft" / "main.py"), ["--data_path", value, "--seed", "1"]
    assert (_as_each_node_reads(script, argv) == [script, *argv]) is reaches_the_step
    two_nodes = Launcher(DeploymentType.MULTI_NODE, hostfile="/h", nodes=2)
    if reaches_the_step:
        assert two_nodes.command(Path(script), argv)[-5:] == [script, *argv]
    else:
        with pytest.raises(UserError, match=f"multi_node: the step flag value {re.escape(repr(value))} would reach"):
            two_nodes.command(Path(script), argv)
    assert Launcher(DeploymentType.MULTI_NODE, hostfile="/h", on_this_machine=True).command(Path(script), argv)[-4:] \
        == argv


@pytest.mark.parametrize("host, here", [("worker-1", False), ("localhost", True), (socket.gethostname(), True),
                                        ("127.0.0.1", True)])
def test_a_hostfile_of_one_node_starts_the_ranks_on_that_node(tmp_path, tiny_model_dir, host, here):
    """DeepSpeed's launcher starts the ranks of a hostfile's single node on the machine it runs on, not through pdsh
    on that node: `--hostfile` naming one compute node, run from a login node, ran the step there, its rank 0 told
    the compute node's address for the store it serves itself. A node other than this machine is now reached as
    several are (`--force_multi`), its command line read by that node's shell (so checked)."""
    from deepspeed.launcher.runner import parse_args

    from training.pipeline.cli import run

    hostfile = write(tmp_path / "hosts", f"{host} slots=1\n")  # a GPU machine running the suite has one or more
    argv = ["--deployment-type", "multi_node", "--hostfile", hostfile, "--step", "1", "--actor-model",
            tiny_model_dir("llama"), "--output-dir", str(tmp_path / "out"), "--dry-run"]
    launched = parse_args(run(argv)["commands"][1][3:])
    assert (launched.force_multi, launched.hostfile) == (not here, hostfile)
    quoted = tmp_path / "o'brien.jsonl"
    quoted.write_text('{"prompt": " Human: hi Assistant:", "chosen": " hello"}\n')
    refused = pytest.raises(UserError, match="would reach each node's shell") if not here else contextlib.nullcontext()
    with refused:
        run([*argv, "--data_path", str(quoted)])


@pytest.mark.parametrize("hosts, gpus_here, visible, refused", [
    ("localhost slots=8\nworker-1 slots=8\n", 4, None, "'localhost slots=8' names this machine, which has 4 GPUs"),
    ("worker-1 slots=8\n127.0.0.1 slots=2\n", 1, None, "'127.0.0.1 slots=2' names this machine, which has 1 GPU;"),
    ("localhost slots=4\nworker-1 slots=8\n", 4, None, None),  # another node's GPUs are that node's to know
    ("localhost slots=8\n", 0, None, None),  # planned from a machine without a GPU: its count says nothing
    ("localhost slots=8\n", 4, "0,1,2,3", None),  # the launcher gives the ranks GPUs 0-7 whatever it says
    ("gpu-node-7-ib slots=8\nworker-1 slots=8\n", 4, None, "'gpu-node-7-ib slots=8' names this machine"),  # looked up
])
def test_a_hostfile_line_giving_this_machine_more_slots_than_its_gpus_is_refused_before_step_1(
        tmp_path, tiny_model_dir, monkeypatch, hosts, gpus_here, visible, refused):
    """`localhost slots=8` on a 4-GPU machine was planned and launched: DeepSpeed's launcher started ranks on GPUs 4
    to 7, each failing on an invalid device once started. Refused while planning, naming the line."""
    from training.pipeline.cli import parse_config
    from training.pipeline.runner import run_pipeline

    monkeypatch.setattr(socket, "getaddrinfo", _stand_in_resolver)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    hostfile = write(tmp_path / "hosts", hosts)
    here = Hardware(num_gpus=gpus_here, gpu_memory_gib=80 if gpus_here else None, cpu_memory_gib=1000, cpu_cores=96,
                    bf16=True)
    config = parse_config(["--deployment-type", "multi_node", "--hostfile", hostfile, "--step", "1", "--actor-model",
                           tiny_model_dir("llama"), "--output-dir", str(tmp_path / "out"), "--dry-run"])
    if refused is None:
        assert run_pipeline(config, hardware=here)["commands"][1][4:6] == ["--hostfile", hostfile]
    else:
        with pytest.raises(UserError, match=re.escape(f"{hostfile}: {refused}")):
            run_pipeline(config, hardware=here)


def test_a_multi_node_run_from_a_folder_or_project_path_with_a_space_is_refused(tmp_path, monkeypatch):
    spaced = tmp_path / "my runs"
    spaced.mkdir()
    assert _as_each_node_reads(str(spaced / "main.py"), []) == [str(tmp_path / "my"), "runs/main.py"]  # split
    two_nodes = Launcher(DeploymentType.MULTI_NODE, hostfile="/h", nodes=2)
    with pytest.raises(UserError, match=r"multi_node: the step's script .*my runs/main.py.* unquoted"):
        two_nodes.command(spaced / "main.py", [])
    monkeypatch.setattr(sys, "executable", str(spaced / "bin" / "python"))  # each node's line starts with it
    with pytest.raises(UserError, match=r"multi_node: this python \(each node's ranks start under it\) .*my runs"):
        two_nodes.command(REPO_ROOT / "step1_sft" / "main.py", [])
    monkeypatch.undo()
    monkeypatch.chdir(spaced)
    with pytest.raises(UserError, match=r"multi_node: this folder \(train.py's working directory.*my runs"):
        two_nodes.command(REPO_ROOT / "step1_sft" / "main.py", [])


def test_a_master_port_its_last_run_left_in_time_wait_is_free_as_the_ranks_store_binds_it():
    """The check bound without SO_REUSEADDR, which c10d's store sets: a rerun within a minute of a run on the same
    --master-port was refused as 'taken'."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from training.pipeline.launch import check_port_free

    port = free_port()
    store = TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    rank_1 = TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
    rank_1.set("key", "value")
    assert store.get("key") == b"value"
    del store, rank_1  # the server's side closes first: its connection holds the port in TIME_WAIT
    check_port_free(port)


def test_a_single_node_run_stays_on_this_node_where_the_cluster_has_a_default_hostfile(tmp_path, monkeypatch,
                                                                                      tiny_model_dir):
    """Given no --hostfile, DeepSpeed's launcher reads /job/hostfile (DLTS_HOSTFILE) where one exists: a single_node
    run was spread over the nodes it lists (or refused its --include localhost)."""
    from deepspeed.launcher import runner

    from training.pipeline.cli import run

    monkeypatch.setattr(runner, "DLTS_HOSTFILE", write(tmp_path / "job_hostfile", "worker-1 slots=8\n"))
    common = ["--step", "1", "--actor-model", tiny_model_dir("llama"), "--output-dir", str(tmp_path / "out"),
              "--dry-run"]
    for deployment in ("single_gpu", "single_node"):
        launched = runner.parse_args(run([*common, "--deployment-type", deployment])["commands"][1][3:])
        assert runner.fetch_hostfile(launched.hostfile) is None, deployment  # this node's GPUs only


def test_the_master_port_and_address_reach_the_launcher_and_a_taken_port_is_refused_before_anything_starts(tmp_path,
                                                                                                           tiny_model_dir):
    """A multi-node run relaunched after a crash whose ranks still hold 29500 on the first node, or whose first node's
    `hostname -I` lists another network first, had no way to move them: train.py took no --master-port and refused
    --master_port as a flag no step accepts."""
    from deepspeed.launcher.runner import parse_args

    from training.pipeline.cli import run

    model = tiny_model_dir("llama")
    hostfile = write(tmp_path / "hosts", "worker-1 slots=2\nworker-2 slots=2\n")
    common = ["--step", "1", "--actor-model", model, "--output-dir", str(tmp_path / "out"), "--dry-run"]
    command = run([*common, "--deployment-type", "multi_node", "--hostfile", hostfile, "--master-port", "29731",
                   "--master-addr", "10.0.0.1"])["commands"][1]
    launched = parse_args(command[3:])  # as DeepSpeed's launcher reads its command line
    assert (launched.hostfile, launched.master_port, launched.master_addr) == (hostfile, 29731, "10.0.0.1")
    assert launched.user_script == str(REPO_ROOT / "step1_sft" / "main.py")

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"--master-port {port} is taken on this machine"):
            run([*common, "--deployment-type", "single_gpu", "--master-port", str(port)])
    assert parse_args(run([*common, "--deployment-type", "single_gpu", "--master-port", str(port)])["commands"][1][3:]
                      ).master_port == port
    with pytest.raises(UserError, match="--master-addr is for --deployment-type multi_node; this run is single_gpu"):
        run([*common, "--deployment-type", "single_gpu", "--master-addr", "10.0.0.1"])
    with pytest.raises(UserError, match="--master-port is the launcher's, and the cpu deployment"):
        run([*common, "--deployment-type", "cpu", "--master-port", "29731"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("master_addr, refused", [
    ("", "is not a host name or an IP address"),
    ("node-1:29500", "write the host alone, and the port with --master-port"),
    ("tcp://node-1", "write the host alone, without the scheme"),
    ("node 1", "is not a host name"),
    (" node-1", "is not a host name"),
    ("-node", "is not a host name"),
    ("10.0.0.999", r"not all of them all digits\); an IPv4 address is four numbers from 0 to 255"),
    ("1.2.3", "an IPv4 address is four numbers from 0 to 255"),
    ("node-1.cluster.local", None),
    ("gpu.1", None),
    ("node01", None),
    ("10.0.0.1", None),
    ("fe80::1%eth0", None),
])
def test_a_master_address_that_is_no_host_is_refused_naming_the_flag(tmp_path, master_addr, refused):
    """--master-addr reached every rank unchecked: an empty one, 'host:port', a URL or a space failed in torch's
    rendezvous on each node, naming neither the value nor the flag. '10.0.0.999' and '1.2.3' passed as host names
    (all-digit parts were allowed, the last too). 'gpu.1', whose last part alone is all digits, is a name some
    clusters' /etc/hosts resolve (it was refused as the last part was all digits)."""
    from training.pipeline.cli import run

    hostfile = write(tmp_path / "hosts", "localhost slots=1\n")
    argv = ["--deployment-type", "multi_node", "--hostfile", hostfile, f"--master-addr={master_addr}", "--step", "1",
            "--output-dir", str(tmp_path / "out"), "--dry-run"]
    if refused is None:
        assert "--master_addr" in run(argv)["commands"][1]
        return
    with pytest.raises(UserError, match=f"^--master-addr {re.escape(repr(master_addr))} .*{refused}"):
        run(argv)


@pytest.mark.parametrize("on_path, missing", [((), "pdsh and ssh are"), (("ssh",), "pdsh is"), (("pdsh",), "ssh is"),
                                              (("pdsh", "ssh"), None)])
def test_a_run_on_other_nodes_without_pdsh_or_ssh_here_is_refused_by_a_dry_run(tmp_path, monkeypatch, on_path, missing):
    """DeepSpeed's launcher starts other nodes' ranks with pdsh over ssh: on a machine without them a multi_node run
    planned, and a dry run printed its commands, and the launcher failed only as step 1 launched. A hostfile of this
    machine alone launches without them."""
    from training.pipeline.cli import run

    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in on_path:
        (tools / tool).write_text("#!/bin/sh\nexit 0\n")
        (tools / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(tools))
    common = ["--step", "1", "--output-dir", str(tmp_path / "out"), "--dry-run", "--deployment-type", "multi_node"]
    others = [*common, "--hostfile", write(tmp_path / "others", "worker-1 slots=1\nworker-2 slots=1\n")]
    if missing is None:
        assert run(others)["commands"][1]
    else:
        with pytest.raises(UserError, match=f"^multi_node: {missing} not on PATH here.*install them here"):
            run(others)
    assert run([*common, "--hostfile", write(tmp_path / "here", "localhost slots=1\n")])["commands"][1]


@pytest.mark.parametrize("first_host, nodes, master_addr, checked_here", [
    ("localhost", 1, None, True),  # a hostfile of this node alone: every rank, rank 0 too, runs here
    ("localhost", 2, None, True),  # rank 0 here, the others through pdsh
    ("127.0.0.1", 2, "127.0.0.1", True),
    ("localhost", 2, "10.255.255.1", False),  # rank 0's store is served at another address
    ("worker-1", 2, None, False),  # another node's port, which this machine cannot check
])
def test_a_multi_node_master_port_is_checked_free_where_rank_0_runs_on_this_machine(monkeypatch, first_host, nodes,
                                                                                    master_addr, checked_here):
    """A hostfile naming this node (first) ran rank 0 here on the given --master-port, or DeepSpeed's 29500,
    unchecked: one taken (another run, a crashed one's ranks) failed every rank as its store bound, where a
    single_node run is refused before anything starts, or given a free port. A hostfile of this node alone now gets a
    free one as single_node does; with other nodes the port stays DeepSpeed's (their firewalls may open it alone),
    checked free here."""
    from training.pipeline import launch

    script = Path("/x/main.py")
    here = first_host != "worker-1"
    planned = Launcher(DeploymentType.MULTI_NODE, hostfile="/h", nodes=nodes, on_this_machine=here,
                       master_addr=master_addr)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refusal = pytest.raises(UserError, match=f"--master-port {port} is taken on this machine") if checked_here \
            else contextlib.nullcontext()
        with refusal:
            dataclasses.replace(planned, master_port=port).command_now(script, [])
        monkeypatch.setattr(launch, "DEEPSPEED_MASTER_PORT", port)
        refusal = pytest.raises(UserError, match=f"DeepSpeed's default master port {port} is taken on this machine.*"
                                                 "choose a free one with --master-port")
        if checked_here and nodes > 1:
            with refusal:
                planned.command_now(script, [])
        else:
            settled = planned.command_now(script, [])
            assert ("--master_port" in settled) is checked_here
            if checked_here:
                launch.check_port_free(int(settled[settled.index("--master_port") + 1]))


def _start_fake_rank(script: Path, argv: list[str]) -> subprocess.Popen:
    """A process with a rank's command line as DeepSpeed's per-node launcher starts it (`python -u SCRIPT FLAGS`)."""
    return subprocess.Popen([sys.executable, "-u", str(script), *argv], start_new_session=True)


def test_a_stop_request_reaches_the_ranks_of_this_step_on_every_node_through_pdsh_and_those_alone(tmp_path):
    """Through pdsh a stop request reached the ranks only through DeepSpeed's launcher, which kills pdsh (and with it
    the ssh carrying the ranks' output) and exits at once. The command train.py now runs on every node instead
    matches this step's ranks, by its script and run folder, and no other process."""
    script = tmp_path / "main.py"
    script.write_text("import time\ntime.sleep(60)\n")
    argv = ["--actor_model_name_or_path", "/m", "--output_dir", str(tmp_path / "my run" / "step1"), "--seed", "1"]
    launcher = Launcher(DeploymentType.MULTI_NODE, hostfile="/h", nodes=2, hosts=("worker-1", "worker-2"))
    command = launcher.ranks_stop_command(script, argv)
    assert command[:6] == ["env", "PDSH_RCMD_TYPE=ssh", "pdsh", "-S", "-w", "worker-1,worker-2"]
    assert Launcher(DeploymentType.MULTI_NODE, hostfile="/h", on_this_machine=True).ranks_stop_command(script, argv) \
        is None  # this node's ranks, under the launcher train.py started: signalled as its children
    unlike = tmp_path / "mainXpy"  # the pattern's "." is a dot
    unlike.write_text(script.read_text())
    rank = _start_fake_rank(script, argv)
    other_runs = [_start_fake_rank(script, [*argv[:3], str(tmp_path / "my run" / "step1b")]),
                  _start_fake_rank(unlike, argv)]
    try:
        time.sleep(0.5)
        subprocess.run(["bash", "-c", _as_pdsh_formats(command[-1])], check=True, timeout=30)  # as each node runs it
        assert rank.wait(timeout=10) == -signal.SIGTERM
        assert [other.poll() for other in other_runs] == [None, None]
    finally:
        for process in [rank, *other_runs]:
            process.kill()
            process.wait()


NODE_LAUNCHER = """
import subprocess, sys
status = subprocess.call([sys.executable, "-u", *sys.argv[2:]])
open(sys.argv[1], "w").write(str(status))
"""

LAUNCHER_THROUGH_PDSH = """
import signal, subprocess, sys
status_file = sys.argv[1]
relay = subprocess.Popen(["cat"], stdin=subprocess.PIPE)  # pdsh and ssh: the only way the ranks' output comes here
detached = "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True)"  # on another node
subprocess.call([sys.executable, "-c", detached, sys.executable, "-c", sys.argv[2], status_file, *sys.argv[3:]],
                stdout=relay.stdin)
relay.stdin.close()

def cut_off(signum, frame):  # DeepSpeed's launcher under pdsh: kill pdsh, then exit
    relay.kill()
    sys.exit(1)

signal.signal(signal.SIGINT, cut_off)
signal.signal(signal.SIGTERM, cut_off)
relay.wait()
sys.exit(int(open(status_file).read()))
"""

FAKE_PDSH = """#!/bin/sh
# pdsh over ssh to nodes that all are this machine: the command runs once a node; pdsh exits 0 whatever they return,
# or with -S the largest of their statuses
[ "$PDSH_RCMD_TYPE" = ssh ] || { echo "pdsh: not over ssh" >&2; exit 9; }
largest=0 statuses=no
while getopts Sw: option; do
  case $option in S) statuses=yes ;; w) hosts=$OPTARG ;; *) exit 1 ;; esac
done
shift $((OPTIND - 1))
for host in $(echo "$hosts" | tr , ' '); do
  bash -c "$1"
  status=$?
  [ "$status" -gt "$largest" ] && largest=$status
done
[ "$statuses" = yes ] && exit "$largest"
exit 0
"""


def _path_with_fake_pdsh(tmp_path: Path) -> str:
    """PATH with `FAKE_PDSH` as pdsh first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pdsh").write_text(FAKE_PDSH)
    (bin_dir / "pdsh").chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"

PARENT_THROUGH_PDSH = """
import json, sys
from pathlib import Path
from training.pipeline.launch import StepStopped, run_subprocess
from training.reliability.signals import take_received_signal
try:
    run_subprocess(json.loads(sys.argv[2]), Path(sys.argv[1]), "step 1", stop_ranks=json.loads(sys.argv[3]))
except StepStopped:
    print("PARENT: step stopped on", take_received_signal().name, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig, to_the_group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl_c", "kill"])
def test_a_stop_request_through_pdsh_lets_the_ranks_on_other_nodes_save_and_report(tmp_path, sig, to_the_group):
    """Through pdsh a stop request went to DeepSpeed's launcher (passed on, or a terminal's Ctrl-C): it killed pdsh,
    and with it the ssh carrying the ranks' output, and exited: the ranks' next print failed on the closed pipe,
    before their checkpoint, and train.py had already reported the step stopped. Here the launcher, pdsh and the
    remote ranks are stand-ins (a relay process carries the ranks' output; pdsh runs its command in a shell here)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_THAT_SAVES_ON_A_STOP)
    argv = ["--output_dir", str(tmp_path / "out" / "step1")]
    stop_ranks = Launcher(DeploymentType.MULTI_NODE, hostfile="/h", nodes=2, hosts=("w1", "w2")).ranks_stop_command(
        script, argv)
    launcher = [sys.executable, "-c", LAUNCHER_THROUGH_PDSH, str(tmp_path / "status"), NODE_LAUNCHER, str(script), *argv]
    env = {**step_env(), "PATH": _path_with_fake_pdsh(tmp_path)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT_THROUGH_PDSH, str(tmp_path / "step1.log"),
                               json.dumps(launcher), json.dumps(stop_ranks)], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = _output_once_stopped_when_ready(parent, sig, to_the_group)
    assert "saved, after SIGTERM" in output and "still here" in output, output[-3000:]
    assert f"PARENT: step stopped on {sig.name}" in output and "passing the stop request on to the ranks" in output
    assert "BrokenPipeError" not in output


def test_a_hostfile_of_this_node_alone_starts_its_ranks_without_ssh(tmp_path):
    """DeepSpeed's launcher starts the ranks of a hostfile's one node itself, yet first checked passwordless ssh to it
    and asked it over ssh for its address (`hostname -I`): a hostfile naming this machine failed where it runs no ssh
    server ('host=localhost was not reachable via ssh'). Its ranks reach rank 0 at the loopback address."""
    from training.pipeline.launch import run_subprocess

    script = tmp_path / "main.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'at', os.environ['MASTER_ADDR'])\n")
    hostfile = write(tmp_path / "hosts", "localhost slots=1\n")
    launcher = Launcher(DeploymentType.MULTI_NODE, hostfile=hostfile, on_this_machine=True, hosts=("localhost",))
    log = tmp_path / "step1.log"
    run_subprocess(launcher.command_now(script, []), log, "step 1", env={**step_env(), "PATH": "/usr/bin:/bin"})
    assert "rank 0 at 127.0.0.1" in log.read_text()


def _launcher_stopped_at_start(tmp_path: Path, stop_ranks: list[str], launcher: str) -> None:
    """Run `launcher` (Python code that first sends run_subprocess's process a SIGTERM: a stop request while the
    ranks start) with `stop_ranks` as the ranks' stop command; it must end in StepStopped."""
    from training.pipeline import launch
    from training.reliability.signals import take_received_signal

    request = "import os, signal, time; os.kill(os.getppid(), signal.SIGTERM)\n"
    try:
        with pytest.raises(launch.StepStopped):
            launch.run_subprocess([sys.executable, "-c", request + launcher], tmp_path / "step1.log", "step 1",
                                  stop_ranks=stop_ranks)
    finally:
        take_received_signal()


def test_a_stop_request_while_the_ranks_start_through_pdsh_reaches_them_once_they_run(tmp_path, monkeypatch):
    """Through pdsh a stop request taken while the launcher started ran the stop command once, at once: no rank ran
    yet on the nodes, pkill matched none, and the step ran on to its end. The stop command now runs again until it
    reaches a rank on every node (its status 0). Here it reports 'no rank matched' (1) until the rank has started."""
    from training.pipeline import launch

    monkeypatch.setattr(launch, "STOP_COMMAND_RETRY_S", 0.1, raising=False)
    rank, reached = tmp_path / "rank_runs", tmp_path / "reached"
    stop_ranks = [sys.executable, "-c", (f"import os, sys; os.path.exists({str(rank)!r}) or sys.exit(1); "
                                         f"open({str(reached)!r}, 'w')")]
    launcher = (f"time.sleep(0.5); open({str(rank)!r}, 'w')\n"
                "waited_until = time.monotonic() + 10\n"
                f"while not os.path.exists({str(reached)!r}) and time.monotonic() < waited_until: time.sleep(0.05)\n"
                f"raise SystemExit(3 if os.path.exists({str(reached)!r}) else 0)")
    _launcher_stopped_at_start(tmp_path, stop_ranks, launcher)
    assert reached.exists()


def test_a_stop_request_through_pdsh_that_matches_no_rank_on_a_node_is_said(tmp_path, monkeypatch, capfd):
    """pdsh exits 0 whatever its nodes' commands return (without -S), so a pkill that matched no rank on some node
    was not seen: the end of the step did not say that the stop request had never reached the ranks there."""
    from training.pipeline import launch

    monkeypatch.setattr(launch, "STOP_COMMAND_RETRY_S", 0.1, raising=False)
    monkeypatch.setenv("PATH", _path_with_fake_pdsh(tmp_path))
    stop_ranks = Launcher(DeploymentType.MULTI_NODE, hostfile="/h", nodes=2, hosts=("w1", "w2")).ranks_stop_command(
        tmp_path / "main.py", ["--output_dir", str(tmp_path / "step1")])  # no such rank runs
    _launcher_stopped_at_start(tmp_path, stop_ranks, "time.sleep(1); raise SystemExit(3)")
    err = capfd.readouterr().err
    assert "the stop request never reached a rank on some node" in err
    assert "matched no rank on some node (pkill's status 1)" in err
    assert "trying again" not in err  # no rank yet is what pdsh finds while it starts them: said at the end alone


def test_a_stop_command_through_pdsh_returning_1_for_long_is_said_once_as_it_goes_on(tmp_path, monkeypatch, capfd):
    """pdsh's own failures return 1, as pkill does where it matched no rank (what it finds while the ranks start, not
    said then): a pdsh failing on every run was taken for ranks not started yet, run again every 5 s without a word
    of train.py's until the launcher ended, hours on. Past `STOP_UNMATCHED_SAY_S` since the request it is said, once."""
    from training.pipeline import launch

    monkeypatch.setattr(launch, "STOP_COMMAND_RETRY_S", 0.1)
    monkeypatch.setattr(launch, "STOP_UNMATCHED_SAY_S", 0.3, raising=False)
    returning_1 = [sys.executable, "-c", "raise SystemExit(1)"]  # e.g. pdsh: 'No such rcmd module "ssh"'
    _launcher_stopped_at_start(tmp_path, returning_1, "time.sleep(1.5); raise SystemExit(3)")
    err = capfd.readouterr().err
    assert err.count(f"{launch.format_command(returning_1)} has returned 1 for 0.3 s since the stop request") == 1
    assert "pdsh failed (its own failures return 1 too" in err


def test_a_repeated_stop_request_keeps_the_clock_of_a_stop_command_returning_1(monkeypatch, capfd):
    """Each request restarted the 60 s after which a stop command returning 1 is said: a user repeating SIGTERM
    (or a scheduler's repeated signal) kept a pdsh failing on its own unsaid."""
    from training.pipeline import launch

    monkeypatch.setattr(launch, "STOP_COMMAND_RETRY_S", 0.05)
    monkeypatch.setattr(launch, "STOP_UNMATCHED_SAY_S", 1.5)
    returning_1 = ["false"]
    stopper = launch._RanksStopper(returning_1)
    stopper.request()
    time.sleep(1.2)
    stopper.request()  # 1.0 s before the end: under 1.5 s since this one, 2.2 s since the first
    time.sleep(1.0)
    stopper.finish()
    assert f"{launch.format_command(returning_1)} has returned 1 for 1.5 s since the stop request" in capfd.readouterr().err


def test_a_failed_stop_command_through_pdsh_is_said_at_once_and_at_the_end(tmp_path, monkeypatch, capfd):
    """A stop command that failed (not 'no rank matched': ssh's 255, pkill's 2 or 3) is said when it fails, and at the
    step's end, its ranks on some node never reached."""
    from training.pipeline import launch

    monkeypatch.setattr(launch, "STOP_COMMAND_RETRY_S", 0.1, raising=False)
    failing_stop = [sys.executable, "-c", "raise SystemExit(255)"]  # ssh could not reach a node
    _launcher_stopped_at_start(tmp_path, failing_stop, "time.sleep(1); raise SystemExit(3)")
    err = capfd.readouterr().err
    said = f"{launch.format_command(failing_stop)} could not reach some node (ssh's status 255)"
    assert err.count(said) == 1  # said once, not at each try
    assert "the stop request never reached a rank on some node" in err and "the last one could not reach" in err


def test_each_stop_request_through_pdsh_runs_the_ranks_stop_command(tmp_path, monkeypatch):
    """The stop command ran for the first request only: one that came before pdsh had started the ranks matched none,
    and a second SIGTERM, sent once they had, did nothing (only a second SIGINT, an abort, reached them). One that
    reached a rank on every node (status 0) is not run again before the next request."""
    from training.pipeline import launch
    from training.reliability.signals import take_received_signal

    monkeypatch.setattr(launch, "STOP_COMMAND_RETRY_S", 0.1, raising=False)
    runs = tmp_path / "runs"
    stop_ranks = [sys.executable, "-c", f"open({str(runs)!r}, 'a').write('x')"]
    requests = launch._StopRequests(stop_ranks)
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        requests.watch(launcher)
        for expected in ("x", "xx"):
            requests.take(signal.SIGTERM, None)
            waited_until = time.monotonic() + 20
            while (not runs.exists() or runs.read_text() != expected) and time.monotonic() < waited_until:
                time.sleep(0.05)
        time.sleep(0.5)
        assert launcher.poll() is None  # the launcher itself is not signalled
    finally:
        launcher.kill()
        launcher.wait()
        requests.launcher_ended()
        take_received_signal()
    assert runs.read_text() == "xx"


class _Launched(Exception):
    """Raised by a stand-in for `run_subprocess`: the launch train.py would run, taken without running it."""


def _multi_node_step_1(tmp_path: Path, model: str, hosts: str) -> list[str]:
    """train.py's flags for step 1 of a multi_node run on `hosts` (a hostfile's text)."""
    return ["--deployment-type", "multi_node", "--hostfile", write(tmp_path / "hosts", hosts), "--step", "1",
            "--actor-model", model, "--output-dir", str(tmp_path / "out")]


def _launch_env_of_step_1(monkeypatch, tmp_path: Path, model: str, hosts: str) -> dict[str, str]:
    """The environment train.py starts step 1's launcher in, for a multi_node run on `hosts` (a hostfile's text)."""
    from training.pipeline import runner
    from training.pipeline.cli import run

    def launched(command, log_path, label, env=None, stop_ranks=None, nodes=(), stop_status=None):
        raise _Launched(env)

    monkeypatch.setattr(runner, "run_subprocess", launched)
    with pytest.raises(_Launched) as taken:
        run(_multi_node_step_1(tmp_path, model, hosts))
    return taken.value.args[0]


def test_a_multi_node_launch_passes_the_ranks_on_other_nodes_what_they_read(tmp_path, tiny_model_dir, monkeypatch):
    """DeepSpeed's launcher passes the ranks it starts through pdsh only PYTHON*, MLFLOW*, MV2*, UCX* and (from a
    machine with a CUDA GPU) NCCL* variables, and its env file's: with HF_HUB_OFFLINE=1 they went to the hub there,
    with HF_HOME, TORCH_EXTENSIONS_DIR or RLHF_CACHE_DIR set they used other folders than this machine's. train.py
    names an env file of its own (DS_ENV_FILE) with those but the ones the user's .deepspeed_env lines set, then
    those lines, which win; no token."""
    model = tiny_model_dir("llama")
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir()
    here.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\n\nHF_HOME=/users/me/hf\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_HOME", "/data/hf"), ("TORCH_EXTENSIONS_DIR", "/data/ext"),
                        ("RLHF_CACHE_DIR", "/data/rlhf cache"), ("NCCL_DEBUG", "INFO"), ("HF_TOKEN", "hf_secret")):
        monkeypatch.setenv(name, value)
    env = _launch_env_of_step_1(monkeypatch, tmp_path, model, "worker-1 slots=1\nworker-2 slots=1\n")
    env_file = Path(env["DS_ENV_FILE"])
    assert env_file == tmp_path / "out" / "logs" / "deepspeed_env"
    lines = env_file.read_text().splitlines()
    for line in ("HF_HUB_OFFLINE=1", "TORCH_EXTENSIONS_DIR=/data/ext", "RLHF_CACHE_DIR=/data/rlhf cache",
                 "NCCL_DEBUG=INFO"):
        assert line in lines
    assert lines[-2:] == ["NCCL_IB_DISABLE=1", "HF_HOME=/users/me/hf"]  # read last, they win
    assert "HF_HOME=/data/hf" not in lines
    assert not [line for line in lines if "TOKEN" in line or line.startswith(("PATH=", "CUDA_VISIBLE_DEVICES="))]

    this_node_alone = _launch_env_of_step_1(monkeypatch, tmp_path, model, "localhost slots=1\n")
    assert "DS_ENV_FILE" not in this_node_alone  # its ranks start under the launcher, in its environment


def test_the_env_file_leaves_to_each_node_what_deepspeeds_launcher_leaves_to_it(tmp_path, monkeypatch):
    """DeepSpeed's launcher does not pass NCCL_IB_HCA on a cluster marked by AISC_JOB_NAME, whose nodes set it each
    for their own network cards (its EXCLUDE_ENVS); train.py's env file gave every node this machine's."""
    from training.pipeline.launch import env_for_other_nodes

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    env = {"AISC_JOB_NAME": "job", "NCCL_IB_HCA": "mlx5_0", "NCCL_DEBUG": "INFO"}
    written = Path(env_for_other_nodes(env, tmp_path / "deepspeed_env")["DS_ENV_FILE"]).read_text()
    assert written == "NCCL_DEBUG=INFO\n"
    env.pop("AISC_JOB_NAME")
    written = Path(env_for_other_nodes(env, tmp_path / "deepspeed_env")["DS_ENV_FILE"]).read_text()
    assert written == "NCCL_DEBUG=INFO\nNCCL_IB_HCA=mlx5_0\n"


def test_a_host_the_name_server_does_not_answer_for_is_taken_for_another_machine_in_bounded_time(monkeypatch,
                                                                                                  caplog):
    """Telling whether the hostfile's first host is this machine asked the system's resolver with no time limit: a
    name server down held planning up, saying nothing, for as long as the resolver kept trying."""
    from training.pipeline import hostfile, launch

    monkeypatch.setattr(hostfile, "HOST_LOOKUP_TIMEOUT_S", 0.2)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: time.sleep(3) or [])
    started = time.monotonic()
    assert not launch.is_this_machine("worker-1.cluster.example")
    assert time.monotonic() - started < 2
    assert "looking up worker-1.cluster.example found no address in 0.2 s" in caplog.text
    assert "takes it for another machine than this one" in caplog.text


def test_this_machines_fully_qualified_name_is_waited_for_in_bounded_time(monkeypatch):
    """Telling a host from this machine asked socket.getfqdn with no time limit before the bounded lookup: with a
    name server down, is_this_machine("worker-1") took 13 s (getfqdn's 8 s, then the lookup's 5 s). getfqdn is waited
    for HOST_LOOKUP_TIMEOUT_S now, this machine then known by its host name alone, once a process."""
    from training.pipeline import hostfile

    asked = []
    monkeypatch.setattr(hostfile, "HOST_LOOKUP_TIMEOUT_S", 0.2)
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-7")
    monkeypatch.setattr(socket, "getfqdn", lambda name="": asked.append(name) or time.sleep(3) or "gpu-node-7.example")
    monkeypatch.setattr(socket, "getaddrinfo", _stand_in_resolver)
    started = time.monotonic()
    assert not hostfile.is_this_machine("worker-1")
    assert hostfile.is_this_machine("GPU-NODE-7") and not hostfile.is_this_machine("node2")
    assert time.monotonic() - started < 2.5  # the unbounded getfqdn alone takes 3 s; slack for a loaded machine
    assert len(asked) == 1


@pytest.mark.parametrize("tell", ["is_this_machine", "read_hostfile"])
def test_this_machines_name_and_the_hosts_lookups_are_waited_for_together(tmp_path, monkeypatch, tell):
    """With a name server down, the first is_this_machine waited HOST_LOOKUP_TIMEOUT_S for getfqdn, then as long
    again for the host's own lookup (10 s), and reading a hostfile the same. The host's lookups are started beside
    getfqdn now, all waited for within one HOST_LOOKUP_TIMEOUT_S."""
    from training.pipeline import hostfile

    monkeypatch.setattr(hostfile, "HOST_LOOKUP_TIMEOUT_S", 1.0)
    monkeypatch.setattr(socket, "getfqdn", lambda name="": time.sleep(5) or "gpu-node-7.example")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: time.sleep(5) or [])
    started = time.monotonic()
    if tell == "is_this_machine":
        assert not hostfile.is_this_machine("worker-1")
    else:
        assert len(read_hostfile(write(tmp_path / "hosts", "worker-1 slots=1\nworker-2 slots=1\n"))) == 2
    assert time.monotonic() - started < 1.7


def test_a_host_name_the_resolver_cannot_encode_is_refused_naming_its_line(tmp_path, monkeypatch, caplog):
    """`a..b` (which the hostfile's line pattern accepts) made the lookup thread die on a UnicodeError, its traceback
    printed, and the host was then said to be one 'the name server does not answer' for. Refused when the hostfile is
    read, naming the line; as --master-addr it is no address of this machine, without that warning."""
    from training.pipeline import hostfile

    monkeypatch.setattr(hostfile, "HOST_LOOKUP_TIMEOUT_S", 0.5)
    path = write(tmp_path / "hosts", "worker-1 slots=2\na..b slots=2\n")
    with pytest.raises(UserError, match=re.escape(f"{path}:2: host 'a..b' is not a valid host name (label empty or "
                                                  "too long: each part between dots must be 1 to 63 characters)")):
        read_hostfile(path)
    assert not hostfile.is_this_machine("a..b")
    assert "found no address" not in caplog.text


@pytest.mark.parametrize("host", ["10.0.0.999", "1.2.3", "10.1.0.1."])
def test_a_hostfile_host_of_all_digit_parts_that_is_no_address_is_refused_naming_its_line(
        tmp_path, monkeypatch, host):
    """`10.0.0.999 slots=1` passed as a host name (--master-addr refuses it since 417b32b): the resolver looks it up
    as a name, found nowhere, and reads `1.2.3` as 1.2.0.3. Refused naming its line; an IP address and a name with
    digits in it still read, and so does `gpu.1`, whose last part alone is all digits."""
    monkeypatch.setattr(socket, "getaddrinfo", _stand_in_resolver)
    path = write(tmp_path / "hosts", f"node1 slots=2\n{host} slots=2\n")
    with pytest.raises(UserError, match=re.escape(f"{path}:2: host {host!r} is not a host name or an IP address (a "
                                                  "name's parts between dots are not all digits); an IPv4 address "
                                                  "is four numbers from 0 to 255")):
        read_hostfile(path)
    accepted = write(tmp_path / "other", "node01 slots=2\n10.1.0.2 slots=2\n2001:db8::7 slots=2\ngpu.1 slots=2\n")
    assert [host.name for host in read_hostfile(accepted)] == ["node01", "10.1.0.2", "2001:db8::7", "gpu.1"]


def test_each_launch_of_a_run_looks_its_master_address_up_once(monkeypatch, caplog):
    """Whether rank 0 runs on this machine (its master port checked free here) asked the resolver for --master-addr
    at every step's launch, each waiting up to HOST_LOOKUP_TIMEOUT_S where the name server did not answer, and saying
    so again each time. The answer is kept for the process."""
    from training.pipeline import hostfile

    asked = []

    def slow_resolver(host, *args, **kwargs):
        asked.append(host)
        time.sleep(3)
        return []

    monkeypatch.setattr(hostfile, "HOST_LOOKUP_TIMEOUT_S", 0.2)
    monkeypatch.setattr(socket, "getaddrinfo", slow_resolver)
    launcher = Launcher(DeploymentType.MULTI_NODE, hostfile="/h", nodes=2, on_this_machine=True,
                        master_addr="head.cluster.example", master_port=free_port(), hosts=("localhost", "worker-1"))
    started = time.monotonic()
    for _ in range(4):  # a step's launch each
        launcher.command_now(Path("/x/main.py"), [])
    assert time.monotonic() - started < 1
    assert asked == ["head.cluster.example"]
    assert caplog.text.count("looking up head.cluster.example found no address") == 1


@pytest.mark.parametrize("visible, hosts, here", [
    ("2,3", "localhost slots=2\nworker-2 slots=2\n", "localhost slots=2"),
    ("2,3", "worker-2 slots=2\ngpu-node-7-ib slots=2\n", "gpu-node-7-ib slots=2"),  # a name resolving to it
    ("0,1", "localhost slots=2\nworker-2 slots=2\n", None),  # the GPUs it lists, as a scheduler sets it
    ("0,1,2,3", "localhost slots=2\nworker-2 slots=2\n", None),  # among those it lists
    ("2,3", "worker-1 slots=2\nworker-2 slots=2\n", None),  # no rank here
    ("", "localhost slots=2\nworker-2 slots=2\n", "localhost slots=2"),  # every GPU hidden, yet ranks run on 0 and 1
])
def test_a_cuda_visible_devices_a_multi_node_run_does_not_follow_is_said(tmp_path, tiny_model_dir, monkeypatch,
                                                                          capsys, visible, hosts, here):
    """DeepSpeed's launcher gives a hostfile's ranks GPUs 0 to slots - 1 of each node: a multi_node run with
    CUDA_VISIBLE_DEVICES=2,3 and ranks on this machine ran on its GPUs 0 and 1, unsaid. Said once, where ranks run
    here (this machine told by a lookup too) on GPUs it does not list; it was said for 0,1 beside `localhost slots=2`
    too, and not for a line naming this machine by a name only a lookup tells."""
    from training.pipeline.cli import run

    monkeypatch.setattr(socket, "getaddrinfo", _stand_in_resolver)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    run([*_multi_node_step_1(tmp_path, tiny_model_dir("llama"), hosts), "--dry-run"])
    said = capsys.readouterr().err
    if here is None:
        assert "CUDA_VISIBLE_DEVICES" not in said
        return
    assert said.count(f"warning: multi_node: CUDA_VISIBLE_DEVICES={visible} is not followed for the ranks on this "
                      f"machine: DeepSpeed's launcher gives a hostfile's ranks GPUs 0 to slots - 1 of each node (here "
                      f"GPUs 0,1, for '{here}')") == 1
    assert "train.py has no --include" in said and "--deployment-type single_node" in said


def test_the_variables_left_out_are_said_only_where_a_step_launches_on_other_nodes(tmp_path, tiny_model_dir,
                                                                                   monkeypatch, capsys):
    """The warning for a variable the env file leaves out was printed where every step was finished and nothing
    would launch."""
    from training.pipeline import runner
    from training.pipeline.cli import run

    model = tiny_model_dir("llama")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0\n9.0")
    flags = [*_multi_node_step_1(tmp_path, model, "worker-1 slots=1\nworker-2 slots=1\n"), "--dry-run"]
    run(flags)
    assert "warning: multi_node: TORCH_CUDA_ARCH_LIST is left out" in capsys.readouterr().err
    monkeypatch.setattr(runner, "_finished_steps", lambda config, *_: {step: {} for step in config.steps})
    assert run(flags)["commands"] == {}
    assert "warning: multi_node" not in capsys.readouterr().err


def test_a_deepspeed_env_line_without_a_value_is_refused_while_planning(tmp_path, tiny_model_dir, monkeypatch):
    """DeepSpeed's launcher splits each line of its env file at `=`: a line of the user's .deepspeed_env without one
    (a comment too) ended its launch in a ValueError, which train.py showed as step 1's 'exit status 1'. It is refused
    while planning, the dry run too, naming the file and line; blank lines stay accepted."""
    from training.pipeline.cli import run

    model = tiny_model_dir("llama")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    env_file = tmp_path / ".deepspeed_env"
    flags = [*_multi_node_step_1(tmp_path, model, "worker-1 slots=1\nworker-2 slots=1\n"), "--dry-run"]
    env_file.write_text("NCCL_IB_DISABLE=1\n\n  \nHF_HOME=/users/me/hf\n")
    assert run(flags)["commands"]
    env_file.write_text("NCCL_IB_DISABLE=1\n\n# cards of this cluster\n")
    with pytest.raises(UserError, match=re.escape(f"{env_file}, line 3: '# cards of this cluster' is not a variable's "
                                                  "line; DeepSpeed's launcher reads each line of its env file as "
                                                  "KEY=VALUE")):
        run(flags)
    env_file.write_text("#HF_HOME=/users/me/hf\n")  # exported on each node's command line, it made the rest a comment
    with pytest.raises(UserError, match=re.escape(f"{env_file}, line 1: '#HF_HOME=/users/me/hf' is not a variable's")):
        run(flags)


@pytest.mark.parametrize("line, misread", [
    ("=1", "does not begin with a variable's name"),  # `export =1`: an error on each node, nothing set
    ("HF HOME=/users/me/hf", "does not begin with a variable's name"),  # `export HF HOME=...` set HOME on each node
    ("A;B=1", "does not begin with a variable's name"),  # B set, not exported
    ("$(hostname)=1", "does not begin with a variable's name"),  # run on each node
    ('NCCL_SOCKET_IFNAME="eth0 eth1"', "has a value the node's shell would read as several words"),  # A=eth0 alone
    ('HF_HOME=/users/me/"hf', "has a quote the node's shell would not see closed"),  # no rank started
])
def test_a_deepspeed_env_line_each_nodes_shell_would_misread_is_refused_naming_it(tmp_path, monkeypatch, line,
                                                                                    misread):
    """DeepSpeed's launcher puts `export KEY=VALUE` on each node's command line for every line of its env file, split
    at the first `=` and the value in double quotes where it has characters other than @%+=:,./-: a line whose key
    is no variable's name, or whose value the shell reads as several words or an unclosed quote, did something else
    on every node (checked with PDSHRunner.add_export and bash), unsaid. Refused, naming the file and line; a key
    DeepSpeed strips, `export KEY=...` and a value with `$` and spaces are the user's to write."""
    from training.pipeline.launch import env_for_other_nodes

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text(f"NCCL_IB_DISABLE=1\n{line}\n")
    with pytest.raises(UserError, match=re.escape(f"{env_file}, line 2: {line!r} {misread}")) as refused:
        env_for_other_nodes({}, tmp_path / "deepspeed_env")
    assert "puts `export KEY=VALUE` on each node's command line" in str(refused.value)
    fine = ["HF_HOME =/users/me/hf", "export TORCH_HOME=$HOME/torch cache", "NCCL_DEBUG_FILE=/tmp/nccl.%h.%p", "A="]
    env_file.write_text("".join(f"{fine_line}\n" for fine_line in fine))
    env = {"HF_HOME": "/data/hf", "TORCH_HOME": "/data/torch", "HF_HUB_OFFLINE": "1"}
    written = Path(env_for_other_nodes(env, tmp_path / "deepspeed_env")["DS_ENV_FILE"]).read_text()
    assert written.splitlines() == ["HF_HUB_OFFLINE=1", *fine]  # theirs, set by the user's lines, left out


def _exports_by_deepspeed(env_file: Path) -> dict[str, str]:
    """What DeepSpeed's launcher exports on each node for `env_file`, read as its runner reads it (open, readlines)."""
    with open(env_file) as lines:
        return _deepspeed_exports_of(lines.readlines())


def _deepspeed_exports_of(lines: list[str]) -> dict[str, str]:
    """What DeepSpeed's launcher exports on each node for its env file's `lines`: each split at its first `=` and given
    to PDSHRunner.add_export, which strips the key and the value and quotes the value."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    runner = types.SimpleNamespace(exports={})
    for line in lines:
        key, value = line.split("=", maxsplit=1)
        PDSHRunner.add_export(runner, key, value)
    return runner.exports


@pytest.mark.parametrize("kept", NOT_LINE_BREAKS_TO_DEEPSPEED)
def test_a_deepspeed_env_is_read_in_the_lines_deepspeeds_launcher_reads(tmp_path, monkeypatch, kept):
    """The user's .deepspeed_env was read with str.splitlines, which breaks lines where DeepSpeed's launcher does not:
    `TORCH_HOME=/a<form feed>b` was refused ('b' is not a variable's line) where each node gets TORCH_HOME as written,
    and `NCCL_DEBUG=INFO<form feed>HF_HOME=/users/me/hf` read as setting HF_HOME, so train.py's own HF_HOME was
    left out where no node gets the user's. Read as DeepSpeed's launcher reads it now: each node gets the user's lines
    as written, and this environment's HF_HOME."""
    from training.pipeline.launch import env_for_other_nodes

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text(f"TORCH_HOME=/a{kept}b\nNCCL_DEBUG=INFO{kept}HF_HOME=/users/me/hf\n")
    env = env_for_other_nodes({"HF_HOME": "/data/hf"}, tmp_path / "deepspeed_env")
    assert _exports_by_deepspeed(Path(env["DS_ENV_FILE"])) == {
        "HF_HOME": "/data/hf", "TORCH_HOME": f'"/a{kept}b"', "NCCL_DEBUG": f'"INFO{kept}HF_HOME=/users/me/hf"'}


def _exported_by_bash_and_dash(line: str) -> str | None:
    """The variable bash and dash both export, set to 1, running the `export KEY=VALUE; ` DeepSpeed's launcher puts on
    each node's command line for the env file `line`; None where either does anything else (sets none, fails)."""
    ((key, value),) = _deepspeed_exports_of([line]).items()
    exported = {_exported_by(shell, f"export {key}={value}; ") for shell in ("bash", "dash")}
    return exported.pop() if len(exported) == 1 else None


def _exported_by(shell: str, exports: str) -> str | None:
    """The one variable `shell` exports, set to 1, running `exports`; None where it exports none or more, or fails."""
    def environment(command: str) -> set[str]:
        done = subprocess.run([shell, "-c", f"{command}exec env"], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                              text=True, check=False)
        return set(done.stdout.splitlines()) if done.returncode == 0 and not done.stderr else set()

    added = environment(exports) - environment("")
    return added.pop().removesuffix("=1") if len(added) == 1 and next(iter(added)).endswith("=1") else None


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("dash") is None, reason="needs bash and dash")
@pytest.mark.parametrize("key, exported", [
    ("HF_HOME", "HF_HOME"),
    ("export HF_HOME", "HF_HOME"),
    ("export\tHF_HOME", "HF_HOME"),  # the shells part words at a tab too: it was refused
    ("\x1cHF_HOME", "HF_HOME"),  # DeepSpeed's launcher strips it off the key
    ("export \vHF_HOME", None),  # the name both shells read has the \v, which Python's strip took off: it was taken
    ("export \x1cHF_HOME", None),
    ("A+", None),  # `export A+=1`: bash appends to A, dash stops the node's command (no rank starts)
    ("caf\u00e9", None),  # a letter outside POSIX's names: dash takes none, bash none in a UTF-8 or C locale
    ("1A", None),
])
def test_a_deepspeed_env_key_is_taken_where_bash_and_dash_both_export_that_variable(tmp_path, monkeypatch, key,
                                                                                     exported):
    """A node runs DeepSpeed's `export KEY=VALUE; ` in the user's login shell, bash or dash (or another sh): a
    .deepspeed_env key is taken where both export the variable it names, set to its value, else refused naming the
    line. Each case is checked against both shells, where this machine has them."""
    from training.pipeline.launch import env_for_other_nodes

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    line = f"{key}=1"
    (tmp_path / ".deepspeed_env").write_text(f"{line}\n")
    assert _exported_by_bash_and_dash(line) == exported
    if exported is None:
        with pytest.raises(UserError, match="does not begin with a variable's name"):
            env_for_other_nodes({"HF_HOME": "/data/hf"}, tmp_path / "deepspeed_env")
        return
    env = env_for_other_nodes({"HF_HOME": "/data/hf"}, tmp_path / "deepspeed_env")
    assert Path(env["DS_ENV_FILE"]).read_text() == f"{line}\n"  # the user's line, train.py's HF_HOME left out


def test_a_multi_node_run_passes_each_value_as_itself_or_says_it_leaves_it_out(tmp_path, tiny_model_dir, monkeypatch,
                                                                                capsys):
    """786820d refused the whole run where a variable train.py passes to the ranks on other nodes unasked had a value
    with $, `, \\, %, a quote or a line break: NCCL's documented NCCL_DEBUG_FILE=/tmp/nccl.%h.%p stopped a multi_node
    run (DeepSpeed's launcher had passed it from a GPU head), a .deepspeed_env line setting the variable did not help,
    and --dry-run said nothing of it. Each value is now written for pdsh and the nodes' shells to read as itself; one
    no env file line can carry (a line break; bytes that are not UTF-8, which failed train.py's launch on writing
    the file) is left out with a warning, the same in the dry run; one the user's .deepspeed_env sets is theirs
    alone."""
    from training.pipeline.cli import run

    model = tiny_model_dir("llama")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("HF_HOME=/users/me/hf\n")
    for name, value in (("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p"), ("TORCH_HOME", '$SCRATCH/`t` "q" \\ x'),
                        ("TORCH_CUDA_ARCH_LIST", "8.0\n9.0"), ("HF_HOME", "$HOME/hf\nx"),
                        ("HF_DATASETS_CACHE", os.fsdecode(b"/data/caf\xe9"))):  # Latin-1 bytes
        monkeypatch.setenv(name, value)
    hosts = "worker-1 slots=1\nworker-2 slots=1\n"
    run([*_multi_node_step_1(tmp_path, model, hosts), "--dry-run"])
    planned = capsys.readouterr().err
    env = _launch_env_of_step_1(monkeypatch, tmp_path, model, hosts)
    launched = capsys.readouterr().err
    for said in (planned, launched):
        assert said.count("warning: multi_node: ") == 2
        assert "warning: multi_node: TORCH_CUDA_ARCH_LIST is left out of train.py's env file for the ranks on other " \
               "nodes: its value has a line break" in said
        assert "warning: multi_node: HF_DATASETS_CACHE is left out of train.py's env file for the ranks on other " \
               "nodes: its value has bytes that are not UTF-8 text" in said
        assert "set it in each node's own environment, or give it a line of your own in .deepspeed_env" in said
    lines = Path(env["DS_ENV_FILE"]).read_text().splitlines()
    assert "NCCL_DEBUG_FILE=/tmp/nccl.%%h.%%p" in lines  # pdsh reads %% as %
    assert 'TORCH_HOME=\\$SCRATCH/\\`t\\` \\"q\\" \\\\ x' in lines  # in double quotes, read as itself
    assert not [line for line in lines if line.startswith(("TORCH_CUDA_ARCH_LIST=", "9.0", "HF_DATASETS_CACHE="))]
    assert [line for line in lines if line.startswith("HF_HOME=")] == ["HF_HOME=/users/me/hf"]


BARE_NODES_PDSH = f"#!{sys.executable}\n" + """
# pdsh -S -f N -w HOSTS COMMAND...: COMMAND once a node, all of them this machine, in the bare environment ssh gives,
# after pdsh's substitutions (its man page, and pdsh 2.34's ssh module): %h the node, %u the user, %n its rank, %% a %
import getpass, os, re, subprocess, sys

hosts = sys.argv[sys.argv.index("-w") + 1].split(",")
command = " ".join(sys.argv[sys.argv.index("-w") + 2:])
for rank, host in enumerate(hosts):
    substituted = {"h": host, "u": getpass.getuser(), "n": str(rank), "%": "%"}
    line = re.sub("%([hun%])", lambda found: substituted[found.group(1)], command)
    status = subprocess.run(["bash", "-c", line], env={"HOME": os.environ["HOME"], "PATH": "/usr/bin:/bin"}).returncode
    if status:
        sys.exit(status)
"""


@pytest.mark.slow
def test_deepspeeds_launcher_exports_train_pys_env_file_to_the_ranks_on_other_nodes(tmp_path, monkeypatch):
    """DeepSpeed's own launcher, through pdsh (a stand-in running each node's command line here, in a bare
    environment) to two nodes: the ranks there see what train.py's env file names, each value as itself whatever
    pdsh and their shell read in it, and the rest of its environment no more (a value with a line break is left out)."""
    from training.pipeline.launch import env_for_other_nodes, launcher_env, run_subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("pdsh", BARE_NODES_PDSH), ("ssh", "#!/bin/sh\nexit 0\n")):  # ssh: DeepSpeed's reachability check
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_HOME", "/data/hf")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/data/ext")
    shell_read = {"NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p", "TORCH_HOME": '$HOME/`t` "q" \\ 100%%n \'s\'',
                  "HF_DATASETS_CACHE": "/data/a\n/data/b"}
    for name, value in shell_read.items():
        monkeypatch.setenv(name, value)
    names = ("HF_HOME", "TORCH_EXTENSIONS_DIR", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", *shell_read)
    script = tmp_path / "main.py"
    script.write_text(f"import json, os\nprint('rank', os.environ['RANK'], json.dumps([os.environ.get(name) for name in "
                      f"{names!r}]))\n")
    launcher = Launcher(DeploymentType.MULTI_NODE, hostfile=write(tmp_path / "hosts", "w1 slots=1\nw2 slots=1\n"),
                        master_addr="127.0.0.1", master_port=free_port(), nodes=2, hosts=("w1", "w2"))
    log = tmp_path / "step1.log"
    env = env_for_other_nodes(launcher_env(REPO_ROOT), tmp_path / "deepspeed_env")
    run_subprocess(launcher.command_now(script, []), log, "step 1", env=env)
    seen = ["/data/hf", "/data/ext", "1", None, "/tmp/nccl.%h.%p", shell_read["TORCH_HOME"], None]
    for rank in (0, 1):  # HF_HUB_OFFLINE=1 in this test's environment; TOKENIZERS_PARALLELISM is not passed
        assert f"rank {rank} {json.dumps(seen)}" in log.read_text()
