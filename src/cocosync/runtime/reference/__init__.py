"""The reference semantics of plan execution: what each stage means on one rank (stage) and what a rank of a
multi-group program skips (prune). The fast step forms (runtime.steps) are built on it and tested against it."""
