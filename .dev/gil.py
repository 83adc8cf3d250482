"""Does a periodic Python thread doing bursts of small torch ops raise a busy worker thread's CPU per iteration?"""
import sys, threading, time
import torch
torch.set_num_threads(1)

def work_unit(x, idx, w):
    # ~ a worker's batch: many small ops and a few larger ones
    for _ in range(40):
        y = x.index_select(0, idx)
        y = y * 2 + 1
    z = torch.mm(w, w)
    return z.sum()

def burst(x, idx, ms):
    t0 = time.thread_time()
    while time.thread_time() - t0 < ms * 1e-3:
        y = x.index_select(0, idx)
        torch.cat([y, y])

def main(mode, period_ms=40.0, burst_ms=1.5, secs=6.0):
    x = torch.randn(10000, 16); idx = torch.randint(0, 10000, (300,)); w = torch.randn(128, 128)
    stop = threading.Event()
    bg_cpu = [0.0]
    def bg():
        t0 = time.thread_time()
        while not stop.is_set():
            time.sleep(period_ms * 1e-3)
            if mode == "torch":
                burst(x, idx, burst_ms)
            elif mode == "spin":  # pure Python holding the GIL
                t = time.thread_time()
                while time.thread_time() - t < burst_ms * 1e-3:
                    pass
        bg_cpu[0] = time.thread_time() - t0
    th = None
    if mode != "none":
        th = threading.Thread(target=bg); th.start()
    for _ in range(50):
        work_unit(x, idx, w)
    n = 0; c0 = time.thread_time(); w0 = time.perf_counter()
    while time.perf_counter() - w0 < secs:
        work_unit(x, idx, w); n += 1
    c1 = time.thread_time(); w1 = time.perf_counter()
    stop.set()
    if th: th.join()
    print(f"{mode:6s} worker {1e6*(c1-c0)/n:8.1f} us CPU/iter  {1e6*(w1-w0)/n:8.1f} us wall/iter  bg {bg_cpu[0]:.3f}s")

if __name__ == "__main__":
    for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        for mode in ("none", "torch", "spin"):
            main(mode)
