# Throwaway probe (2026-12-06): does compute on core 0 slow compute on core 1? Run: python cores_probe.py
# (pins itself to core 1; a child process runs GEMMs pinned to core 0).
import os, sys, time, torch, subprocess
torch.set_num_threads(1)
os.sched_setaffinity(0, {1})
def bench(n, reps):
    a = torch.randn(n, n); b = torch.randn(n, n)
    for _ in range(3): a @ b
    t = time.perf_counter()
    for _ in range(reps): a @ b
    return (time.perf_counter() - t) / reps * 1e3
HOG = "import os, torch; torch.set_num_threads(1); os.sched_setaffinity(0, {0}); a=torch.randn(%d,%d); b=torch.randn(%d,%d)\nwhile True: a @ b"
for hog_n in (256, 1024):
    for n, reps in ((256, 400), (1024, 20), (64, 20000)):
        alone = bench(n, reps)
        hog = subprocess.Popen([sys.executable, "-c", HOG % (hog_n, hog_n, hog_n, hog_n)]); time.sleep(1.0)
        busy = bench(n, reps); hog.kill(); hog.wait(); time.sleep(0.3)
        alone2 = bench(n, reps)
        print(f"core1 GEMM {n}: alone {alone:.3f}/{alone2:.3f} ms, core0 running GEMM {hog_n}: {busy:.3f} ms ({busy/min(alone,alone2):.2f}x)")
