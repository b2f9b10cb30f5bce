"""Every private upstream access in hf_ddpfix/_compat/ still behaves as the contract says.

When an upstream release moves one of them, the failing test names the contract and the version it was
last checked against, so the fix goes into one function of `_compat/`. Tests here are cheap (tiny
models, one process) and run in CI on both the pinned and the oldest supported stack.
"""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path

import pytest
import torch
from launch import free_port
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint

import hf_ddpfix
from hf_ddpfix import _compat

PKG = Path(hf_ddpfix.__file__).parent


def _broken(what: str) -> str:
    return (f"upstream contract changed: {what} (checked against {_compat.CHECKED_AGAINST}); "
            "update hf_ddpfix/_compat/")


def _tiny_llama():
    from fixtures import tiny_llama

    return tiny_llama()


# ------------------------------------------------------------------------------------------- layering


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_ops_import_neither_transformers_nor_accelerate():
    for path in sorted((PKG / "ops").rglob("*.py")):
        bad = _imported_modules(path) & {"transformers", "accelerate", "peft", "trl", "deepspeed"}
        assert not bad, f"{path.name} imports {bad}: hf_ddpfix/ops is pure torch"


def _package_imports(path: Path) -> set[str]:
    """The hf_ddpfix parts `path` imports (anywhere in the file, TYPE_CHECKING blocks included), each
    named by its first component below the package: "_compat", "ops", "integrations", "plan", "config", ..."""
    here = path.relative_to(PKG.parent).with_suffix("").parts  # ("hf_ddpfix", "integrations", "usage")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = list(here[: len(here) - node.level])
            names = [base + node.module.split(".")] if node.module else [base + [a.name] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        found |= {parts[1] for parts in names if parts[0] == "hf_ddpfix" and len(parts) > 1}
    return found


# Each layer may import only the layers below it (the README's "How it works"): ops/ is pure torch and
# integrations/ knows HF internals; neither knows the plan, the options, the facts or the Trainer entry
# points above them. plan/ is pure decisions: it reads options and the facts types of integrations/.
_MAY_IMPORT = {
    "_compat": {"_compat"},
    "ops": {"_compat", "ops"},
    "integrations": {"_compat", "ops", "integrations"},
    "plan": {"_compat", "ops", "integrations", "config", "plan"},
}


@pytest.mark.parametrize("layer", sorted(_MAY_IMPORT))
def test_lower_layers_import_nothing_above_them(layer):
    for path in sorted((PKG / layer).rglob("*.py")):
        above = _package_imports(path) - _MAY_IMPORT[layer]
        assert not above, (f"hf_ddpfix/{layer}/{path.name} imports hf_ddpfix.{sorted(above)}, a layer above "
                           f"{layer}/ (allowed: {sorted(_MAY_IMPORT[layer])}); pass what it needs in instead")


def test_the_vision_folder_imports_only_itself_and_the_layers_below():
    """integrations/vision/ (families, adapter, stabilisers, ZeRO dummy, FSDP2 wrap plan) is one feature: its
    modules import `_compat`, `ops` and each other, nothing else of `integrations/`."""

    for path in sorted((PKG / "integrations" / "vision").glob("*.py")):
        here = path.relative_to(PKG.parent).with_suffix("").parts
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                parts = list(here[: len(here) - node.level]) + (node.module.split(".") if node.module else [])
                if parts[:2] == ["hf_ddpfix", "integrations"]:
                    assert parts[2:3] == ["vision"], f"integrations/vision/{path.name} imports {'.'.join(parts)}"


def test_plan_types_import_no_rule():
    """The rules import the plan's types and `resolve` imports the rules, never the other way round."""
    tree = ast.parse((PKG / "plan" / "types.py").read_text())
    relative = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1}
    assert not relative, f"hf_ddpfix/plan/types.py imports {relative} from its own package"


@pytest.mark.parametrize("module", sorted(p.name for p in (PKG / "_compat").glob("*.py")))
def test_compat_imports_only_torch_at_module_level(module):
    tree = ast.parse((PKG / "_compat" / module).read_text())
    top = set()
    for node in tree.body:  # module level only: HF imports belong inside the functions
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top.add(node.module.split(".")[0])
    assert top <= {"__future__", "collections", "typing", "torch"}, (module, top)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


#: Our own marker attributes, stamped on objects we do not own (a Trainer, a checkpoint function).
OWN_PREFIX = "_hf_ddpfix_"

#: Upstream internals whose names carry no underscore, found by reading (the rule below cannot see them).
_INTERNALS_WITHOUT_UNDERSCORE = {"StorageWeakRef", "ForCausalLMLoss", "kineto_results"}


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines itself: functions, classes, class-level names, ``__slots__``
    entries and ``self.<name> = ...`` / ``cls.<name> = ...`` assignments."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and _is_namespace(node.value)
              and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)
              and _namespace_of(node.value) in ("self", "cls")):  # self.__dict__["_x"] = ...: its own
            names.add(node.slice.value)
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                for t in targets:
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                        if t.id == "__slots__":
                            names |= {c.value for c in ast.walk(stmt.value)
                                      if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return {n for n in names if _is_private(n)}


def _constants(tree: ast.AST) -> dict[str, str]:
    """Names bound once in ``tree`` to a string the rule can resolve (``NAME = "..."``, an f-string or ``+`` of such):
    a ``getattr(o, NAME)`` through them is read as the literal. A name bound twice to different values is left out."""
    seen: dict[str, set[str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    seen.setdefault(t.id, set()).add(_resolve(node.value, {}))
    return {n: next(iter(v)) for n, v in seen.items() if len(v) == 1 and None not in v}  # type: ignore[misc]


def _resolve(node: ast.AST, consts: dict[str, str]) -> str | None:
    """The string ``node`` always evaluates to, where the rule can tell (a constant, a known name, an f-string or
    ``+`` of those); None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if isinstance(node, ast.JoinedStr):
        parts = [_resolve(v.value if isinstance(v, ast.FormattedValue) else v, consts) for v in node.values]
        return None if None in parts else "".join(parts)  # type: ignore[arg-type]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _resolve(node.left, consts), _resolve(node.right, consts)
        return None if left is None or right is None else left + right
    return None


def _is_namespace(node: ast.AST) -> bool:
    """``vars(o)`` or ``o.__dict__``: an object's attributes read as a mapping."""
    return ((isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars")
            or (isinstance(node, ast.Attribute) and node.attr == "__dict__"))


def _namespace_of(node: ast.AST) -> str | None:
    """The object ``vars(o)`` / ``o.__dict__`` reads, where it is a plain name."""
    target = node.args[0] if isinstance(node, ast.Call) and node.args else getattr(node, "value", None)
    return target.id if isinstance(target, ast.Name) else None


def _imported_module(node: ast.Call, consts: dict[str, str]) -> str | None:
    """The module name of ``importlib.import_module("m")`` / ``import_module("m")`` / ``__import__("m")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    return _resolve(node.args[0], consts)


def private_accesses(source: str) -> list[tuple[int, str]]:
    """Every private upstream access in ``source`` (a module of hf_ddpfix outside ``_compat/``):
    ``(line, what)``.

    The allow-list: a name starting with ``_`` (dunders excepted) may appear only as
    - an attribute the same module defines (``self._x`` / ``obj._x`` where this module has a class that
      defines ``_x``, a ``__slots__`` entry ``_x`` or a ``self._x = ...`` assignment);
    - hf_ddpfix's own marker attributes (``_hf_ddpfix_*``), stamped on objects we do not own;
    - a private name imported from hf_ddpfix itself (relative import or ``hf_ddpfix.``).
    Anything else fails, whatever the name: ``obj._x``, ``getattr`` / ``hasattr`` / ``setattr`` /
    ``delattr`` with ``"_x"`` or a name the rule resolves to it (a constant, an f-string or ``+`` of constants),
    ``vars(o)["_x"]`` / ``o.__dict__["_x"]`` (and their ``.get`` / ``.pop`` / ``.setdefault``), ``from pkg._mod
    import y``, ``from pkg import _y``, ``import pkg._mod``, ``importlib.import_module("pkg._mod")`` /
    ``__import__("pkg._mod")``; and the few upstream internals named without an underscore
    (:data:`_INTERNALS_WITHOUT_UNDERSCORE`).
    """
    tree = ast.parse(source)
    own = _own_private_names(tree)
    consts = _constants(tree)

    def allowed(name: str) -> bool:
        return not _is_private(name) or name in own or name.startswith(OWN_PREFIX)

    def private_module(name: str) -> bool:
        return name.split(".")[0] != "hf_ddpfix" and any(_is_private(p) for p in name.split("."))

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute):
            if not allowed(node.attr) or node.attr in _INTERNALS_WITHOUT_UNDERSCORE:
                found.append((line, f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in _INTERNALS_WITHOUT_UNDERSCORE:
            found.append((line, node.id))
        elif isinstance(node, ast.Subscript) and _is_namespace(node.value):
            key = _resolve(node.slice, consts)
            if key is not None and not allowed(key):
                found.append((line, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            func = node.func
            module = _imported_module(node, consts)
            if module is not None and private_module(module):
                found.append((line, ast.unparse(node)))
            elif (isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr", "delattr")
                    and len(node.args) >= 2):
                key = _resolve(node.args[1], consts)
                if key is not None and not allowed(key):
                    found.append((line, f"{func.id}(..., {key!r})"))
            elif (isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault")
                    and _is_namespace(func.value) and node.args):
                key = _resolve(node.args[0], consts)
                if key is not None and not allowed(key):
                    found.append((line, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] != "hf_ddpfix":
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            if any(_is_private(p) for p in parts) or any(_is_private(n) or n in _INTERNALS_WITHOUT_UNDERSCORE
                                                         for n in names):
                found.append((line, f"from {node.module} import {', '.join(names)}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if private_module(a.name):
                    found.append((line, f"import {a.name}"))
    return found


#: The FSDP device (a `sitecustomize` put on PYTHONPATH; it must import nothing of hf_ddpfix before accelerate) is
#: contract layer too: its two accelerate internals (`AcceleratorState._mixed_precision`, `PartialState._shared_state`)
#: are checked by every FSDP launch of the suite asserting its "[fsdp_device] accelerate FSDP2 on CPU/gloo" line
#: (tests/test_fsdp_trainer.py, test_fsdp_skippable.py, test_examples_launched.py) on every stack.
DEVICE_SHIM = ("rehearse", "device")


def test_private_access_only_in_the_contract_layer():
    """Outside hf_ddpfix/_compat/ no module touches a private upstream name (the allow-list of
    :func:`private_accesses`); the contract layer wraps each one in a function with a test below."""
    offenders = [f"{path.relative_to(PKG.parent)}:{line}: {what}"
                 for path in sorted(PKG.rglob("*.py")) if "_compat" not in path.relative_to(PKG).parts
                 and path.relative_to(PKG).parts[:2] != DEVICE_SHIM
                 for line, what in private_accesses(path.read_text())]
    assert not offenders, "private upstream access outside hf_ddpfix/_compat/:\n" + "\n".join(offenders)


@pytest.mark.parametrize("source, caught", [
    ("cfg = model.config._attn_implementation", True),
    ("x = getattr(cfg, '_attn_implementation', None)", True),
    ("hasattr(out, '_fields')", True),
    ("setattr(layer, '_gradient_checkpointing_func', f)", True),
    ("from torch.utils._pytree import tree_flatten", True),
    ("from torch.nn.parallel.distributed import _DDPSink", True),
    ("import torch._dynamo", True),
    ("events = prof.profiler.kineto_results.events()", True),
    ("from torch.multiprocessing.reductions import StorageWeakRef", True),
    ("class A:\n    def f(self):\n        return self._gradient_checkpointing_func", True),
    ("class A:\n    def __init__(self):\n        self._n = 1\n    def f(self, other):\n        return other._n", False),
    ("class B:\n    __slots__ = ('_pieces',)\ndef g(b):\n    return b._pieces", False),
    ("trainer._hf_ddpfix_active = True", False),
    ("from .tiled import _split_sizes", False),
    ("from hf_ddpfix.ops import _x", False),
    ("x.__class__.__name__", False),
    # issue 38: namespaces read as mappings, computed names, modules imported by name
    ("state = vars(trainer)['_metrics']", True),
    ("state = trainer.__dict__['_stored_metrics']", True),
    ("n = vars(trainer).get('_total_train_tokens', 0)", True),
    ("trainer.__dict__.pop('_metrics')", True),
    ("x = vars(trainer)['args']", False),
    ("class H:\n    def f(self):\n        self.__dict__['_last'] = 1\n        return self.__dict__.get('_last')", False),
    ("NAME = '_metrics'\ny = getattr(trainer, NAME)", True),
    ("y = getattr(trainer, f'_{\"metrics\"}')", True),
    ("y = getattr(trainer, '_' + 'metrics')", True),
    ("y = getattr(trainer, name)", False),  # not resolvable: the rule says nothing
    ("import importlib\nm = importlib.import_module('torch._dynamo')", True),
    ("from importlib import import_module\nm = import_module('torch.distributed._tools')", True),
    ("m = __import__('torch._C')", True),
    ("import importlib\nm = importlib.import_module('torch.distributed')", False),
    ("import importlib\nm = importlib.import_module('hf_ddpfix.ops._x')", False),
])
def test_the_private_access_rule_catches_what_it_says(source, caught):
    assert bool(private_accesses(source)) is caught, private_accesses(source)


# ------------------------------------------------------------------------------------------- TRL


def _private_snapshot(obj) -> dict:
    import copy

    return {k: copy.deepcopy(v) for k, v in vars(obj).items() if k.startswith("_") and
            isinstance(v, (int, float, dict, list, str, type(None)))}


def test_trl_metric_state_is_the_named_list(tmp_path):
    """What the SP metric replay restores of a TRL trainer is ``_compat.TRL_METRIC_STATE``'s list for the installed
    TRL: an SFTTrainer's ``compute_loss`` (the loss and its logged statistics) changes private attributes of the
    trainer only among those names, and does change ``_metrics`` (and ``_total_train_tokens``, where the release
    keeps it): the list is neither short of a name nor a list of names TRL no longer writes. Runs on every stack CI
    installs (pinned trl 1.16, oldest trl 0.24, newest)."""
    trl = pytest.importorskip("trl")
    import sys

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    sys.path.insert(0, str(PKG.parent / "examples"))
    from trl_sft import WORDS, build_tokenizer

    tok = build_tokenizer()
    from fixtures import tiny_llama

    model = tiny_llama(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    texts = [" ".join(WORDS[(i * k + 3) % len(WORDS)] for k in range(1, 7)) for i in range(4)]
    args = SFTConfig(str(tmp_path), use_cpu=True, report_to=[], max_length=16, per_device_train_batch_size=2,
                     bf16=False, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, processing_class=tok, train_dataset=Dataset.from_dict({"text": texts}))
    batch = next(iter(trainer.get_train_dataloader()))
    names = _compat.trl_metric_names()
    assert names == _compat.trl_metric_names(trl.__version__) and "_metrics" in names, (trl.__version__, names)
    before = _private_snapshot(trainer)
    trainer.model.train()
    trainer.compute_loss(trainer.model, batch)
    after = _private_snapshot(trainer)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed <= set(names), _broken(f"trl {trl.__version__}'s compute_loss changed private attributes "
                                          f"{sorted(changed - set(names))} that TRL_METRIC_STATE does not name")
    assert "_metrics" in changed, _broken(f"trl {trl.__version__}'s SFTTrainer no longer logs into _metrics")
    assert ("_total_train_tokens" in changed) == ("_total_train_tokens" in before), changed
    # the contract functions: only the named attributes, read and written back in place
    state = _compat.trl_metric_state(trainer)
    assert set(state) == set(names) & set(vars(trainer)) and state["_metrics"] is trainer._metrics
    held = trainer._metrics
    _compat.restore_trl_metric_state(trainer, {"_metrics": {"train": {}}})
    assert trainer._metrics is held and held == {"train": {}}
    with pytest.raises(ValueError, match="not TRL metric state"):
        _compat.restore_trl_metric_state(trainer, {"_other": 1})


def test_trl_metric_names_pick_the_release_at_or_below():
    assert _compat.trl_metric_names("0.24.0") == _compat.TRL_METRIC_STATE[(0, 24)]
    assert _compat.trl_metric_names("1.20.1") == _compat.TRL_METRIC_STATE[(1, 16)]
    assert _compat.trl_metric_names("0.20.0") == _compat.TRL_METRIC_STATE[(0, 24)]  # below the oldest: its entry


# ------------------------------------------------------------------------------------------- Trainer


def _reachable_source(cls, name: str, depth: int = 3) -> str:
    """Source of ``cls.name`` and of the ``self._helper(...)`` methods it calls, ``depth`` levels deep."""
    import re

    seen, todo, out = set(), [name], []
    for _ in range(depth):
        nxt = []
        for n in todo:
            if n in seen or not callable(getattr(cls, n, None)):
                continue
            seen.add(n)
            src = inspect.getsource(getattr(cls, n))
            out.append(src)
            nxt += re.findall(r"self\.(_[A-Za-z_]+)\(", src)
        todo = nxt
    return "\n".join(out)


def test_trainer_private_methods_exist_with_the_signatures_we_wrap():
    from transformers import Trainer

    assert callable(getattr(Trainer, _compat.TRAINER_INNER_LOOP, None)), _broken("Trainer._inner_training_loop is gone")
    params = inspect.signature(getattr(Trainer, _compat.TRAINER_INNER_LOOP)).parameters
    assert "resume_from_checkpoint" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()), \
        _broken("Trainer._inner_training_loop no longer takes resume_from_checkpoint")
    train_params = list(inspect.signature(Trainer.train).parameters)
    assert train_params[1] == "resume_from_checkpoint", _broken("Trainer.train's first argument moved")
    # the inner loop must be where accelerate wraps the model (the plan's DDP kwargs are read there)
    src = _reachable_source(Trainer, _compat.TRAINER_INNER_LOOP)
    assert "accelerator.prepare" in src, _broken("Trainer._inner_training_loop no longer calls accelerator.prepare")
    if not _compat.inner_loop_sets_up_training():  # 5.3-5.23
        for name in _compat.TRAINER_STEP_HOOKS:
            assert callable(getattr(Trainer, name, None)), _broken(f"Trainer.{name} is gone")
        assert any(h in src for h in _compat.TRAINER_STEP_HOOKS), \
            _broken("the inner loop no longer calls _clip_grad_norm/_get_grad_norm before the optimizer step")
        return
    # 5.0-5.2: checkpointing on, then _wrap_model (rebuilds ddp_handler), then prepare; clipping inline
    wrap = getattr(Trainer, _compat.TRAINER_WRAP_MODEL, None)
    assert callable(wrap) and list(inspect.signature(wrap).parameters)[1:4] == ["model", "training", "dataloader"], \
        _broken("Trainer._wrap_model(model, training, dataloader) changed")
    loop = inspect.getsource(getattr(Trainer, _compat.TRAINER_INNER_LOOP))
    marks = ["gradient_checkpointing_enable(", f"self.{_compat.TRAINER_WRAP_MODEL}(", "self.accelerator.prepare(",
             "_set_sync_gradients(True)", "self.accelerator.clip_grad_norm_(", "on_pre_optimizer_step(",
             "self.optimizer.step()"]
    where = [loop.find(m) for m in marks]
    assert -1 not in where and where == sorted(where), \
        _broken(f"the 5.0-5.2 inner loop no longer runs {marks} in this order (found at {where})")


def test_trainer_callbacks_is_the_live_list(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    trainer = Trainer(model=_tiny_llama(), args=TrainingArguments(str(tmp_path), use_cpu=True, report_to=[]))
    callbacks = _compat.trainer_callbacks(trainer)
    assert isinstance(callbacks, list)
    cb = TrainerCallback()
    callbacks.insert(0, cb)
    assert trainer.callback_handler.callbacks[0] is cb, _broken("callback_handler.callbacks is not the live list")


def test_set_ddp_kwargs_reaches_the_handler_accelerate_reads():
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    acc = Accelerator(cpu=True)
    _compat.set_ddp_kwargs(acc, find_unused_parameters=False, static_graph=True)
    assert isinstance(acc.ddp_handler, DistributedDataParallelKwargs), _broken("Accelerator.ddp_handler")
    assert acc.ddp_handler.to_kwargs() == {"static_graph": True}  # find_unused False is the default


def test_around_backward_hands_the_loss_before_accelerate_scales_it_and_the_trainer_calls_it():
    from accelerate import Accelerator
    from transformers import Trainer

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    seen = []
    w = torch.ones(2, requires_grad=True)
    undo = _compat.around_backward(acc, lambda loss: seen.append(loss.detach().clone()) or loss * 1.0)
    acc.backward((w * 3).sum())
    assert seen and seen[0].item() == 6.0, _broken("accelerator.backward no longer goes through the instance")
    assert torch.equal(w.grad, torch.full((2,), 1.5)), _broken("Accelerator.backward no longer divides by GA steps")
    undo()
    assert "backward" not in vars(acc)
    src = inspect.getsource(Trainer.training_step)
    assert "self.accelerator.backward(loss" in src, _broken("Trainer.training_step no longer calls accelerator.backward")


def test_ddp_sink_node_is_an_identity_per_output():
    import os

    import torch.distributed as dist

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"p": self.a(x), "q": self.b(x)}

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())  # CI runs the stacks side by side: no fixed port
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = Two()
        out = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)(torch.randn(3, 2))
        node = out["q"].grad_fn
        assert _compat.is_ddp_sink_node(node), _broken(f"DDP's output node is {type(node).__name__}")
        nexts = node.next_functions
        assert len(nexts) == 2 and out["q"].output_nr == 1, _broken("_DDPSink outputs no longer match its inputs")
        assert nexts[1][0].next_functions[0][0].variable is model.b.bias, _broken("_DDPSink output i != input i")
    finally:
        dist.destroy_process_group()


def test_ddp_no_sync_flag():
    import torch.distributed as dist

    from hf_ddpfix.ops.dist import world_size

    assert world_size() == 1
    src = inspect.getsource(torch.nn.parallel.DistributedDataParallel.no_sync)
    assert "require_backward_grad_sync" in src, _broken("DDP.no_sync no longer sets require_backward_grad_sync")
    assert _compat.ddp_syncs_grads(nn.Linear(1, 1)) is True
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------------------- models


def test_unwrap_model_strips_compile_ddp_style_and_peft_wrappers():
    from peft import LoraConfig, get_peft_model

    base = _tiny_llama()
    peft = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    compiled = torch.compile(peft, backend="eager")
    assert hasattr(compiled, "_orig_mod"), _broken("torch.compile wrapper has no _orig_mod")
    assert _compat.unwrap_model(nn.DataParallel(compiled)) is base
    assert _compat.unwrap_parallel(nn.DataParallel(compiled)) is peft


def test_checkpointed_layers_call_the_function_we_set():
    model = _tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in _compat.checkpointable_layers(model) if type(m).__name__ == "LlamaDecoderLayer"]
    assert len(layers) == 2 and all(_compat.is_checkpointing(m) for m in layers), \
        _broken("decoder layers no longer carry gradient_checkpointing/_gradient_checkpointing_func")
    assert isinstance(_compat.layer_checkpoint_func(layers[0]), functools.partial)
    calls = []

    def func(function, *args, **kwargs):
        calls.append(1)
        return checkpoint(function, *args, use_reentrant=False, **kwargs)

    for m in layers:
        _compat.set_layer_checkpoint_func(m, func)
    model.train()
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    assert len(calls) == 2, _broken("checkpointed layers no longer call _gradient_checkpointing_func")


def test_causal_lm_loss_identity_and_forward_source():
    model = _tiny_llama()
    assert model.loss_function is _compat.causal_lm_loss_function(), \
        _broken("LlamaForCausalLM.loss_function is not ForCausalLMLoss")
    src = _compat.forward_source(type(model))
    assert "self.lm_head(" in src and "self.loss_function(" in src, _broken("LlamaForCausalLM.forward shape")


# ------------------------------------------------------------------------------------------- torch


def test_storage_weak_ref_identifies_views_of_one_storage():
    t = torch.zeros(8)
    assert _compat.storage_weak_ref(t) == _compat.storage_weak_ref(t[2:])
    assert _compat.storage_weak_ref(t) != _compat.storage_weak_ref(torch.zeros(8))
    p = nn.Parameter(torch.zeros(4))
    assert _compat.view_base(p[:2]) is p and _compat.view_base(t) is None


def test_module_parameter_slots_swap_a_parameter_for_a_tensor():
    lin = nn.Linear(2, 2)
    slots = _compat.module_parameter_slots(lin)
    old = slots["weight"]
    slots["weight"] = torch.ones(2, 2)
    try:
        assert torch.equal(lin.weight, torch.ones(2, 2)) and "weight" in dict(lin.named_parameters())
    finally:
        slots["weight"] = old


def test_attn_implementation_is_what_the_attention_modules_dispatch_on():
    from fixtures import tiny_llama_config
    from transformers import LlamaForCausalLM

    for impl in ("eager", "sdpa"):
        model = LlamaForCausalLM(tiny_llama_config(attn_implementation=impl))
        attn = model.model.layers[0].self_attn
        assert _compat.attn_implementation(model.config) == impl, _broken("config._attn_implementation")
        assert _compat.model_attn_implementation(attn) == impl, _broken("attention module's config")
    assert _compat.attn_implementation(None) is None and _compat.model_attn_implementation(nn.Linear(1, 1)) is None


def test_no_split_modules_names_the_decoder_block():
    assert "LlamaDecoderLayer" in _compat.no_split_modules(_tiny_llama()), _broken("PreTrainedModel._no_split_modules")
    assert _compat.no_split_modules(nn.Linear(1, 1)) == []


def test_is_namedtuple_only_for_namedtuples():
    import collections
    from typing import NamedTuple

    class Pair(NamedTuple):
        a: int
        b: int

    assert _compat.is_namedtuple(Pair(1, 2)) and _compat.is_namedtuple(collections.namedtuple("P", "x")(1))
    assert not _compat.is_namedtuple((1, 2)) and not _compat.is_namedtuple([1, 2]) and not _compat.is_namedtuple(Pair)


def test_engine_will_run_all_answers_inside_backward_which_leaves_get_a_gradient():
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    nodes = [torch.autograd.graph.get_gradient_edge(t).node for t in (a, b)]
    seen = {}
    loss = (a * 2).sum()
    loss.grad_fn.register_prehook(lambda g: seen.update(a=_compat.engine_will_run_all(nodes[:1]),
                                                        both=_compat.engine_will_run_all(nodes)))
    loss.backward()
    assert seen == {"a": True, "both": False}, _broken(f"torch._C._will_engine_execute_node answered {seen}")


def test_backward_id_is_one_per_backward_pass_and_minus_one_outside():
    a = torch.ones(2, requires_grad=True)
    seen: list[int] = []
    a.register_hook(lambda g: seen.append(_compat.backward_id()))
    b = a * 2
    b.register_hook(lambda g: seen.append(_compat.backward_id()))
    b.sum().backward()
    (a * 3).sum().backward()
    assert _compat.backward_id() == -1 and seen[0] == seen[1] != seen[2] and min(seen) >= 0, _broken(
        f"torch._C._current_graph_task_id answered {seen}")


def test_autograd_function_class_names_the_function_that_made_a_node():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    x = torch.ones(2, requires_grad=True)
    assert _compat.autograd_function_class(Twice.apply(x).grad_fn) is Twice, _broken("BackwardCFunction._forward_cls")
    assert _compat.autograd_function_class((x + 1).grad_fn) is None


def test_profiler_memory_events_see_each_allocation_and_free_in_order():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t = torch.empty(1 << 20, dtype=torch.uint8)
        del t
    events = _compat.profiler_memory_events(prof)
    sizes = [n for _, n in events]
    assert (1 << 20) in sizes and -(1 << 20) in sizes, _broken(f"profiler kineto_results [memory] events: {sizes}")
    assert sizes.index(1 << 20) < sizes.index(-(1 << 20)) and [t for t, _ in events] == sorted(t for t, _ in events)


def test_dispatch_mode_and_tree_flatten():
    seen = []

    class Names(_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Names():
        torch.ones(2) + 1
    assert any(n.startswith("add") for n in seen), _broken(f"TorchDispatchMode saw {seen}")
    leaves, _ = _compat.tree_flatten(([1, {"a": 2}], (3,)))
    assert leaves == [1, 2, 3]


def test_checkpoint_recompute_probe_fires_only_at_the_last_saved_tensors():
    """Inside a non-reentrant recompute the probe is True exactly when the next saved tensors are the last."""
    seen: list[tuple[str, bool]] = []

    def body(x):
        y = x.sin()  # saves x
        seen.append(("after_sin", _compat.checkpoint_recompute_is_last(1)))
        return y.cos()  # saves y: the last saved tensor of the recompute

    x = torch.randn(4, requires_grad=True)
    assert _compat.checkpoint_recompute_is_last(1) is False  # outside any checkpoint
    checkpoint(body, x, use_reentrant=False).sum().backward()
    assert seen[0] == ("after_sin", False)  # the forward: not a recompute
    assert seen[1] == ("after_sin", True), _broken(f"torch.utils.checkpoint recompute internals: {seen}")


# ------------------------------------------------------------------------------------------- version reach


def test_checkpointing_switch_names_match_the_installed_transformers(tmp_path):
    """`checkpointing_training_args` / `checkpointing_args` / `enable_model_checkpointing` use the names the
    installed transformers has (5.23: activation_*, 5.0-5.22: gradient_*) without a deprecation warning."""
    import warnings

    from transformers import TrainingArguments

    flag, kwargs_name = _compat.checkpointing_arg_names()
    assert {flag, kwargs_name} <= set(TrainingArguments.__dataclass_fields__), _broken(f"TrainingArguments.{flag}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[],
                                 **_compat.checkpointing_training_args(True, {"use_reentrant": True}))
        model = _tiny_llama()
        _compat.enable_model_checkpointing(model, {"use_reentrant": True})
    assert _compat.checkpointing_args(args) == (True, {"use_reentrant": True})
    assert _compat.checkpointing_args(TrainingArguments(str(tmp_path), use_cpu=True, report_to=[]))[0] is False
    layers = [m for m in _compat.checkpointable_layers(model) if type(m).__name__ == "LlamaDecoderLayer"]
    assert len(layers) == 2 and all(_compat.is_checkpointing(m) for m in layers), _broken("model checkpointing switch")
    assert all(_compat.layer_checkpoint_func(m).keywords == {"use_reentrant": True} for m in layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _compat.disable_model_checkpointing(model)
    assert not any(_compat.is_checkpointing(m) for m in _compat.checkpointable_layers(model))
    if flag == "activation_checkpointing":  # 5.23: the deprecated alias resolves into the new name
        with pytest.warns(FutureWarning):
            old = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], gradient_checkpointing=True,
                                    gradient_checkpointing_kwargs={"use_reentrant": True})
        assert _compat.checkpointing_args(old) == (True, {"use_reentrant": True})


def test_setup_runs_with_checkpointing_on_and_its_ddp_kwargs_reach_prepare(tmp_path):
    """`when_ready_to_prepare` (called at the start of `_inner_training_loop`, as hf_ddpfix does) runs its
    setup once, with the requested checkpointing on, and the DDP kwargs it sets are still the ones
    `accelerator.prepare` reads (5.3-5.23: at once; 5.0-5.2: after the loop's `_wrap_model`, which
    rebuilds `accelerator.ddp_handler`). TrainingArguments are left as they were."""
    from transformers import Trainer, TrainingArguments

    class Stop(Exception):
        pass

    seen: dict = {"setups": 0}

    def setup():
        layers = list(_compat.checkpointable_layers(trainer.model))
        seen["on"] = bool(layers) and all(_compat.is_checkpointing(m) for m in layers)
        seen["setups"] += 1
        _compat.set_ddp_kwargs(trainer.accelerator, static_graph=True)

    def prepare(*args, **kwargs):
        if not any(isinstance(a, nn.Module) for a in args):  # the data loader
            return stock_prepare(*args, **kwargs)
        seen["static_graph"] = trainer.accelerator.ddp_handler.static_graph
        raise Stop

    def inner(*args, **kwargs):
        stack.append(_compat.when_ready_to_prepare(trainer, setup))
        return getattr(Trainer, _compat.TRAINER_INNER_LOOP)(trainer, *args, **kwargs)

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                             **_compat.checkpointing_training_args(True, {"use_reentrant": False}))
    trainer = Trainer(model=_tiny_llama(), args=args, train_dataset=[{"input_ids": [1, 2], "labels": [1, 2]}])
    before = args.to_dict()
    stack: list = []
    setattr(trainer, _compat.TRAINER_INNER_LOOP, inner)
    stock_prepare = trainer.accelerator.prepare
    trainer.accelerator.prepare = prepare
    with pytest.raises(Stop):
        trainer.train()
    for undo in stack:
        undo()
    assert seen["setups"] == 1, _broken("the setup did not run exactly once before accelerator.prepare")
    assert seen["on"], _broken("checkpointing is not on at the hook point")
    assert seen["static_graph"] is True, _broken("accelerator.ddp_handler is rebuilt after the hook point")
    assert _compat.TRAINER_WRAP_MODEL not in vars(trainer) and args.to_dict() == before


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_finalize_runs_before_every_clip_and_every_optimizer_step(tmp_path, monkeypatch, max_grad_norm):
    """`before_gradient_clipping`: once per optimizer step, after the last backward, before the gradients
    are clipped or measured and before `optimizer.step()`, with and without `max_grad_norm`."""
    from transformers import Trainer, TrainingArguments

    events: list[str] = []
    dirty = [False]

    def finalize():
        if dirty[0]:  # idempotent within a step, as the callers' finalizations are
            events.append("finalize")
            dirty[0] = False

    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: (events.append("clip"), clip(*a, **k))[1])
    step_hook = register_optimizer_step_pre_hook(lambda *_: events.append("step"))
    model = _tiny_llama()
    fwd_hook = model.register_forward_hook(lambda *_: dirty.__setitem__(0, True))
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=2, save_strategy="no",
                             gradient_accumulation_steps=2, per_device_train_batch_size=1,
                             max_grad_norm=max_grad_norm, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 4)
    undo = _compat.before_gradient_clipping(trainer, finalize)
    try:
        trainer.train()
    finally:
        undo()
        step_hook.remove()
        fwd_hook.remove()
    assert [e for e in events if e != "clip"] == ["finalize", "step"] * 2, _broken(f"finalize/step order: {events}")
    assert all(events[i - 1] in ("finalize", "clip") for i, e in enumerate(events) if e == "clip"), \
        _broken(f"gradients clipped or measured before the finalize: {events}")
    assert not {"_clip_grad_norm", "_get_grad_norm"} & set(vars(trainer))
    assert "clip_grad_norm_" not in vars(trainer.accelerator)


# ------------------------------------------------------------------------------------ long context


def test_transformers_checkpoints_llama_layers_in_a_class_level_forward_wrapper():
    """integrations/long_context/long_context.py re-enters this wrapper's checkpoint call from its instance forward
    (5.23); before 5.23 `GradientCheckpointingLayer.__call__` checkpoints the whole call, so an instance
    forward already runs inside the checkpoint and `class_checkpoint_inner_forward` must say None."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    inner = _compat.class_checkpoint_inner_forward(LlamaDecoderLayer.forward)
    if inner is None:
        assert "__call__" in vars(GradientCheckpointingLayer), _broken(
            "LlamaDecoderLayer checkpoints neither in a forward_with_checkpointing wrapper nor in __call__")
    else:
        assert inner.__name__ == "forward", _broken("forward_with_checkpointing wraps something else")
    assert _compat.class_checkpoint_inner_forward(torch.nn.Linear.forward) is None


def test_flash_attention_kernels_exist_with_the_signatures_we_call():
    import torch.nn.functional as F

    q = torch.randn(1, 4, 9, 8, requires_grad=True)
    k = torch.randn(1, 2, 9, 8, requires_grad=True)
    v = torch.randn(1, 2, 9, 8, requires_grad=True)
    o, lse, state = _compat.flash_attention_forward(q, k, v, 8**-0.5)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=8**-0.5, enable_gqa=True)
    assert torch.equal(o, ref) and lse.shape == (1, 4, 9)
    g = torch.randn_like(o)
    dq, dk, dv = _compat.flash_attention_backward(g, q, k, v, o, lse, state, 8**-0.5)
    for a, b in zip((dq, dk, dv), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        assert torch.equal(a, b)
    assert ref.grad_fn.name().startswith("ScaledDotProductFlashAttentionForCpu"), _broken(
        "sdpa no longer dispatches to the CPU flash kernel the ledger models")
    assert hasattr(torch.ops.aten, _compat.FLASH_CPU_BACKWARD_OP)


def test_fake_tensors_from_meta_and_saved_tensor_hook_probe():
    mode = _compat.fake_tensor_mode()
    t = _compat.fake_from_meta(mode, torch.empty(3, 4, device="meta", dtype=torch.bfloat16), torch.device("cpu"))
    assert t.device.type == "cpu" and t.shape == (3, 4) and t.dtype == torch.bfloat16
    assert _compat.in_checkpoint_recompute() is False
    m = torch.nn.BatchNorm1d(2)
    assert set(_compat.module_buffer_slots(m)) >= {"running_mean", "running_var"}


# ------------------------------------------------------------------------------------------- deepspeed


def test_deepspeed_leaf_flag_and_default_leaf_classes():
    """set_z3_leaf_modules flags a module through the attribute z3_leaf_marked reads; the default leaf
    classes (zero_optimization.leaf_module) name real transformers MoE blocks (deepspeed 0.19.8)."""
    ds = pytest.importorskip("deepspeed.utils", reason="test extra: deepspeed")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

    model = nn.Sequential(Block(), nn.Linear(2, 2))
    assert not _compat.z3_leaf_marked(model[0])
    ds.set_z3_leaf_modules(model, [Block])
    assert _compat.z3_leaf_marked(model[0]), _broken("set_z3_leaf_modules no longer sets module._z3_leaf")
    assert not _compat.z3_leaf_marked(model[1])
    ds.unset_z3_leaf_modules(model, [Block])
    assert not _compat.z3_leaf_marked(model[0])
    defaults = _compat.deepspeed_default_leaf_classes()
    assert "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock" in defaults, _broken(
        "deepspeed's DEFAULT_LEAF_MODULE_CLASSES moved or changed")


def test_zero_flat_slices_reads_the_attributes_deepspeed_sets():
    """`_compat.zero_flat_slices` / `deepspeed_engine` read ZeRO-1/2/3 private state (deepspeed 0.19.8, accelerate
    1.15). Behaviour is checked end to end by tests/scripts/deepspeed_train.py (`zero_skip_unused` cases: the
    slices mirror the weights, the inner optimizer's step hooks fire); here, cheaply, that every name it reads
    is still where it was, and that ZeRO still steps the inner torch optimizer through `optimizer.step()` (the
    hooks `ZeroSkipUnused` registers) and copies the fp32 partitions into the model weights *after* it."""
    pytest.importorskip("deepspeed", reason="test extra: deepspeed")
    import dataclasses

    from accelerate import Accelerator
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils.tensor_fragment import fragment_address, tensor_fragment

    def source(fn) -> str:
        while fn.__name__ == "wrapped_fn":  # deepspeed's instrument_w_nvtx decorator (no functools.wraps)
            fn = dict(zip(fn.__code__.co_freevars, fn.__closure__, strict=True))["func"].cell_contents
        return inspect.getsource(fn)

    z12 = source(DeepSpeedZeroOptimizer)
    for name in ("self.bit16_groups", "self.single_partition_of_fp32_groups", "_hp_mapping"):
        assert name in z12, _broken(f"DeepSpeedZeroOptimizer no longer uses {name}")
    assert {"hp_fragment_address", "lp_fragment_address"} <= {f.name for f in dataclasses.fields(tensor_fragment)}, \
        _broken("tensor_fragment lost hp_fragment_address / lp_fragment_address")
    assert {f.name for f in dataclasses.fields(fragment_address)} == {"numel", "start"}, _broken("fragment_address")
    step12 = source(DeepSpeedZeroOptimizer.step)
    assert step12.index("self._optimizer_step(i)") < step12.index("bit16_partitions[partition_id].data.copy_("), \
        _broken("ZeRO-1/2 no longer copies the fp32 partition into the weights after the inner step")
    assert "self.optimizer.step()" in source(DeepSpeedZeroOptimizer._optimizer_step), _broken("ZeRO-1/2 inner step")
    z3 = source(DeepSpeedZeroOptimizer_Stage3)
    for name in ("self.fp16_groups", "self.fp32_partitioned_groups_flat", "self.grad_position", "def get_param_id",
                 "self.swap_optimizer", "self.backup_optimizer", "ds_tensor"):
        assert name in z3, _broken(f"DeepSpeedZeroOptimizer_Stage3 no longer has {name}")
    assert "self.grad_position[param_id] = [int(i), int(current_offset), int(num_elements)]" in source(
        DeepSpeedZeroOptimizer_Stage3.set_grad_positions), _broken("ZeRO-3 grad_position layout")
    assert "optimizer.step()" in source(DeepSpeedZeroOptimizer_Stage3._optimizer_step), _broken("ZeRO-3 inner step")
    step3 = source(DeepSpeedZeroOptimizer_Stage3.step)
    assert step3.index("self._optimizer_step(sub_group_id)") < step3.index(
        "self._reassign_or_swap_out_partitioned_parameters(sub_group_id)"), _broken("ZeRO-3 step order")
    assert "self.deepspeed_engine_wrapped" in source(Accelerator), _broken("Accelerator.deepspeed_engine_wrapped")
    assert "self.engine = engine" in source(DeepSpeedEngineWrapper.__init__), _broken("DeepSpeedEngineWrapper.engine")

    class Wrapped:  # what deepspeed_engine reads
        deepspeed_engine_wrapped = type("W", (), {"engine": "E"})()

    assert _compat.deepspeed_engine(Wrapped()) == "E" and _compat.deepspeed_engine(object()) is None
    with pytest.raises(ValueError, match="not a ZeRO optimizer"):
        _compat.zero_flat_slices(type("Engine", (), {"optimizer": torch.optim.SGD([nn.Parameter(torch.ones(1))], 1.0)}))


def test_generate_pre_encodes_images_exactly_when_the_contract_says_so():
    """transformers 5.23 `generate` runs the vision tower before the prefill forward and passes
    `mm_encoder_outputs` (the eval sync then agrees at `generate`'s entry); where the contract says it does
    not, the prefill forward carries the pixels (the forward hooks agree there)."""
    from fixtures import build_qwen2_5_vl, make_batch

    model = build_qwen2_5_vl(0).eval()
    calls: list[set[str]] = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append({k for k, v in kwargs.items() if v is not None}), with_kwargs=True)
    batch = make_batch(True, seed=1)
    batch.pop("labels")
    # only the inputs this release's forward names (5.0's Qwen2.5-VL takes no mm_token_type_ids, and its
    # generate rejects keywords the forward does not name)
    named = set(inspect.signature(model.forward).parameters)
    batch = {k: v for k, v in batch.items() if k in named}
    assert {"input_ids", "pixel_values", "image_grid_thw"} <= set(batch), sorted(batch)
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    handle.remove()
    if _compat.generate_pre_encodes_images(model):
        assert _compat.MM_ENCODER_OUTPUTS_KWARG in calls[0] and "pixel_values" not in calls[0], _broken(
            f"generate no longer pre-encodes images: prefill forward got {sorted(calls[0])}")
    else:
        assert "pixel_values" in calls[0], _broken(f"prefill forward without pixels: {sorted(calls[0])}")
    assert all("pixel_values" not in c and _compat.MM_ENCODER_OUTPUTS_KWARG not in c for c in calls[1:])


@pytest.mark.parametrize("family", ["llava", "gemma3", "internvl", "mistral3", "idefics3", "smolvlm"])
def test_image_features_reads_what_the_model_forward_uses(family):
    """`_compat.image_features` returns what the model's own forward takes from `get_image_features`
    (`.pooler_output`, read as an attribute): on 5.0 it is set after the fact and, on a `BaseModelOutput`
    or a `pooler_output=None` output, is an attribute only (not a key); on 5.23 / 5.24 it is a key."""
    from zoo import ZERO_DISCOVERED, ZOO

    from hf_ddpfix.integrations.vision.zero import ZeroVisionStabilizer

    entry = {**ZOO, **ZERO_DISCOVERED}[family]
    model = entry.model(0).eval()
    adapter = ZeroVisionStabilizer(model).adapter  # builds and verifies the dummy layout
    adapter.verify()
    pv, grid = adapter.dummy_inputs()
    with torch.no_grad():
        out = adapter.run_tower(pv, grid)
    feats = _compat.image_features(out)
    assert feats is not None and feats is out.pooler_output, _broken(
        f"{family}: get_image_features' features are no longer its output's pooler_output ({type(out).__name__})")
    tensors = [feats] if isinstance(feats, torch.Tensor) else list(feats)
    assert tensors and all(isinstance(t, torch.Tensor) and t.numel() > 0 for t in tensors)
    # the other shapes a release may return: the features themselves
    t = torch.ones(2, 3)
    assert _compat.image_features(t) is t
    pair = (t, t)
    assert _compat.image_features(pair) is pair
    assert _compat.image_features({"last_hidden_state": t}) is None and _compat.image_features(None) is None


# ------------------------------------------------------------------------------------ sequence parallel


def test_accelerate_and_the_trainer_read_deepspeed_sp_only_through_accelerator_parallelism_config():
    """`stand_down_accelerate_sequence_parallel` swaps `accelerator.state.parallelism_config`: every DeepSpeed-SP
    path must read it through the `Accelerator.parallelism_config` property, and `Trainer.__init__` must be where
    `model_accepts_loss_kwargs` is forced off (the value the stand-down restores)."""
    if not _compat.parallelism_config_available():
        pytest.skip("this accelerate has no ParallelismConfig(sp_size=N) (>= 1.12): nothing to stand down")
    from accelerate import Accelerator
    from transformers import Trainer

    prop = inspect.getsource(Accelerator.parallelism_config.fget)
    assert "self.state.parallelism_config" in prop, _broken("Accelerator.parallelism_config reads the state")
    for name in ("compute_loss", "_inner_training_loop", "_prepare_for_training", "get_sp_size"):
        fn = getattr(Trainer, name, None)
        if fn is None:
            continue
        src = inspect.getsource(fn)
        if "sp_" in src:
            assert "self.accelerator, \"parallelism_config\"" in src or "self.accelerator.parallelism_config" in src, \
                _broken(f"Trainer.{name} reads the SP switch elsewhere")
    init = inspect.getsource(Trainer.__init__) + inspect.getsource(Trainer)
    assert 'pc.sp_backend == "deepspeed" and pc.sp_enabled' in init and "model_accepts_loss_kwargs = False" in init, \
        _broken("Trainer forces model_accepts_loss_kwargs off for DeepSpeed SP")


def test_stand_down_swaps_the_parallelism_config_for_one_loop_and_restores_it(tmp_path):
    if not _compat.parallelism_config_available():
        pytest.skip("this accelerate has no ParallelismConfig(sp_size=N) (>= 1.12): nothing to stand down")
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import Trainer, TrainingArguments

    trainer = Trainer(model=_tiny_llama(), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                  report_to=[]))
    stock_accepts = trainer.model_accepts_loss_kwargs  # no SP: what Trainer.__init__ computes
    assert _compat.sequence_parallel._accepts_loss_kwargs(trainer) == stock_accepts
    pc = ParallelismConfig(sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
    fake = SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(parallelism_config=pc),
                                                       unwrap_model=lambda m: m),
                           model=trainer.model, model_accepts_loss_kwargs=False)
    undo = _compat.stand_down_accelerate_sequence_parallel(fake)
    now = fake.accelerator.state.parallelism_config
    assert now.sp_size == 1 and not now.sp_enabled and fake.model_accepts_loss_kwargs == stock_accepts
    undo()
    assert fake.accelerator.state.parallelism_config is pc and fake.model_accepts_loss_kwargs is False
    assert _compat.parallelism_sp_settings(SimpleNamespace(args=SimpleNamespace(parallelism_config=pc))) == (
        2, "deepspeed", "sdpa")


def test_deepspeed_engine_records_its_sequence_parallel_size():
    engine = pytest.importorskip("deepspeed.runtime.engine", reason="test extra: deepspeed")
    src = inspect.getsource(engine.DeepSpeedEngine._configure_distributed_model)
    assert "self.sequence_parallel_size = groups._get_sequence_parallel_world_size()" in src, \
        _broken("DeepSpeedEngine.sequence_parallel_size")
    assert _compat.deepspeed_engine_sequence_parallel_size(object()) is None  # not an engine: no check


def test_attention_modules_look_their_kernel_up_in_the_registry_at_call_time():
    """_compat/attention.py: `config._attn_implementation` names the registry entry an attention module
    calls; a local override of that entry reaches the module for one block and is undone after it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_ddpfix._compat import (
        attention_function_override,
        attention_implementation,
        current_attention_function,
        stock_attention_function,
    )

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, vocab_size=50, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    attn = model.model.layers[0].self_attn
    assert attention_implementation(attn) == "sdpa"
    assert stock_attention_function("sdpa") is sdpa_attention_forward is current_attention_function("sdpa")
    seen = []

    def spy(module, q, k, v, mask, **kwargs):
        seen.append((module, q.shape, sorted(kwargs)))
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    with attention_function_override("sdpa", spy):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert seen and seen[0][0] is attn and seen[0][1] == (1, 4, 3, 8) and "scaling" in seen[0][2], seen
    assert current_attention_function("sdpa") is sdpa_attention_forward


def test_zero3_partitioned_marker_and_gathered_parameters():
    """`_compat.zero3_partitioned` reads the ``ds_id`` deepspeed gives a parameter it converts (zero.Init or the
    ZeRO-3 engine), and `_compat.zero3_gathered` calls ``GatheredParameters(params, modifier_rank=None)``
    (deepspeed 0.19.8); end to end: tests/test_zero3_loaded.py (models built by zero.Init)."""
    deepspeed = pytest.importorskip("deepspeed", reason="test extra: deepspeed")
    from deepspeed.runtime.zero import partition_parameters

    GatheredParameters = deepspeed.zero.GatheredParameters  # noqa: N806 - the class, as the contract calls it

    src = inspect.getsource(partition_parameters)
    assert "param.ds_id = " in src, _broken("deepspeed no longer sets param.ds_id on partitioned parameters")
    assert "modifier_rank" in inspect.signature(GatheredParameters.__init__).parameters, _broken(
        "GatheredParameters(modifier_rank=...)")
    plain = torch.nn.Parameter(torch.zeros(2))
    assert not _compat.zero3_partitioned(plain)
    with _compat.zero3_gathered([plain]) as gathered:  # nothing partitioned: no collective, no deepspeed call
        assert gathered is False


# ------------------------------------------------------------------------------------------- accelerate FSDP2


def test_accelerate_fsdp2_wraps_exactly_the_classes_hf_ddpfix_sets_on_its_plugin():
    """`_compat.fsdp`: the transformer policy of `fsdp2_prepare_model` reads `plugin.transformer_cls_names_to_wrap`
    at prepare time (None -> `_no_split_modules`), an empty list wraps no block, and a class the model lacks
    raises (the failure `fsdp_units` avoids); `fsdp2_prepare_model` calls that policy. (accelerate 1.15 also carves
    the input embedding into a unit of its own, 1.11 does not: either way it is outside every part a rank may
    skip, so the units stay the same on every rank.)"""
    from accelerate.utils import FullyShardedDataParallelPlugin, fsdp_utils

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    assert _compat.fsdp_wrap_policy(plugin) == "transformer_based_wrap", _broken("FSDP plugin's auto_wrap_policy")
    assert _compat.fsdp_wrap_classes(plugin) == (None, False), _broken("transformer_cls_names_to_wrap default")
    model = _tiny_llama()
    _compat.set_fsdp_wrap_classes(plugin, ("LlamaDecoderLayer",))
    policy = fsdp_utils.fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [n for n, m in model.named_modules() if policy(m)]
    assert wrapped == ["model.layers.0", "model.layers.1"], _broken(f"the transformer policy wraps {wrapped}")
    _compat.set_fsdp_wrap_classes(plugin, ())
    none = fsdp_utils.fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert not any(none(m) for m in model.modules()), _broken("an empty class list still wraps blocks")
    plugin.transformer_cls_names_to_wrap = ["CLIPTextEmbeddings"]
    with pytest.raises(ValueError, match="Could not find the transformer layer class"):
        fsdp_utils.fsdp2_prepare_auto_wrap_policy(plugin, model)
    source = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    assert "fsdp2_prepare_auto_wrap_policy" in source, _broken("fsdp2_prepare_model no longer calls the auto-wrap policy")


def test_bitsandbytes_cpu_repack_is_the_switch_we_turn_off():
    """``_compat.disable_cpu_repack``: Linear4bit's forward repacks its weight for evaluation on an AVX512-BF16 CPU
    only while ``support_avx512bf16_for_cpu`` is true (bitsandbytes 0.50.2); turning it off keeps the forward on
    the dequantize path, and the undo puts the module's own value back."""
    import inspect

    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(8, 8, bias=False, quant_type="nf4")
    assert hasattr(layer, "support_avx512bf16_for_cpu"), _broken("Linear4bit.support_avx512bf16_for_cpu is gone")
    source = inspect.getsource(bnb.nn.Linear4bit.forward)
    assert "self.support_avx512bf16_for_cpu" in source and "_convert_weight_packed_for_cpu" in source, _broken(
        "Linear4bit.forward no longer gates its CPU repack on support_avx512bf16_for_cpu")
    model = torch.nn.Sequential(layer)
    layer.support_avx512bf16_for_cpu = 1  # as on an AVX512-BF16 CPU (an int there)
    n, undo = _compat.disable_cpu_repack(model)
    assert n == 1 and layer.support_avx512bf16_for_cpu is False
    undo()
    assert layer.support_avx512bf16_for_cpu == 1
    layer.support_avx512bf16_for_cpu = False  # a CPU without AVX512-BF16: nothing to switch
    assert _compat.disable_cpu_repack(model)[0] == 0


def test_fully_shard_of_a_tied_tensor_needs_one_group_and_join_shared_holders_makes_it():
    """``_compat.join_shared_holders``: torch 2.13 refuses a parameter two FSDP2 groups manage (at the first
    forward) and runs one group of several modules; accelerate 1.15's ``fsdp2_prepare_model`` imports
    ``fully_shard`` from ``torch.distributed.fsdp`` when it runs (so the wrapped attribute is what it calls) and
    keeps only ``[final norm, input embedding, output embedding]`` of a tie together (BART's ``encoder.embed_tokens``
    stays in the root)."""
    import os

    import torch.distributed as dist
    from accelerate.utils import fsdp_utils

    source = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    # 1.15 carves a tied [norm, embedding, head] tail (the group BART's other holders must join); 1.11 leaves them
    # all in the root (nothing to join, the wrap passes every call through)
    assert "from torch.distributed.fsdp import" in source and "fully_shard(" in source, _broken(
        "fsdp2_prepare_model no longer imports fully_shard from torch.distributed.fsdp when it runs")

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.shared, self.enc, self.head = nn.Embedding(8, 4), nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
            self.enc.weight = self.head.weight = self.shared.weight
            self.mid = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.mid(self.enc(x))).sum()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())  # CI runs the stacks side by side: no fixed port
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        fsdp = __import__("torch.distributed.fsdp", fromlist=["fully_shard"])
        mesh = init_device_mesh("cpu", (1,))
        x = torch.tensor([[1, 2, 3]])
        stock = Tied()
        fsdp.fully_shard([stock.shared, stock.head], mesh=mesh)  # accelerate's tied tail
        fsdp.fully_shard(stock, mesh=mesh)
        with pytest.raises(ValueError, match="already managed by another FSDP group"):
            stock(x)
        ref = Tied()
        expect = torch.autograd.grad(ref(x), ref.shared.weight)[0]
        ours = Tied()
        original = fsdp.fully_shard
        with _compat.join_shared_holders(ours) as joined:
            fsdp.fully_shard([ours.shared, ours.head], mesh=mesh)
            fsdp.fully_shard(ours.mid, mesh=mesh)  # no tied tensor: passed through
            fsdp.fully_shard(ours, mesh=mesh)
        assert fsdp.fully_shard is original and joined == [("enc",)], joined
        ours(x).backward()
        assert ours.enc.weight is ours.shared.weight is ours.head.weight, _broken("the tie did not survive")
        assert torch.equal(ours.shared.weight.grad.full_tensor(), expect), _broken("the joined group's gradient")
    finally:
        dist.destroy_process_group()


def test_join_shared_holders_lifts_an_enclosing_holder_and_skips_a_member_already_sharded():
    """BLIP's text head (BERT-style): ``predictions`` holds a ``bias`` tied to its own ``decoder``'s, whose ``weight``
    is the input embedding's, and the embedding sits in a unit of its own (``BlipTextEmbeddings``, a
    ``_no_split_modules`` class). Stock accelerate 1.15 then fails either way (2 processes, 2026-12-02: the tail
    ``[embedding, decoder]`` takes the already-sharded embedding for a tensor-parallel tensor, "Invariant
    encountered"; without that unit, the bias is in the tail and in the root, "already managed by another FSDP
    group"). ``join_shared_holders``: the member already sharded leaves the tail, and ``predictions`` (which holds
    the bias and encloses ``decoder``) takes the decoder's place, so the bias and the weight each live in one group.

    Shown failing (2026-12-02): with ``_co_holders`` as before (no lift, no skip) the wrapped sequence below raises
    "fully_shard has already been applied" (the decoder joined the unit, then the tail shards it again)."""
    import os

    import torch.distributed as dist

    class Embeddings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.word = nn.Embedding(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.word(x)

    class Predictions(nn.Module):
        def __init__(self, word: nn.Embedding) -> None:
            super().__init__()
            self.dense = nn.Linear(4, 4)
            self.decoder = nn.Linear(4, 8)
            self.bias = nn.Parameter(torch.zeros(8))
            self.decoder.weight, self.decoder.bias = word.weight, self.bias

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.decoder(self.dense(h))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embeddings = Embeddings()
            self.mid = nn.Linear(4, 4)
            self.predictions = Predictions(self.embeddings.word)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.predictions(self.mid(self.embeddings(x))) ** 2).sum()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        fsdp = __import__("torch.distributed.fsdp", fromlist=["fully_shard"])
        mesh = init_device_mesh("cpu", (1,))
        x = torch.tensor([[1, 2, 3]])

        def prepare(model: Head) -> None:  # accelerate 1.15's order: the units, the tied tail, the root
            fsdp.fully_shard(model.embeddings, mesh=mesh)
            fsdp.fully_shard([model.embeddings.word, model.predictions.decoder], mesh=mesh)
            fsdp.fully_shard(model, mesh=mesh)

        with pytest.raises(TypeError, match="Invariant encountered"):
            prepare(Head())
        ref = Head()
        expect = torch.autograd.grad(ref(x), [ref.embeddings.word.weight, ref.predictions.bias])
        ours = Head()
        with _compat.join_shared_holders(ours) as joined:
            prepare(ours)
        assert joined == [("predictions",)], joined  # with the unit; the tail's members were both sharded by it
        ours(x).backward()
        assert ours.predictions.decoder.weight is ours.embeddings.word.weight, _broken("the weight tie")
        assert ours.predictions.decoder.bias is ours.predictions.bias, _broken("the bias tie")
        got = [ours.embeddings.word.weight.grad.full_tensor(), ours.predictions.bias.grad.full_tensor()]
        assert all(torch.equal(a, b) for a, b in zip(got, expect, strict=True)), _broken("the gradients")
    finally:
        dist.destroy_process_group()


def test_the_offline_fsdp2_path_reads_what_a_launch_and_torch_do():
    """``_compat.fsdp_plugin_from_launch``, ``fake_process_group``, ``prepare_like_accelerate``, ``fsdp_groups``
    (``hf-ddpfix plan`` and tests/test_fsdp_scale.py): accelerate 1.15's launcher exports ``fsdp_config`` as the
    ``FSDP_*`` variables ``LAUNCH_FSDP_ENV`` names, which the plugin reads; ``fsdp2_prepare_model`` shards a meta
    model under torch's fake process group through a stand-in accelerator; torch 2.13's FSDP2 state exposes its
    parameter groups (sizes, padded shards, ``post_forward_mesh_info``) and keeps the root gathered after forward
    when ``reshard_after_forward`` is left to it (``_auto_reshard_after_forward``, set in the root's lazy init)."""
    from accelerate.utils import launch
    from torch.distributed.fsdp._fully_shard import _fsdp_state

    launcher = inspect.getsource(launch.prepare_multi_gpu_env)
    for var in _compat.fsdp.LAUNCH_FSDP_ENV.values():
        assert f'"{var[len("FSDP_"):]}"' in launcher or f'"{var}"' in launcher, _broken(f"the launcher no longer exports {var}")
    lazy = inspect.getsource(_fsdp_state.FSDPState._lazy_init)
    assert "_auto_reshard_after_forward" in lazy and "post_forward_mesh_info = None" in lazy, _broken(
        "FSDPState._lazy_init no longer keeps the root gathered after forward")
    import os

    before = {k: v for k, v in os.environ.items() if k.startswith(("FSDP_", "ACCELERATE_"))}
    plugin = _compat.fsdp_plugin_from_launch({"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                              "fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                              "fsdp_cpu_ram_efficient_loading": True})
    assert plugin.fsdp_version == 2 and plugin.cpu_ram_efficient_loading is True
    assert _compat.fsdp_wrap_classes(plugin) == (("LlamaDecoderLayer",), False)
    assert {k: v for k, v in os.environ.items() if k.startswith(("FSDP_", "ACCELERATE_"))} == before  # restored
    with torch.device("meta"):
        model = _tiny_llama_meta()
    with _compat.fake_process_group(4, 1):
        _compat.prepare_like_accelerate(model, plugin)
        groups = _compat.fsdp_groups(model)
    assert not torch.distributed.is_initialized()
    import accelerate
    from packaging.version import Version

    if Version(accelerate.__version__) >= Version("1.15"):  # the embedding and [norm, head] carved into units
        sizes, reshard = [1, 9, 9, 2], [True, True, True, False]
    else:  # accelerate 1.11 (oldest stack): they stay in the root (measured: every group reshards)
        sizes, reshard = [3, 9, 9], [True, True, True]
    assert [len(params) for _, params, _ in groups] == sizes, _broken("FSDP2 parameter groups")
    assert [reshards for *_, reshards in groups] == reshard, _broken("reshard_after_forward")
    for _, params, _ in groups:
        for full, local, size, grad in params:
            assert size == 4 and local * 4 >= full and grad is True, _broken("FSDP2 padded shard sizes")


def _tiny_llama_meta():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_prediction_ignore_keys_and_evaluation_loop_options_read_what_the_trainer_reads():
    """`prediction_ignore_keys`' default is the one `Trainer.prediction_step` spells; `evaluation_loop_options`
    binds `evaluation_loop`'s own parameters (hf_ddpfix.integrations.eval_outputs reads both)."""
    import json
    import sys
    from types import SimpleNamespace

    from transformers import Trainer

    from hf_ddpfix._compat import (
        default_prediction_ignore_keys,
        evaluation_loop_options,
        prediction_ignore_keys,
    )
    from hf_ddpfix._compat.trainer import EVALUATION_LOOP_PARAMETERS

    # read from the installed file: a patch_trainer() layer left on by another test hides the class attributes
    module_source = Path(inspect.getsourcefile(sys.modules[Trainer.__module__])).read_text()
    methods = {f.name: f for c in ast.parse(module_source).body if isinstance(c, ast.ClassDef) and c.name == "Trainer"
               for f in c.body if isinstance(f, ast.FunctionDef)}
    assert tuple(a.arg for a in methods["evaluation_loop"].args.args)[1:] == EVALUATION_LOOP_PARAMETERS
    source = ast.get_source_segment(module_source, methods["prediction_step"])
    assert f'"keys_to_ignore_at_inference", {json.dumps(default_prediction_ignore_keys())}' in source
    trainer = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace()), args=SimpleNamespace(
        prediction_loss_only=False))
    assert prediction_ignore_keys(trainer, None) == default_prediction_ignore_keys()
    assert prediction_ignore_keys(trainer, ["x"]) == ["x"]
    trainer.model.config.keys_to_ignore_at_inference = ["y"]
    assert prediction_ignore_keys(trainer, None) == ["y"]
    assert evaluation_loop_options(trainer, ("dl", "Evaluation"), {"prediction_loss_only": None}) == (False, None)
    assert evaluation_loop_options(trainer, ("dl", "Evaluation", True, ["z"]), {}) == (True, ["z"])
    trainer.args.prediction_loss_only = True
    assert evaluation_loop_options(trainer, ("dl", "Prediction"), {"ignore_keys": ["k"]}) == (True, ["k"])
