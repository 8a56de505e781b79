"""Training loops: the supervised loop of steps 1 and 2, resumable batch streams, metrics."""
