"""Slurm allocations: the plan of jobs and steps, submission, the step on each node, the link."""
