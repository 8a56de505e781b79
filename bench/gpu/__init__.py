"""Everything GPU-specific in one go on a fresh GPU machine: `prepare` (here, on a CPU machine) builds what the
GPU image lacks into ignored folders; `run` (there) installs it and runs the GPU tests and benchmarks."""
