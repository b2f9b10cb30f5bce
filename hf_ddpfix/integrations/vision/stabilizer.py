"""The dummy-image stabiliser: every rank uses every vision parameter every step (DDP / FSDP2).

Problem (REFERENCES.md §1, §2): with LoRA (or full fine-tuning) on the vision tower, a micro-batch
without images leaves the tower's parameters unused. Stock DDP with ``find_unused_parameters=False``
then hangs (ranks differ) or fails with "Expected to have finished reduction" (no rank saw an image);
``static_graph`` fails when the image/text mix changes; under FSDP a rank that skips the tower skips
its all-gathers and the job hangs (transformers #37186).

Fix, in two parts:

1. :class:`VisionStabilizer` — a forward pre/post hook pair on the HF model (the module whose
   ``forward`` takes ``pixel_values``; it runs inside DDP's forward). In training mode with grad
   enabled, a batch without visual input runs a minimal dummy image through the tower *before* the
   language model and ties its outputs where real image features enter the language model (the input
   embeddings; Qwen3-VL's deepstack features: decoder layer ``i``) through an identity whose backward
   sends exact zeros to the tower. The loss and every language-model gradient are bit-identical, vision
   grads are exact zeros, and the autograd graph has the same shape on image and text ranks, so FSDP2
   issues its all-gathers / reduce-scatters in the same order everywhere (tying to the loss instead
   hangs FSDP2: a text rank's ``inputs_embeds`` then needs no grad, which moves the first decoder
   layer's reduce-scatter; measured). Fallback (``inputs_embeds`` passed in, reentrant checkpointing):
   tie to ``outputs.loss``, else ``logits``; fine for DDP.
2. :meth:`VisionStabilizer.finalize_vision_grads` — a zero gradient is not "no gradient" (AdamW with
   weight decay moves a parameter whose grad is zero). Once per optimizer step, before gradient
   clipping, one all-reduce(MAX) asks "did any rank see visual input in any micro-batch of this
   step?"; if not, every trainable vision ``.grad`` is set to ``None`` — exactly what stock DDP with
   ``find_unused_parameters=True`` leaves (measured on torch 2.13: a parameter unused on all ranks keeps
   ``grad=None``; one used on some rank, or in any ``no_sync`` micro-batch, gets the average with zeros).

3. Evaluation, prediction and generation under FSDP2 (``sync_eval=True``): a forward that is not a
   training forward (``model.eval()`` or no grad) still all-gathers the tower's FSDP unit on a rank with
   an image only. Every rank first agrees, with one all-gather of one byte, whether any rank passes
   visual input; if one does, the ranks without it run the dummy image in the same place as in training.
   Under ``no_grad`` nothing is tied, so the outputs are exactly stock's for the real inputs; when no rank
   has an image (the decode steps of ``generate``) no dummy runs.

Trainer wiring (transformers 5.23, ``Trainer._inner_training_loop``): attach the stabiliser to the model
before ``Trainer.train`` (before or after wrapping). Call ``finalize_vision_grads()`` on every rank after
the last backward of an optimizer step and **before** ``Trainer._clip_grad_norm`` /
``Trainer._get_grad_norm`` (clip_grad_norm_'s total norm sees zero grads vs ``None`` grads differently
in the last bit: measured, 57 of 200 random cases), e.g. by wrapping both methods.
``TrainerCallback.on_pre_optimizer_step`` exists but fires *after* clipping, so use it only as a
backstop: a second call in the same step is a no-op (no forward ran since the previous call).

Families: :mod:`hf_ddpfix.integrations.vision.families`. Hang guard: :mod:`hf_ddpfix.integrations.usage.hang_guard`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...ops.dist import collective_device, dist_ready
from ...ops.zero_tie import tie_zero
from .families import VisionAdapter, describe_unsupported, find_vision_adapter, get_submodule
from .zero import GenerateSync, any_rank, count_dummy

__all__ = ["STABILIZER_ENV", "VisionStabilizer"]

STABILIZER_ENV = "HF_DDPFIX_VLM_STABILIZER"


def _is_fsdp_managed(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - very old torch
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


class VisionStabilizer:
    """Makes every training forward use every vision parameter, with stock optimizer semantics.

    Usage (plain PyTorch; the Trainer wiring is in the module docstring)::

        stab = VisionStabilizer(model).attach()      # before or after DDP/FSDP wrapping
        for step in ...:
            for micro_batch in ...:                  # forward + backward (no_sync for all but last)
                model(**micro_batch).loss.backward()
            stab.finalize_vision_grads()             # before clipping and optimizer.step()
            clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad()

    Args:
        model: HF VLM, PeftModel, or a wrapper (hooks go on the unwrapped HF model).
        adapter: the tower adapter; found with :func:`find_vision_adapter` when ``None``.
        run_when_frozen: run the dummy even when no tower parameter is trainable. ``None`` (default)
            means "only when the tower is FSDP-sharded" (FSDP all-gathers a frozen tower too).
        train: run the dummy on text-only training forwards (``model.training`` and grad enabled).
        sync_eval: make every other forward agree across ranks (FSDP2 evaluation, prediction,
            generation; see the module docstring, part 3). Every rank must call the forward equally often.
        process_group: the group ``sync_eval`` agrees over (default: the world).

    Raises:
        ValueError: the model has no adapter in the DDP / FSDP view, e.g. LLaVA / Gemma 3, whose dummy is
            used under DeepSpeed ZeRO only (message from :func:`describe_unsupported`).

    Guarantees: text-only batches give a bit-identical loss and LM gradients and exact-zero vision
    gradients; batches with images are untouched; after ``finalize_vision_grads`` the weights after
    AdamW are bit-identical to stock DDP(find_unused_parameters=True) (test_vlm, tests/scripts/vlm_ddp.py).
    """

    def __init__(
        self, model: nn.Module, adapter: VisionAdapter | None = None, *, run_when_frozen: bool | None = None,
        train: bool = True, sync_eval: bool = False, process_group: Any = None,
    ) -> None:
        adapter = adapter or find_vision_adapter(model)
        if adapter is None:
            raise ValueError(f"hf_ddpfix: no vision stabiliser for this model: {describe_unsupported(model)}")
        if adapter.family.zero_only:
            raise ValueError(f"hf_ddpfix: no vision stabiliser for this model: {describe_unsupported(adapter.root)}")
        self.adapter = adapter
        self.run_when_frozen = run_when_frozen
        self.train = train
        self.sync_eval = sync_eval
        self.process_group = process_group
        self._handles: list[Any] = []
        self._generate = GenerateSync(adapter, process_group, self._count_generate_dummy)
        self._in_forward = False
        self._in_dummy = False
        self._tower_ran = False
        self._dummy_ran = False
        self._pending: list[tuple[nn.Module | None, list[torch.Tensor]]] = []
        self._step_images = False
        self._step_micro_batches = 0
        self.dummy_runs = 0  # number of dummy tower forwards so far (for logs and tests)
        self.eval_dummy_runs = 0  # of which in evaluation / prediction / generation forwards

    # -- hooks --------------------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        """True while the hooks are registered."""
        return bool(self._handles)

    def attach(self) -> VisionStabilizer:
        """Register the hooks (idempotent). Returns ``self``."""
        if not self._handles:
            root, tower = self.adapter.root, self.adapter.tower
            self._handles = [
                root.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
                root.register_forward_hook(self._post_hook, with_kwargs=True),
                tower.register_forward_pre_hook(self._tower_hook),
            ]
            self._handles += [m.register_forward_hook(self._tie_hook) for m in self._tie_modules()]
            if self.sync_eval:
                self._generate.attach()
        return self

    def _count_generate_dummy(self) -> None:
        self.dummy_runs += 1
        self.eval_dummy_runs += 1
        count_dummy("eval")

    def _tie_modules(self) -> list[nn.Module]:
        """Modules whose outputs can receive dummy features: the input embedding, deepstack layers."""
        mods: list[nn.Module] = []
        get_emb = getattr(self.adapter.root, "get_input_embeddings", None)
        try:
            emb = get_emb() if callable(get_emb) else None
        except (AttributeError, NotImplementedError):
            emb = None
        if isinstance(emb, nn.Module):
            mods.append(emb)
        n_deep = len(getattr(self.adapter.vision_config, "deepstack_visual_indexes", None) or [])
        for path in self.adapter.family.deepstack_layer_paths:
            layers = get_submodule(self.adapter.root, path)
            if isinstance(layers, nn.ModuleList):
                mods += list(layers)[:n_deep]
                break
        return mods

    def remove(self) -> None:
        """Remove the hooks and forget per-step state (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._generate.remove()
        self._in_forward = False
        self._pending = []
        self.reset_step()

    def _needs_dummy(self) -> bool:
        if any(p.requires_grad for p in self.adapter.tower.parameters()):
            return True
        if self.run_when_frozen is None:
            return _is_fsdp_managed(self.adapter.tower)
        return self.run_when_frozen

    def _run_dummy(self, kind: str = "train") -> list[tuple[nn.Module | None, list[torch.Tensor]]]:
        self._in_dummy = True
        try:
            out = self.adapter.run_dummy()
        finally:
            self._in_dummy = False
        self.dummy_runs += 1
        count_dummy(kind)
        ties = [(m, [t for t in ts if t.requires_grad]) for m, ts in self.adapter.tie_points(out)]
        return [(m, ts) for m, ts in ties if ts]

    def _tie_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        # Skipped under no_grad (reentrant checkpointing): the post-hook then ties to the loss instead.
        if not self._pending or not torch.is_grad_enabled():
            return None
        for i, (mod, extras) in enumerate(self._pending):
            if mod is module:
                del self._pending[i]
                return tie_zero(output, extras)
        return None

    def _tower_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._in_forward and not self._in_dummy:
            self._tower_ran = True

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        training = module.training and torch.is_grad_enabled()
        self._in_forward = training and self.train
        self._tower_ran = False
        self._dummy_ran = False
        self._pending = []
        if not training and self.sync_eval:
            local = self.adapter.has_visual_input(args, kwargs)
            if any_rank(local, self.process_group) and not local and self._needs_dummy():
                self._pending = self._run_dummy("eval")  # tied only where grad is on (_tie_hook)
                self.eval_dummy_runs += 1
            return
        if self._in_forward and self._needs_dummy() and not self.adapter.has_visual_input(args, kwargs):
            # Before the language model: FSDP then all-gathers the tower at the same point on every rank.
            self._pending = self._run_dummy()
            self._dummy_ran = True

    def _post_hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        if not self._in_forward:
            return None
        self._in_forward = False
        ran = self._tower_ran
        self.record_step_usage(ran)
        pending, self._pending = self._pending, []
        if not ran and not pending and not self._dummy_ran and self._needs_dummy():
            pending = self._run_dummy()  # visual input was passed but the tower did not run (e.g. cached)
        extras = [t for _, ts in pending for t in ts]  # not tied where real features enter: tie to the loss
        if not extras:
            return None
        return tie_zero(output, extras)

    # -- per-optimizer-step semantics ---------------------------------------------------------------
    def record_step_usage(self, has_images: bool) -> None:
        """Record one micro-batch of the current optimizer step (the hooks call this themselves)."""
        self._step_micro_batches += 1
        self._step_images = self._step_images or bool(has_images)

    def reset_step(self) -> None:
        """Forget the micro-batches recorded since the last finalize."""
        self._step_images = False
        self._step_micro_batches = 0

    def finalize_vision_grads(self, process_group: Any = None) -> bool | None:
        """Give the optimizer exactly what stock DDP(find_unused_parameters=True) would give it.

        Call on every rank after the last backward of an optimizer step and before gradient clipping
        and ``optimizer.step()``. One all-reduce(MAX) of "this rank ran the tower on real visual input
        in some micro-batch of this step" (skipped without ``torch.distributed``); if no rank did,
        every trainable vision parameter gets ``.grad = None`` (AdamW then skips it: no moment update,
        no weight decay); otherwise the (g + 0) sums are left as they are, which DDP averaged exactly
        as it averages stock's (g, unused→0). Resets the per-step state.

        Returns:
            ``True``/``False`` — whether any rank saw visual input; ``None`` (and no collective) when no
            training forward ran since the previous call, so a second call in one step is a no-op.

        Guarantees: after it, vision grads are ``None`` iff no rank saw an image this step (test_vlm,
        tests/scripts/vlm_ddp.py: bit-equal to stock fu=True with AdamW(weight_decay>0), GA and no_sync).
        """
        if self._step_micro_batches == 0:
            return None
        local = self._step_images
        self.reset_step()
        if dist_ready(process_group):
            flag = torch.tensor(
                [1 if local else 0], dtype=torch.int32, device=collective_device(process_group)
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
            any_images = bool(flag.item())
        else:
            any_images = local
        if not any_images:
            for p in self.adapter.trainable_parameters():
                p.grad = None
        return any_images
