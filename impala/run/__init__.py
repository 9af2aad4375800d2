"""Run plumbing: the one configuration mechanism (dataclasses -> flags), the CPUs a run may use,
checkpoints, metrics and experiment tracking."""
