"""`train.py`'s logic: pick a deployment's settings, launch the three steps in order, summarise the run."""
