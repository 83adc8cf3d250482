"""Transport: collectives within a node through shared memory and across nodes through torch.distributed.

No DSL imports here (tests/test_architecture.py checks it): this layer is usable on its own, and the plan
executor and the optimizers are built on it.
"""
