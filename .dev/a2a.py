"""gloo's CPU per all_to_all vs world size, and a log2(P)-step (Bruck-like) exchange of the same bytes.
Process CPU (every thread: the caller and gloo's I/O thread) per collective, paced like the exchange's rounds."""
import os, resource, sys, time
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime

def a2a(buf_in, buf_out, P, rank):
    dist.all_to_all_single(buf_out, buf_in)

def bruck(buf_in, buf_out, P, rank, per):
    # log2(P) steps; step k: send to rank+2^k the blocks whose relative index has bit k, recv the same from rank-2^k
    blocks = buf_in.view(P, per).roll(-rank, 0).clone()  # blocks[j] goes to rank+j
    k = 1
    while k < P:
        idx = [j for j in range(P) if j & k]
        send = blocks[idx].contiguous(); recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, (rank + k) % P), dist.P2POp(dist.irecv, recv, (rank - k) % P)]
        for w in dist.batch_isend_irecv(ops): w.wait()
        blocks[idx] = recv
        k <<= 1
    # blocks[j] now came from rank-j
    buf_out.view(P, per).copy_(blocks.flip(0).roll(rank + 1, 0))

def worker(rank, P, port, mode, n, pace, per, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=P)
    src = torch.arange(P * per, dtype=torch.float32) + 1000 * rank
    out = torch.empty_like(src)
    f = a2a if mode == "a2a" else (lambda i, o, P, r: bruck(i, o, P, r, per))
    for _ in range(5):
        f(src, out, P, rank)
    # check correctness: out block j == src of rank j block rank
    exp = torch.cat([torch.arange(P * per, dtype=torch.float32)[rank * per:(rank + 1) * per] + 1000 * j for j in range(P)])
    assert torch.equal(out, exp), (mode, rank)
    dist.barrier()
    c0, t0 = cpu(), time.perf_counter()
    nxt = t0
    for _ in range(n):
        nxt += pace; time.sleep(max(0, nxt - time.perf_counter()))
        f(src, out, P, rank)
    c1 = cpu()
    q.put((rank, (c1 - c0) / n * 1e6))
    dist.barrier(); dist.destroy_process_group()

def run(P, mode, n=150, pace=0.02, per=64):
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ps = [ctx.Process(target=worker, args=(r, P, port, mode, n, pace, per, q)) for r in range(P)]
    for p in ps: p.start()
    res = [q.get(timeout=300) for _ in ps]
    for p in ps: p.join()
    v = sorted(x for _, x in res)
    return v[len(v) // 2]

if __name__ == "__main__":
    sizes = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [2, 4, 8]
    for rep in range(2):
        for P in sizes:
            for mode in ("a2a", "bruck"):
                print(f"P={P} {mode:6s} {run(P, mode):8.1f} us CPU per collective (median rank)", flush=True)
