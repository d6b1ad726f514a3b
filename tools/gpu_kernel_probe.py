"""Probe the CUDA flash / memory-efficient attention ops' calling conventions (run on a GPU)."""

import torch

aten = torch.ops.aten
q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.125)
print("flash rest:", [(type(r).__name__, getattr(r, "dtype", None), getattr(r, "shape", r)) for r in res[2:]])
g = torch.randn_like(q)
out, lse, cq, ck, mq, mk, rng, unused, _ = res
for label, args in (("rest", (cq, ck, mq, mk, rng, unused)),):
    try:
        r = aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, rng, unused, scale=0.125
        )
        print("flash bwd", label, "ok", r[0].shape)
    except Exception as e:
        print("flash bwd", label, "FAIL", e)
qf, kf, vf = (t.float() for t in (q, k, v))
o, lse, s, off = aten._scaled_dot_product_efficient_attention(qf, kf, vf, None, True, 0.0, True, scale=0.125)
print("eff lse", lse.shape, "seed", s.dtype, s.shape, "off", off.dtype, off.shape)
for bias in (None, torch.zeros(2, 4, 128, 128, device="cuda")):
    try:
        r = aten._scaled_dot_product_efficient_attention_backward(
            g.float(), qf, kf, vf, bias, o, lse, s, off, 0.0, [True, True, True, False], True, scale=0.125
        )
        print("eff bwd bias", None if bias is None else "zeros", "ok")
    except Exception as e:
        print("eff bwd bias", None if bias is None else "zeros", "FAIL", e)
