"""Pure torch operations: no transformers, no accelerate.

- :mod:`.tiled`: explicit-parameter tiled autograd Function (TiledMLP) and its shard policy.
- :mod:`.tiled_loss`: chunked ``lm_head`` + cross-entropy.
- :mod:`.offload` (a folder): activation offload: saved-tensor hooks, policy, transfers, the bounded
  (pinned) host pool, host memory, per-step stats and the pre-flight device/host budget.
- :mod:`.zero_tie`: an exactly-zero contribution that makes tensors "used" for autograd/DDP/FSDP.
- :mod:`.dist`: the torch.distributed helpers every op shares, and the process-group teardown at exit.
- :mod:`.rms_norm`: RMSNorm saving its input and an fp32 per-token rstd only (long context).
- :mod:`.token_tiles`: several-input/output token-wise block in sequence tiles (the decoder-layer halves).
- :mod:`.grouped_attention`: causal flash attention run per KV-head group (smaller backward workspace).
- :mod:`.memory_ledger`: exact live-storage bytes per op (real, meta or fake tensors).
- :mod:`.buffer_order`: one buffer order on every rank (DDP copies rank 0's buffers by position).
- :mod:`.feature_counts`: what each feature really ran, fell back on (with the reason) and moved.

Private upstream torch accesses go through :mod:`hf_ddpfix._compat` (imports torch only).
"""
