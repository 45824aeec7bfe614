"""Tensor parallelism for the native engine, on torch.distributed.

- ``group``: the process group (NCCL on CUDA, gloo on CPU) and the collectives the sharded layers
  (``models.parallel``) call;
- ``messages``: what rank 0 sends the other ranks, one message per operation on the model;
- ``ranks``: rank 0's side (start, send, watch, stop the other ranks);
- ``rank_process``: the other ranks' process.
"""
