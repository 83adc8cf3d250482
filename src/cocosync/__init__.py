"""cocosync: communication off the critical path of distributed PyTorch training."""

__version__ = "0.1.0"
