import torch
from tpsim.layers.sinks import sink_attention, sink_attention_flex, flex_applies
g = torch.Generator().manual_seed(0)
for T, H, Hkv, d, w in ((256, 8, 2, 64, 7), (128, 16, 8, 64, None)):
    q, k, v = (torch.randn(T, h, d, generator=g).to(torch.bfloat16).cuda() for h in (H, Hkv, Hkv))
    s = (torch.randn(H, generator=g) * 2).cuda()
    a, b = sink_attention_flex(q, k, v, s, w), sink_attention(q, k, v, s, w)
    print(T, H, Hkv, d, w, flex_applies(q, k, None), "flex vs ref", float((a.float() - b.float()).norm() / b.float().norm()), flush=True)
