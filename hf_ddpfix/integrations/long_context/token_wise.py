"""Which modules are token-wise (output row ``i`` depends only on input row ``i``), by structure.

A module is tiled only when this module can show it is token-wise: its ``forward`` source, reduced to
a canonical form over its child modules, matches a known template (gated MLP, fc1-act-fc2), every
child it calls is a Linear-like layer (LoRA included) or a parameter-free elementwise activation, or
its class was declared with :func:`register_token_wise`. Anything else is reported with the reason and
left alone.

Reads model ``forward`` source text through :func:`hf_ddpfix._compat.forward_source`.
"""

from __future__ import annotations

import ast

from torch import nn

from ..._compat import forward_source

__all__ = ["intermediate_size", "is_token_wise", "register_token_wise"]


# Canonical forms of forwards known to be token-wise, over child modules called on the single input.
_TEMPLATES: dict[frozenset[str], set[str]] = {
    frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"}): {
        "down_proj((act_fn(gate_proj(X))*up_proj(X)))",
        "down_proj((up_proj(X)*act_fn(gate_proj(X))))",
    },
    frozenset({"fc1", "fc2", "act"}): {"fc2(act(fc1(X)))"},
}
_TEMPLATE_KEYS = {  # child name -> role (Linear-like or parameter-free activation)
    "gate_proj": "linear", "up_proj": "linear", "down_proj": "linear", "fc1": "linear", "fc2": "linear",
    "act_fn": "act", "act": "act",
}
_REGISTERED: dict[type, str] = {}
_FORWARD_CACHE: dict[type, str | None] = {}


def register_token_wise(cls: type[nn.Module], intermediate_attr: str = "") -> None:
    """Declare ``cls`` token-wise (its forward maps each token independently) so ``apply_tiled_mlp``
    tiles it even though its forward does not match a built-in template.

    Args:
        cls: the module class.
        intermediate_attr: optional dotted path of a Linear whose ``out_features`` is the intermediate
            size (used by the ``"target"`` shard rule), e.g. ``"fc1"``.
    """
    _REGISTERED[cls] = intermediate_attr


class _NotTemplate(Exception):
    pass


def _canon(node: ast.AST, env: dict[str, str], arg: str) -> str:
    if isinstance(node, ast.Name):
        if node.id == arg:
            return "X"
        if node.id in env:
            return env[node.id]
        raise _NotTemplate(f"free name {node.id!r}")
    if isinstance(node, ast.Call) and not node.keywords and len(node.args) == 1:
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
            return f"{f.attr}({_canon(node.args[0], env, arg)})"
        raise _NotTemplate("call of something other than a child module")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return f"({_canon(node.left, env, arg)}*{_canon(node.right, env, arg)})"
    raise _NotTemplate(f"unsupported expression {type(node).__name__}")


def _forward_form(cls: type) -> str | None:
    """Canonical form of ``cls.forward`` (or None when it is not a simple child-call expression)."""
    if cls in _FORWARD_CACHE:
        return _FORWARD_CACHE[cls]
    form: str | None = None
    try:
        src = forward_source(cls)
        fdef = ast.parse(src).body[0]
        assert isinstance(fdef, ast.FunctionDef)
        args = fdef.args
        if len(args.args) == 2 and not (args.vararg or args.kwarg or args.kwonlyargs):
            arg = args.args[1].arg
            env: dict[str, str] = {}
            for stmt in fdef.body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    continue  # docstring
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                    env[stmt.targets[0].id] = _canon(stmt.value, env, arg)
                    continue
                if isinstance(stmt, ast.Return) and stmt.value is not None:
                    form = _canon(stmt.value, env, arg)
                break
    except (OSError, TypeError, SyntaxError, AssertionError, _NotTemplate, IndexError):
        form = None
    _FORWARD_CACHE[cls] = form
    return form


def _is_linear_like(m: nn.Module) -> bool:
    if isinstance(m, nn.Linear):
        return True
    base = getattr(m, "get_base_layer", None)  # peft LoRA / DoRA wrapped Linear
    return callable(base) and isinstance(base(), nn.Linear)


_NOT_ELEMENTWISE = {"Softmax", "Softmin", "LogSoftmax", "Softmax2d", "MultiheadAttention"}


def _is_elementwise(m: nn.Module) -> bool:
    """Parameter-free activations from torch.nn / transformers.activations, Dropout, Identity."""
    if isinstance(m, (nn.Dropout, nn.Identity)):
        return True
    mod = type(m).__module__
    from_lib = mod == "torch.nn.modules.activation" or mod.startswith("transformers.activations")
    return from_lib and type(m).__name__ not in _NOT_ELEMENTWISE and not any(True for _ in m.parameters())


def is_token_wise(module: nn.Module) -> tuple[bool, str]:
    """Whether ``module`` can be shown token-wise, with the reason.

    Shown when the class was registered with ``register_token_wise``; for an ``nn.Sequential`` of
    Linear layers (peft-wrapped allowed) and element-wise activations; or when (a) its children are
    exactly one of the known sets (``gate_proj/up_proj/down_proj/act_fn`` or ``fc1/fc2/act``), the
    projections Linear (peft-wrapped allowed) and the activation element-wise, and (b) the source of
    its class ``forward`` parses to the matching template (``down(act(gate(x)) * up(x))`` or
    ``fc2(act(fc1(x)))``).

    Guarantees: never True for a module whose forward mixes tokens unless the user registered it.
    """
    cls = type(module)
    if cls in _REGISTERED:
        return True, f"{cls.__name__} registered with register_token_wise"
    children = dict(module.named_children())
    if type(module) is nn.Sequential:
        bad = [n for n, c in children.items() if not (_is_linear_like(c) or _is_elementwise(c))]
        if children and not bad:
            return True, "Sequential of Linear layers and element-wise activations"
        return False, f"Sequential: children {bad or '[]'} are not Linear layers or element-wise activations"
    key = frozenset(children)
    if key not in _TEMPLATES:
        return False, (
            f"{cls.__name__}: children {sorted(children)} are not a known token-wise MLP structure "
            "(gate_proj/up_proj/down_proj/act_fn or fc1/fc2/act); register_token_wise() it if it is token-wise"
        )
    for name, child in children.items():
        role = _TEMPLATE_KEYS[name]
        if role == "linear" and not _is_linear_like(child):
            return False, f"{cls.__name__}.{name} is {type(child).__name__}, not a Linear (or peft-wrapped Linear)"
        if role == "act" and not _is_elementwise(child):
            return False, f"{cls.__name__}.{name} is {type(child).__name__}, not a known element-wise activation"
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        return False, f"{cls.__name__} owns parameters/buffers outside its projections"
    form = _forward_form(cls)
    if form is None or form not in _TEMPLATES[key]:
        return False, (
            f"{cls.__name__}.forward does not match a token-wise template (got {form!r}); "
            "register_token_wise() it if it is token-wise"
        )
    return True, f"{cls.__name__}: forward is {form}"


def intermediate_size(module: nn.Module) -> int:
    attr = _REGISTERED.get(type(module), "")
    first = [n for n, c in module.named_children() if _is_linear_like(c)][:1] if isinstance(module, nn.Sequential) else []
    for name in ([attr] if attr else []) + first + ["gate_proj", "fc1", "up_proj"]:
        try:
            m = module.get_submodule(name)
        except AttributeError:
            continue
        base = m.get_base_layer() if hasattr(m, "get_base_layer") else m
        if isinstance(base, nn.Linear):
            return int(base.out_features)
    return 0
