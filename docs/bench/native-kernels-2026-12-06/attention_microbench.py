import time, torch, torch.nn.functional as F
from torch.utils.cpp_extension import load
torch.set_num_threads(1)

from pdserve.attention import cpu_decode
class M: decode_attention = staticmethod(cpu_decode.load("on"))
mod = M

def best(fn, n=30):
    fn(); b=1e9
    for _ in range(n):
        t=time.perf_counter(); fn(); b=min(b,time.perf_counter()-t)
    return b*1e3
for dtype in (torch.bfloat16, torch.float32):
  for L in (158, 512, 1024):
    B,H,G,D=32,2,4,64; cap=L+64
    g=torch.Generator().manual_seed(0)
    kv=torch.randn(2,B,cap,H*D,generator=g).to(dtype)
    q=torch.randn(B,H,G,D,generator=g).to(dtype)
    lens=torch.randint(L-8,L+1,(B,),generator=g); lens[0]=L
    scale=D**-0.5
    kvv=kv[:,:,:L].view(2,B,L,H,D).transpose(2,3)
    j=torch.arange(L); mask=(j[None,:]<lens[:,None])[:,None,None,:]
    ref=lambda: F.scaled_dot_product_attention(q,kvv[0],kvv[1],attn_mask=mask,scale=scale)
    got=lambda: mod.decode_attention(q,kv,lens,scale)
    r=ref().float(); o=got().float()
    # exact fp64 reference
    qq=q.double(); kk=kvv[0].double(); vv=kvv[1].double()
    s=(qq@kk.transpose(-1,-2))*scale; s=s.masked_fill(~mask,-1e300); e=(s.softmax(-1)@vv)
    print(dtype, L, "sdpa ms %.3f"%best(ref), "native ms %.3f"%best(got), "maxerr native %.2e sdpa %.2e"%((o-e).abs().max(), (r-e).abs().max()))
