"""One buffer order on every rank (hf_ddpfix.ops.buffer_order): DDP copies rank 0's buffers by position.

Single-process: the reorder itself (order, values, persistence, state_dict keys), the cross-rank comparison
with layouts as another rank would send them, and the runtime's call. The 2-process launch reproduces the
silently wrong training of stock DDP (a rank with the rotary tables registered in another order, as
transformers 5.0-5.15 do depending on the hash seed) and shows the guard makes both ranks match a
single-process reference exactly.
"""

import logging
import re

import pytest
import torch
from launch import torchrun
from torch import nn

from hf_ddpfix.config.options import DDPFixConfig
from hf_ddpfix.ops.buffer_order import (
    BufferLayoutError,
    align_buffer_order,
    buffer_layout,
    modules_to_reorder,
    sort_buffers,
)
from hf_ddpfix.plan import RunFacts
from hf_ddpfix.plan.resolve import resolve_plan


class Tables(nn.Module):
    def __init__(self, reverse: bool = False):
        super().__init__()
        regs = [("zeta", torch.full((3,), 1.0), False), ("alpha", torch.full((3,), 2.0), True),
                ("mid", None, True), ("beta", torch.full((3,), 3.0), False)]
        for name, t, persistent in reversed(regs) if reverse else regs:
            self.register_buffer(name, t, persistent=persistent)
        self.proj = nn.Linear(3, 3)
        self.proj.register_buffer("scale", torch.ones(3))


def test_sort_buffers_keeps_values_names_and_persistence():
    m = Tables()
    keys_before = set(m.state_dict())
    assert [n for n, _ in m.named_buffers()] == ["zeta", "alpha", "beta", "proj.scale"]
    sort_buffers(m, [""])
    assert [n for n, _ in m.named_buffers()] == ["alpha", "beta", "zeta", "proj.scale"]
    assert [m.zeta[0].item(), m.alpha[0].item(), m.beta[0].item()] == [1.0, 2.0, 3.0] and m.mid is None
    assert set(m.state_dict()) == keys_before == {"alpha", "proj.scale", "proj.weight", "proj.bias"}
    assert "zeta" not in m.state_dict() and "beta" not in m.state_dict()  # non-persistent stays so
    m.load_state_dict(Tables(reverse=True).state_dict())  # still loads by name
    assert buffer_layout(m) == [("", ("alpha", "beta", "zeta")), ("proj", ("scale",))]


def test_layouts_compared_across_ranks():
    a, b = buffer_layout(Tables()), buffer_layout(Tables(reverse=True))
    assert modules_to_reorder([a, a]) == []
    assert modules_to_reorder([a, b]) == [""]  # proj's single buffer agrees
    renamed = [("", ("zeta", "alpha", "gamma")), a[1]]
    with pytest.raises(BufferLayoutError, match=r"module '<model>' has buffers \['alpha', 'beta', 'zeta'\]"):
        modules_to_reorder([a, renamed])
    with pytest.raises(BufferLayoutError, match="different modules"):
        modules_to_reorder([a, a[:1]])


def test_align_reorders_only_the_disagreeing_modules_on_every_rank():
    rank0, rank1 = Tables(), Tables(reverse=True)
    layouts = [buffer_layout(rank0), buffer_layout(rank1)]
    fixes = [align_buffer_order(m, gather=lambda _: layouts) for m in (rank0, rank1)]
    assert fixes[0].modules == fixes[1].modules == ("",)
    assert buffer_layout(rank0) == buffer_layout(rank1) == [("", ("alpha", "beta", "zeta")), ("proj", ("scale",))]
    assert "rank 1: ['beta', 'alpha', 'zeta']" in fixes[1].describe() and "by position" in fixes[1].describe()
    same = Tables()
    assert not align_buffer_order(same, gather=lambda lay: [lay, lay])
    assert [n for n, _ in same.named_buffers()][:3] == ["zeta", "alpha", "beta"]  # agreeing ranks: untouched
    assert not align_buffer_order(Tables())  # no process group: nothing gathered, nothing changed


class _Rank0:
    def is_world_process_zero(self):
        return True


def test_runtime_aligns_under_ddp_only_and_logs_once(caplog):
    from hf_ddpfix.runtime.attach import _align_buffer_order

    other = buffer_layout(Tables(reverse=True))
    ddp = resolve_plan(RunFacts(parallel="ddp", world_size=2), DDPFixConfig())
    single = resolve_plan(RunFacts(), DDPFixConfig())
    m = Tables()
    _align_buffer_order(_Rank0(), m, single, gather=lambda lay: [lay, other])
    assert [n for n, _ in m.named_buffers()][0] == "zeta"
    with caplog.at_level(logging.INFO, logger="hf_ddpfix"):
        _align_buffer_order(_Rank0(), m, ddp, gather=lambda lay: [lay, other])
    assert [n for n, _ in m.named_buffers()][0] == "alpha"
    assert len([r for r in caplog.records if "buffer_order:" in r.getMessage()]) == 1
    renamed = [("", ("alpha", "beta", "other")), ("proj", ("scale",))]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_ddpfix"):  # names differ: a warning, stock behaviour
        _align_buffer_order(_Rank0(), m, ddp, gather=lambda lay: [lay, renamed])
    assert [n for n, _ in m.named_buffers()][:3] == ["alpha", "beta", "zeta"]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "left as stock" in r.getMessage()]
    assert len(warned) == 1 and "'<model>'" in warned[0].getMessage()


@pytest.mark.multiprocess
def test_rank_with_other_buffer_order_trains_wrong_under_stock_ddp_and_right_with_the_guard():
    """Gemma 3 rotary tables registered in reversed order on rank 1 (what transformers 5.0-5.15 do in about
    half of the launches): stock DDP gives rank 1 another loss and both ranks other weights than the
    single-process reference; aligned first, both ranks match it exactly; other buffer names raise on both."""
    out = torchrun("buffer_order_ddp.py", timeout=120).stdout
    stock = dict(re.findall(r"STOCK rank=(\d) (exact|wrong)$", out, re.M))
    assert stock == {"0": "wrong", "1": "wrong"}, out[-3000:]
    assert sorted(re.findall(r"GUARDED rank=(\d) exact$", out, re.M)) == ["0", "1"], out[-3000:]
    assert sorted(re.findall(r"RAISED rank=(\d) BufferLayoutError$", out, re.M)) == ["0", "1"], out[-3000:]
    assert re.search(r"REORDERED rank=1 model\.rotary_emb$", out, re.M), out[-3000:]
