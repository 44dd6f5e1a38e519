"""Two single-thread processes doing the same matmuls vs one: how the 2 vCPUs scale."""
import multiprocessing as mp, time, sys
def work(n, q):
    import torch
    torch.set_num_threads(1)
    a = torch.randn(576, 576); b = torch.randn(576, 1536)
    for _ in range(20): a @ b
    t = time.perf_counter()
    for _ in range(n): a @ b
    q.put(n / (time.perf_counter() - t))
if __name__ == "__main__":
    for procs in (1, 2, 1, 2):
        q = mp.Queue(); ps = [mp.Process(target=work, args=(1500, q)) for _ in range(procs)]
        [p.start() for p in ps]; [p.join() for p in ps]
        rates = [q.get() for _ in ps]
        print(procs, "process(es): total matmuls/s", round(sum(rates)), "per process", [round(r) for r in rates])
