"""bench-50m's four projection shapes at 32 rows, float32, one thread, best of 20: F.linear,
MKL's packed sgemm (pdserve's default float32 packing) and oneDNN's prepacked linear, with
oneDNN's largest difference from F.linear. Run: .venv/bin/python <this file>
"""
import torch, time, torch.nn.functional as F
torch.set_num_threads(1)
def best(f, n=20):
    f(); b=1e9
    for _ in range(n):
        t=time.perf_counter(); f(); b=min(b,time.perf_counter()-t)
    return b*1e3
for (o,i) in [(768,512),(512,512),(5632,512),(512,2816)]:
    w=torch.randn(o,i); x=torch.randn(32,i)
    mkl=torch.ops.mkl._mkl_reorder_linear_weight(w,32)
    try:
        dn=torch.ops.mkldnn._reorder_linear_weight(w,32)
        fdn=lambda: torch.ops.mkldnn._linear_pointwise(x,dn,None,"none",[],"")
        ref=F.linear(x,w); err=(fdn()-ref).abs().max().item()
    except Exception as e:
        fdn=None; err=str(e)[:80]
    r=[best(lambda: F.linear(x,w)), best(lambda: torch.ops.mkl._mkl_linear(x,mkl,w,None,32))]
    r.append(best(fdn) if fdn else float('nan'))
    print((o,i), "F.linear %.3f  mkl packed %.3f  onednn packed %.3f ms  onednn err %s" % (*r, err))
