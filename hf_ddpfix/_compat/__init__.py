"""The contract layer: every private upstream access hf_ddpfix makes, in one place.

hf_ddpfix needs a few things that torch, transformers and accelerate do not expose publicly (a hook
point between ``Trainer.train`` and ``accelerator.prepare``, the per-layer checkpoint function, a
storage identity, …). Each one is a small function here, with the private name it touches, so that:

- a new upstream release that moves one of them breaks **one** function, and
  ``tests/test_upstream_contracts.py`` says which, with the version it was checked against;
- ``hf_ddpfix/ops`` (pure torch) and ``hf_ddpfix/integrations`` (HF plumbing) never spell a private
  name themselves.

Every module of this package imports only torch at module level; transformers / accelerate are imported inside the
functions that need them, so ``hf_ddpfix.ops`` can use the torch contracts without pulling in HF.

Checked against: :data:`CHECKED_AGAINST` (newest) and :data:`OLDEST_SUPPORTED` (the oldest stack CI runs).
"""

# One module per upstream area; this face re-exports every contract (import from `hf_ddpfix._compat`).
from .attention import (
    attention_function_override,
    attention_implementation,
    current_attention_function,
    stock_attention_function,
)
from .bitsandbytes import disable_cpu_repack
from .deepspeed import (
    deepspeed_default_leaf_classes,
    deepspeed_engine,
    deepspeed_engine_sequence_parallel_size,
    z3_leaf_marked,
    zero3_gathered,
    zero3_partitioned,
    zero_flat_slices,
)
from .fsdp import fsdp_module_units, fsdp_plugin, fsdp_wrap_classes, fsdp_wrap_policy, set_fsdp_wrap_classes
from .models import (
    CACHE_KEYWORDS,
    CHECKPOINT_FUNC_ATTR,
    MM_ENCODER_OUTPUTS_KWARG,
    attn_implementation,
    cache_output_field,
    causal_lm_loss_function,
    checkpointable_layers,
    forward_source,
    generate_pre_encodes_images,
    image_features,
    is_checkpointing,
    is_namedtuple,
    layer_checkpoint_func,
    model_attn_implementation,
    no_split_modules,
    output_cache,
    output_field,
    set_layer_checkpoint_func,
    unwrap_model,
    unwrap_parallel,
)
from .sequence_parallel import (
    parallelism_config_available,
    parallelism_sp_settings,
    stand_down_accelerate_sequence_parallel,
)
from .torch_internals import (
    FLASH_CPU_BACKWARD_OP,
    TorchDispatchMode,
    autograd_function_class,
    checkpoint_recompute_is_last,
    class_checkpoint_inner_forward,
    fake_from_meta,
    fake_tensor_mode,
    flash_attention_backward,
    flash_attention_forward,
    in_checkpoint_recompute,
    is_ddp_sink_node,
    module_buffer_slots,
    module_parameter_slots,
    profiler_memory_events,
    storage_weak_ref,
    tensor_has_values,
    tree_flatten,
    view_base,
)
from .trainer import (
    TRAINER_CLIP_GRAD_NORM,
    TRAINER_GET_GRAD_NORM,
    TRAINER_INNER_LOOP,
    TRAINER_STEP_HOOKS,
    TRAINER_WRAP_MODEL,
    around_backward,
    before_gradient_clipping,
    checkpointing_arg_names,
    checkpointing_args,
    checkpointing_training_args,
    ddp_kwargs_handler,
    ddp_syncs_grads,
    disable_model_checkpointing,
    enable_model_checkpointing,
    inner_loop_sets_up_training,
    set_ddp_kwargs,
    trainer_callbacks,
    when_ready_to_prepare,
)
from .versions import CHECKED_AGAINST, OLDEST_SUPPORTED

__all__ = [
    "CACHE_KEYWORDS",
    "CHECKED_AGAINST",
    "CHECKPOINT_FUNC_ATTR",
    "FLASH_CPU_BACKWARD_OP",
    "MM_ENCODER_OUTPUTS_KWARG",
    "OLDEST_SUPPORTED",
    "TRAINER_CLIP_GRAD_NORM",
    "TRAINER_GET_GRAD_NORM",
    "TRAINER_INNER_LOOP",
    "TRAINER_STEP_HOOKS",
    "TRAINER_WRAP_MODEL",
    "TorchDispatchMode",
    "attn_implementation",
    "autograd_function_class",
    "is_namedtuple",
    "model_attn_implementation",
    "no_split_modules",
    "profiler_memory_events",
    "tree_flatten",
    "around_backward",
    "attention_function_override",
    "attention_implementation",
    "before_gradient_clipping",
    "cache_output_field",
    "causal_lm_loss_function",
    "checkpoint_recompute_is_last",
    "checkpointable_layers",
    "checkpointing_arg_names",
    "checkpointing_args",
    "checkpointing_training_args",
    "class_checkpoint_inner_forward",
    "current_attention_function",
    "ddp_kwargs_handler",
    "ddp_syncs_grads",
    "deepspeed_default_leaf_classes",
    "disable_cpu_repack",
    "deepspeed_engine",
    "deepspeed_engine_sequence_parallel_size",
    "disable_model_checkpointing",
    "enable_model_checkpointing",
    "fake_from_meta",
    "fake_tensor_mode",
    "flash_attention_backward",
    "flash_attention_forward",
    "forward_source",
    "fsdp_module_units",
    "fsdp_plugin",
    "fsdp_wrap_classes",
    "fsdp_wrap_policy",
    "set_fsdp_wrap_classes",
    "generate_pre_encodes_images",
    "image_features",
    "in_checkpoint_recompute",
    "inner_loop_sets_up_training",
    "is_checkpointing",
    "is_ddp_sink_node",
    "layer_checkpoint_func",
    "module_buffer_slots",
    "module_parameter_slots",
    "output_cache",
    "output_field",
    "parallelism_config_available",
    "parallelism_sp_settings",
    "set_ddp_kwargs",
    "set_layer_checkpoint_func",
    "stand_down_accelerate_sequence_parallel",
    "stock_attention_function",
    "storage_weak_ref",
    "tensor_has_values",
    "trainer_callbacks",
    "unwrap_model",
    "unwrap_parallel",
    "view_base",
    "when_ready_to_prepare",
    "z3_leaf_marked",
    "zero3_gathered",
    "zero3_partitioned",
    "zero_flat_slices",
]
