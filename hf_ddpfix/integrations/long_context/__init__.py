"""Long-context training pieces, one feature: the patched decoder layer (``long_context``: RMSNorm saving bf16
+ fp32 rstd, grouped flash attention, token-tiled layer), how a layer call is bound (``layer_call``), the
per-layer memory ledger (``layer_ledger``), the tiled loss head (``loss_patch``), the tiled MLP
(``tiled_mlp``) and what counts as a token-wise module (``token_wise``). Import from the submodules."""
