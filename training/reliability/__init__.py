"""Crash safety and clear failures: checkpoints and resume, run locks, signals, guards, input checks."""
