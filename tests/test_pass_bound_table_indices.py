"""``bound_table_indices``: the recorded bound of an input that indexes an embedding, the clamp it
inserts in the graph, and that a second run on the same program records the same bound without a
second clamp (the pipeline may run on a program a caller reuses)."""

from __future__ import annotations

import torch
from torch import nn

from offgraph_export.passes.bound_table_indices import bound_table_indices

_aten = torch.ops.aten


class _Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(64, 8)

    def forward(self, ids, scale):
        return self.table(ids.view(-1)) * scale


def _clamps(ep) -> list:
    return [n for n in ep.graph.nodes if n.op == "call_function" and n.target == _aten.clamp.default]


def test_the_bound_is_recorded_the_lookup_clamped_and_a_second_run_changes_nothing():
    args = (torch.tensor([[3, 63, 0]]), torch.tensor(2.0))
    ep = torch.export.export(_Lookup(), args)
    first = bound_table_indices(ep)
    assert first.modified and first.produced == {0: 64}
    (clamp,) = _clamps(ep)
    assert clamp.args[1:] == (0, 63)
    out_of_range = (torch.tensor([[70, -5, 1]]), torch.tensor(1.0))
    table = dict(ep.named_parameters())["table.weight"]
    torch.testing.assert_close(ep.module()(*out_of_range), table[[63, 0, 1]])  # clamped into the table
    second = bound_table_indices(ep)
    assert not second.modified and second.produced == {0: 64} and len(_clamps(ep)) == 1


def test_a_program_without_lookups_is_left_alone():
    ep = torch.export.export(nn.Linear(4, 4), (torch.randn(2, 4),))
    result = bound_table_indices(ep)
    assert not result.modified and result.produced == {}
