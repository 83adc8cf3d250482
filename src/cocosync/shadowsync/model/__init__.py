"""The ShadowSync model: the DLRM (`dlrm`), the tables' storage (`shard`), their client (`embeddings`) and the
transports to other nodes' rows (`transport`: the lookup exchange, the node relay, RPC)."""
