"""Run plumbing: the run's configurations (RunConfig, ImpalaConfig, PPOConfig, users of ``impala.options``),
the CPUs a run may use, checkpoints, metrics and experiment tracking."""
