import os, socket, time, statistics, sys
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
pid = os.fork()
if pid == 0:
    a.close()
    while True:
        m = b.recv(64)
        if not m: os._exit(0)
        b.send(m)
b.close()
sends, rts = [], []
for i in range(5000):
    t0 = time.perf_counter(); a.send(b"x" * 40); t1 = time.perf_counter(); a.recv(64); t2 = time.perf_counter()
    if i > 100: sends.append((t1-t0)*1e6); rts.append((t2-t0)*1e6)
print(f"send median {statistics.median(sends):.1f} us  round trip median {statistics.median(rts):.1f} us  p90 {sorted(rts)[int(len(rts)*.9)]:.1f}")
a.close(); os.wait()
