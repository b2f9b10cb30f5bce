"""Pure torch operations: no transformers, no accelerate.

- :mod:`.tiled`: explicit-parameter tiled autograd Function (TiledMLP) and its shard policy.
- :mod:`.tiled_loss`: chunked ``lm_head`` + cross-entropy.
- :mod:`.offload`: saved-tensor hooks, side stream, the offload policy.
- :mod:`.host_pool`: the bounded (pinned) host pool the offload copies into.
- :mod:`.zero_tie`: an exactly-zero contribution that makes tensors "used" for autograd/DDP/FSDP.
- :mod:`.dist`: the two torch.distributed helpers every op shares.

Private upstream torch accesses go through :mod:`hf_ddpfix._compat` (imports torch only).
"""
