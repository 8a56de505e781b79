"""Crash safety and clear failures: checkpoints and resume, run locks, signals, guards, input checks."""
from training.reliability.checkpointing import CheckpointManager, CheckpointSettings
from training.reliability.guards import NonFiniteError, check_finite
from training.reliability.run_lock import RunLock
from training.reliability.run_records import (
    ARGS_FILE,
    SUMMARY_FILE,
    read_run_args,
    save_run_args,
    save_summary,
)
from training.reliability.signals import EXIT_INTERRUPTED, GracefulInterrupt
from training.reliability.validation import (
    check_input_run_shards,
    check_model_source,
    check_output_dir,
    check_remote_code,
    check_sequence_lengths,
)
