"""The width pass finds the input and dim that carry the step's token count."""

import pytest
import torch

from offgraph_export.errors import ExportError
from offgraph_export.passes.record_step_width import record_step_width
from offgraph_export.specs import StepWidthSpec
from tests import tiny_models as tm


def test_tokens_input_gives_0_1():
    ep = tm.export(tm.TokensModel(), (torch.randint(0, 64, (1, 5)), torch.arange(5)), (1, 0))
    assert record_step_width(ep).produced == StepWidthSpec(input_index=0, dim=1)


def test_embeddings_input_gives_0_1():
    ep = tm.export(tm.Stack(2), (torch.randn(1, 5, 32), torch.arange(5)), (1, 0))
    assert record_step_width(ep).produced.format() == "0:1"


def test_positions_only_gives_1_0():
    ep = tm.export(tm.PositionsOnly(), (torch.randn(1, 32), torch.arange(5)), (None, 0))
    assert record_step_width(ep).produced.format() == "1:0"


def test_width_in_dim_2():
    ep = tm.export(tm.ChannelsFirst(), (torch.randn(1, 32, 5), torch.arange(5)), (2, 0))
    assert record_step_width(ep).produced.format() == "0:2"


def test_layers_writing_different_widths_rejected_naming_nodes():
    ep = tm.export(tm.UnevenWidths(), (torch.randn(1, 5, 32), torch.arange(5)), (1, 0))
    with pytest.raises(ExportError, match="different token widths") as info:
        record_step_width(ep)
    assert "update_and_attend" in str(info.value)


def test_no_input_carries_the_width_rejected():
    ep = tm.export(tm.DoubledWidth(), (torch.randn(1, 5, 32), torch.arange(5)), (1, 0))
    with pytest.raises(ExportError, match="no model input carries the token width"):
        record_step_width(ep)


def test_static_width_rejected():
    ep = torch.export.export(tm.Stack(1), (torch.randn(1, 5, 32), torch.arange(5)))
    with pytest.raises(ExportError, match="constant 5"):
        record_step_width(ep)


def test_graph_without_kv_op_rejected():
    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(ExportError, match="no KV op"):
        record_step_width(ep)
