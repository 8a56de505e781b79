"""Crash safety and clear failures: checkpoints and resume, run locks, signals, guards, input checks.

The names below load with their module on first use: importing one light module of the package (signals, which a
launcher's parent process and every rank's stop handling need) does not import the checkpointing's transformers
and DeepSpeed, seconds of every such process's start-up."""
from importlib import import_module

_MODULE_OF = {
    "CheckpointManager": "checkpointing",
    "CheckpointSettings": "checkpointing",
    "NonFiniteError": "guards",
    "check_finite": "guards",
    "RunLock": "run_lock",
    "ARGS_FILE": "run_records",
    "SUMMARY_FILE": "run_records",
    "read_run_args": "run_records",
    "save_run_args": "run_records",
    "save_summary": "run_records",
    "EXIT_INTERRUPTED": "signals",
    "GracefulInterrupt": "signals",
    "check_input_run_shards": "validation",
    "check_model_source": "validation",
    "check_output_dir": "validation",
    "check_remote_code": "validation",
    "check_sequence_lengths": "validation",
}
__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> object:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
