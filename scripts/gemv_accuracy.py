"""The GEMV kernel's roundings against eager's, per fold, on one row: for each of plain, RMSNorm,
SiLU·mul (gated) and residual, the kernel's and eager bf16's relative error against the same
formula in fp64 on the same bf16 operands, and their largest difference.

On the H200 the two agree bit for bit at K=64 and within one bf16 unit at K=2048. Under
``TRITON_INTERPRET=1`` the numbers are not comparable: triton 3.x's interpreter rounds bf16
conversions toward zero, not to nearest.

Usage: ``python3 scripts/gemv_accuracy.py [cuda|cpu]`` (cpu needs ``TRITON_INTERPRET=1``)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")

from offgraph_export.kernels.triton_gemv import gemv_launch  # noqa: E402


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gated(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    gate, up = F.linear(x.to(dtype), w.to(dtype)).chunk(2, -1)
    return F.silu(gate) * up


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(device: str) -> None:
    for k, n in ((64, 128), (2048, 2048)):
        torch.manual_seed(0)
        x = torch.randn(1, 1, k).bfloat16().to(device)
        w = (torch.randn(2 * n, k) * 0.1).bfloat16().to(device)
        norm = (1 + 0.1 * torch.randn(k)).bfloat16().to(device)
        res = torch.randn(1, 1, n).bfloat16().to(device)
        w1, x64, w64 = w[:n], x.double(), w[:n].double()
        cases = [
            ("plain", gemv_launch(x, w1), F.linear(x, w1), F.linear(x64, w64)),
            ("norm", gemv_launch(x, w1, norm, 1e-6), F.linear(rms(x, norm), w1), F.linear(rms(x, norm).double(), w64)),
            ("gated", gemv_launch(x, w, gated=True), gated(x, w, torch.bfloat16), gated(x, w, torch.float64)),
            ("residual", gemv_launch(x, w1, residual=res), F.linear(x, w1) + res, F.linear(x64, w64) + res.double()),
        ]
        for name, got, eager, exact in cases:
            print(f"K={k} N={n} {name:9s} kernel {rel(got, exact):.5f} eager {rel(eager, exact):.5f} "
                  f"max|kernel-eager| {(got.float() - eager.float()).abs().max().item():.4g}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")
