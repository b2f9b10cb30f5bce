"""What the sequence-parallel plan needs to know about a run, read from the model and the Trainer
(read-only): the size asked for and where, the attention implementation, the head counts, and the
accelerate `ParallelismConfig` when one is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..._compat import (
    attn_implementation,
    model_attn_implementation,
    parallelism_config_available,
    parallelism_sp_settings,
)
from ..long_context.layer_kinds import sequence_scans
from .head import pooled_head_structure
from .vision import vision_sequence_parallel_support

__all__ = ["SequenceParallelFacts", "gather_sequence_parallel_facts", "is_stock_prediction_step",
           "prediction_ignored_outputs", "sequence_parallel_loss_route", "trainer_loss_override",
           "trainer_world_statistic"]


@dataclass(frozen=True)
class SequenceParallelFacts:
    """Attributes:
        attn_implementation: the text model's `config._attn_implementation` ("sdpa", "eager", ...), or None.
        num_heads / num_kv_heads: the text model's attention heads, None when the config does not say.
        parallelism_sp_size: `TrainingArguments.parallelism_config.sp_size` (None: no parallelism config).
        parallelism_sp_backend: its `sp_backend` ("deepspeed" is DeepSpeed's own Ulysses engine).
        parallelism_sp_attn: its `sp_handler.sp_attn_implementation` (the attention DeepSpeed's engine wraps).
        parallelism_config_available: the installed accelerate / transformers take
            `TrainingArguments(parallelism_config=ParallelismConfig(sp_size=N))` (accelerate >= 1.12).
        vision_family: a VLM whose text decoder hf_ddpfix shards after the image merge (e.g. "qwen2_5_vl").
        vision_refusal: why a VLM cannot be sharded (`vision.vision_sequence_parallel_support`), else None.
        trainer_name: the trainer's class name.
        trainer_loss: the `compute_loss` the trainer runs when it is not stock `transformers.Trainer.compute_loss`
            ("SFTTrainer.compute_loss"), else None (observed: the method the class resolves, or one set on the
            instance).
        compute_loss_func / label_smoothing: `Trainer(compute_loss_func=...)` / `label_smoothing_factor > 0`.
        average_tokens_across_devices: `TrainingArguments.average_tokens_across_devices`.
        router_aux_loss: the text config asks for MoE router logits (`output_router_logits`): the model adds a
            load-balancing loss to its own.
        world_statistic: the trainer's loss uses a statistic gathered over every process's batch (TRL KTO's KL
            estimate, `calculate_KL`): under SP each rank computes it over the group's batch b, not its own, so
            it is refused; None when the trainer shows none.
        lm_head: the model has an output embedding (a language-model head: per-token outputs); False for a
            sequence-classification / reward model, whose score is pooled over the whole sequence.
        pooled_head: for a model without an LM head, how the "head-whole" route runs it (`head.pooled_head_structure`:
            "LlamaForSequenceClassification: decoder 'model' (LlamaModel) sharded, score and pooling on the whole
            sequence"), else None.
        pooled_head_refusal: why that route cannot run it (no decoder found under the head, attention not causal).
        sequence_scan: decoder layers whose token mixer is no attention (Qwen3.5's gated delta net: a recurrent
            scan over the whole sequence; `long_context.layer_kinds.sequence_scans`), e.g. "48 linear_attention
            layers (linear_attn (Qwen3_5GatedDeltaNet))", else None: Ulysses reaches attention only.
    """

    attn_implementation: str | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    parallelism_sp_size: int | None = None
    parallelism_sp_backend: str | None = None
    parallelism_sp_attn: str | None = None
    parallelism_config_available: bool = True
    vision_family: str | None = None
    vision_refusal: str | None = None
    trainer_name: str = "Trainer"
    trainer_loss: str | None = None
    compute_loss_func: bool = False
    label_smoothing: bool = False
    average_tokens_across_devices: bool = True
    router_aux_loss: bool = False
    lm_head: bool = True
    world_statistic: str | None = None
    pooled_head: str | None = None
    pooled_head_refusal: str | None = None
    sequence_scan: str | None = None


def trainer_world_statistic(trainer: Any) -> str | None:
    """What in the trainer's loss is gathered over every process's batch, read from the instance, else None.
    TRL's KTOTrainer sets `calculate_KL` (its loss subtracts the KL mean `accelerator.gather`ed over the world:
    trl/trainer/kto_trainer.py, TRL 1.16) unless `loss_type="apo_zero_unpaired"`."""
    if getattr(trainer, "calculate_KL", False) is True:
        return ("its loss subtracts a KL estimate gathered over every process's batch (calculate_KL=True); under "
                "sequence parallelism each rank holds the group's batches in turn, so the gathered mean is another "
                "one: use loss_type='apo_zero_unpaired' (no KL term), or train without sequence parallelism")
    return None


def trainer_loss_override(trainer: Any) -> str | None:
    """The qualified name of the `compute_loss` this trainer runs when it is not stock's, else None."""
    own = vars(trainer).get("compute_loss") if hasattr(trainer, "__dict__") else None
    if own is not None and not getattr(own, "_hf_ddpfix_sequence_parallel", False):  # set on the instance by a user
        return getattr(own, "__qualname__", repr(own))
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover
        return None
    method = getattr(type(trainer), "compute_loss", None)
    if method is None or method is Trainer.compute_loss:
        return None
    return getattr(method, "__qualname__", f"{type(trainer).__name__}.compute_loss")


def is_stock_prediction_step(trainer: Any) -> bool:
    """`transformers.Trainer.prediction_step` itself (not a subclass's override nor an instance attribute)."""
    from transformers import Trainer

    return "prediction_step" not in vars(trainer) and getattr(type(trainer), "prediction_step", None) is \
        Trainer.prediction_step


def prediction_ignored_outputs(trainer: Any, ignore_keys: list[str] | None) -> tuple[str, ...]:
    """The output keys stock `prediction_step` leaves out of its predictions: `ignore_keys`, else the model config's
    `keys_to_ignore_at_inference` (default `["past_key_values"]`), as transformers 5.x reads them."""
    if ignore_keys is not None:
        return tuple(ignore_keys)
    config = getattr(getattr(trainer, "model", None), "config", None)
    return tuple(getattr(config, "keys_to_ignore_at_inference", ["past_key_values"]) or ()) if config is not None \
        else ()


def _text_config(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    for key in ("text_config", "language_config"):
        sub = getattr(cfg, key, None)
        if sub is not None:
            return sub
    return cfg


def _has_lm_head(model: nn.Module) -> bool:
    get = getattr(model, "get_output_embeddings", None)
    try:
        return get is None or get() is not None  # a model that does not say: judged at run time (whole.py)
    except (AttributeError, NotImplementedError):
        return True


def gather_sequence_parallel_facts(trainer: Any, model: nn.Module) -> SequenceParallelFacts:
    """The facts of ``trainer``'s run; ``trainer=None``: a stock ``Trainer`` with default arguments (what
    ``hf-ddpfix plan`` assumes for the model it built)."""
    cfg = _text_config(model)
    scans = sequence_scans(model)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    impl = attn_implementation(cfg) or model_attn_implementation(model)
    sp, backend, attn = parallelism_sp_settings(trainer)
    family, refusal = vision_sequence_parallel_support(model)
    args = getattr(trainer, "args", None)
    lm_head = _has_lm_head(model)
    head = pooled = None
    if not lm_head:
        _, decoder, said = pooled_head_structure(model)
        head, pooled = (said, None) if decoder is not None else (None, said)
    return SequenceParallelFacts(
        trainer_name=type(trainer).__name__ if trainer is not None else "Trainer",
        trainer_loss=trainer_loss_override(trainer) if trainer is not None else None,
        sequence_scan="; ".join(f"{n} {label} layer{'s' if n != 1 else ''} ({mixer})" for label, n, mixer in scans)
        or None,
        compute_loss_func=getattr(trainer, "compute_loss_func", None) is not None,
        label_smoothing=getattr(trainer, "label_smoother", None) is not None
        or float(getattr(args, "label_smoothing_factor", 0) or 0) > 0,
        average_tokens_across_devices=bool(getattr(args, "average_tokens_across_devices", True)),
        router_aux_loss=bool(getattr(cfg, "output_router_logits", False)),
        lm_head=lm_head, pooled_head=head, pooled_head_refusal=pooled,
        world_statistic=trainer_world_statistic(trainer),
        vision_family=family.name if family is not None else None, vision_refusal=refusal or None,
        attn_implementation=impl, num_heads=heads, num_kv_heads=kv, parallelism_sp_size=sp,
        parallelism_sp_backend=backend, parallelism_sp_attn=attn,
        parallelism_config_available=parallelism_config_available(),
    )


def sequence_parallel_loss_route(sp: SequenceParallelFacts) -> tuple[str, str, str | None]:
    """How the trainer's loss runs under SP, from what the run shows (docs/sequence-parallel-losses.md):
    `(route, why, refusal)`. "sharded": stock `Trainer.compute_loss` with the model's own causal-LM token sum,
    each rank summing its slice's tokens (no whole logits); "gathered": the trainer's own `compute_loss` on each
    batch of the group with the model's outputs made whole across it (`whole.py`); "head-whole": a model without an
    LM head (sequence classification, reward), the trainer's own `compute_loss` on each batch of the group with the
    decoder sharded and its last hidden state gathered under the model's head and pooling (`head.py`). `refusal`: why the loss
    cannot be made exact (naming the trainer and the fix), else None; the plan raises it as a `PlanError`.
    """
    who = sp.trainer_name
    if sp.router_aux_loss:
        return "refused", "", (
            f"{who} trains a model that adds a MoE router load-balancing loss (output_router_logits=True); computed on "
            "each rank's slice of the sequence it is not the whole sequence's loss, so it cannot be made exact: set "
            "output_router_logits=False in the model config, or train without sequence parallelism")
    if sp.world_statistic:
        return "refused", "", f"{who}: {sp.world_statistic}"
    why = []
    if sp.trainer_loss:
        why.append(f"{sp.trainer_loss} is the trainer's own loss")
    if sp.compute_loss_func:
        why.append("compute_loss_func")
    if sp.label_smoothing:
        why.append("label smoothing")
    if not sp.average_tokens_across_devices:
        why.append("average_tokens_across_devices=False (each batch over its own token count)")
    if not sp.lm_head:
        if sp.vision_family or not sp.pooled_head:
            what = (f"on {sp.vision_family}, whose image merge the head-whole route does not run" if sp.vision_family
                    else f"which the head-whole route cannot run ({sp.pooled_head_refusal or 'no decoder found under its head'})")
            return "refused", "", (
                f"{who} trains a model without a language-model head (a sequence-classification or reward model) "
                f"{what}: its score is pooled over the whole sequence inside the model; train it without sequence "
                "parallelism")
        loss = f"{who}'s compute_loss ({', '.join(why)})" if why else f"{who}'s stock compute_loss"
        return "head-whole", (f"loss head-whole: {sp.pooled_head}; {loss} runs on each batch of the group, every "
                              "rank holding its last hidden state [batch, sequence, hidden] gathered"), None
    if not why:
        return "sharded", "loss sharded: stock compute_loss, the model's causal-LM token sum over each rank's slice", None
    if sp.vision_family:
        return "refused", "", (
            f"{who} on {sp.vision_family}: {', '.join(why)} needs the model's outputs made whole across the group, "
            "which the vision-language path does not do yet; train it without sequence parallelism, or with the "
            "stock Trainer loss")
    return "gathered", (f"loss gathered ({', '.join(why)}): {who}'s compute_loss runs on each batch of the group "
                        "with the model's outputs made whole across it (every rank holds a batch's whole logits)"), None
