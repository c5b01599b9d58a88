"""AOTInductor's C shim per torch version: an op the shim lacks is refused before compiling
(torch 2.11's CUDA shim has no ``_grouped_mm``, which transformers' mixture-of-experts layers call;
the AOTI C++ wrapper then fails to compile after minutes)."""

from __future__ import annotations

import pytest
import torch

from offgraph_export.compat import aoti_shim_lacks
from offgraph_export.errors import ExportError
from offgraph_export.lowering import aoti


def test_the_shim_header_is_read():
    # every torch this runs on declares these for cuda (2.13 also _grouped_mm, 2.11 not)
    assert aoti_shim_lacks("cuda", ["convolution", "_no_such_op", "_scaled_dot_product_flash_attention"]) == ["_no_such_op"]
    if torch.__version__ >= "2.13":
        assert aoti_shim_lacks("cuda", ["_grouped_mm"]) == []
    assert aoti_shim_lacks("no_such_device", ["_grouped_mm"]) == []  # no header: nothing known


class _Experts(torch.nn.Module):
    def forward(self, x, w, offs):
        return torch._grouped_mm(x, w, offs=offs)


def _grouped_program():
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    w = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    return torch.export.export(_Experts(), (x, w, offs))


def test_a_program_calling_an_op_the_shim_lacks_is_refused_by_name(monkeypatch):
    ep = _grouped_program()
    if torch.__version__ >= "2.13":  # declared there: nothing refused
        aoti._refuse_unshimmed_ops({"model": ep}, "cuda")
    # as on torch 2.11, whose CUDA shim lacks it (the header read is the rule under test above)
    monkeypatch.setattr(aoti, "aoti_shim_lacks", lambda device, names: [n for n in names if n == "_grouped_mm"])
    with pytest.raises(ExportError) as info:
        aoti._refuse_unshimmed_ops({"model": ep}, "cuda")
    message = str(info.value)
    assert "aten._grouped_mm" in message and "set_experts_implementation('batched_mm')" in message
    assert "\n" not in message
