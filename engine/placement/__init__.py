"""Where servers run: SSH hosts (placement/hosts) or Slurm allocations (placement/slurm), behind the router."""
