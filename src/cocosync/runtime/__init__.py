"""Runtime: rank launch, process groups, shared-memory arena, collectives, kernels, executor."""
