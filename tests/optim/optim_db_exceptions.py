"""The optim_db inputs cocosync does not support, and why (tests/optim/test_optim_db.py). An input listed here
must be refused at construction with an error naming the first key (never accepted and ignored). Today every CPU
input of Adam, AdamW and SGD is supported, and every error input raises torch's exception type: both are empty. (The
CUDA-only inputs -- capturable with Tensor betas -- are not generated on a CPU device.)"""

# (torch optimizer, optim_db input description) -> (the kwarg refused, why)
UNSUPPORTED: dict[tuple[str, str], tuple[str, str]] = {}

# (torch optimizer, error input description) -> why ours does not raise what torch raises
UNSUPPORTED_ERRORS: dict[tuple[str, str], str] = {}
