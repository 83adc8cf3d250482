"""The paper's programs as production code: data-parallel SGD/Adam/LAMB (with mixed precision and clipping), the
Megatron MLP layer and the pipeline send. optim/ and nn/ build on them; `cocosync show NAME` prints them."""
