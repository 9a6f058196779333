import asyncio, os, socket, time, statistics, sys
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
pid = os.fork()
if pid == 0:
    a.close()
    async def serve():
        r, w = await asyncio.open_unix_connection(sock=b)
        while True:
            m = await r.readexactly(40)
            w.write(m)
    try: asyncio.run(serve())
    except Exception: os._exit(0)
b.close()
async def cli():
    r, w = await asyncio.open_unix_connection(sock=a)
    rts, sends = [], []
    for i in range(5000):
        t0 = time.perf_counter(); w.write(b"x"*40); t1 = time.perf_counter(); await r.readexactly(40); t2 = time.perf_counter()
        if i > 100: rts.append((t2-t0)*1e6); sends.append((t1-t0)*1e6)
    print(f"asyncio: write median {statistics.median(sends):.1f} us  round trip median {statistics.median(rts):.1f} us p90 {sorted(rts)[int(len(rts)*.9)]:.1f}")
    w.close()
asyncio.run(cli())
os.kill(pid, 9)
