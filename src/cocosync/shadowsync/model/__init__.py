"""The ShadowSync model: the DLRM (`dlrm`) and its embedding tables as row-hash shards behind one client
(`embeddings`: this node's shards read and updated in place in shared memory, other nodes' over torch RPC), with
what the RPC servers serve in this process (`served`)."""
