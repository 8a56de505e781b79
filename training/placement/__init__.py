"""Step 3 placement: which ranks hold each model, what a placement costs, and the planner that picks one."""
