"""User-facing example scripts (run with torchrun, e.g. `torchrun --nproc-per-node 2 -m cocosync.examples.dp_train`)."""
