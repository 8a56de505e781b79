"""Training loops: the supervised loop of steps 1 and 2, resumable batch streams, metrics."""
from training.loops.batch_stream import BatchStream
from training.loops.metrics import MetricsLogger, read_metrics
from training.loops.supervised_step import (
    SupervisedStep,
    run_supervised_step,
    supervised_step_parser,
)
from training.loops.trainer import LoopConfig, SupervisedTrainer
