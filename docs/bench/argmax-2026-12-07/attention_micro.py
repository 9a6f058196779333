import time, torch
from pdserve.attention import cpu_decode
torch.set_num_threads(1)
m = cpu_decode.module("on")
def best(f, n=50):
    b=1e9
    for i in range(n):
        t=time.perf_counter(); f(); b=min(b, time.perf_counter()-t)
    return b
g = torch.Generator().manual_seed(0)
for (H, G, L) in ((2, 4, 150), (3, 3, 150), (3, 3, 512), (1, 1, 150), (8, 1, 150)):
    B, D = 32, 64
    for dt in (torch.bfloat16, torch.float32):
        q = torch.randn(B, H, G, D, generator=g).to(dt)
        kv = torch.randn(2, B, L + 16, H * D, generator=g).to(dt)
        lens = torch.full((B,), L, dtype=torch.long)
        t = best(lambda: m.decode_attention(q, kv, lens, 0.125))
        print(f"H={H} G={G} L={L} {str(dt)[6:]:9s} {t*1e3:7.3f} ms  {t/(B*H*L)*1e9:6.2f} ns/key/head  {t/(B*H*L*G)*1e9:6.2f} ns/key/qhead")
