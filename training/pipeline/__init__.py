"""`train.py`'s logic: pick a deployment's settings, launch the steps in order, summarise the run.

`steps.STEPS` is the step registry (inputs, output, plan and planner of each step); `plans` holds the
typed per-step plans, `deployment` the sizing, `planning` the plan of every registered step,
`config`/`cli` train.py's own flags, `runner` the run.
"""
