"""Does a warm heap keep a recording off fresh pages? The page faults of writing a
recording's worth of tensors (125 MiB in the sizes a 100-token recording of the embedded
model saves) onto a heap warmed for it, by the size of the warmer's pieces (the server's:
the recording's largest tensor's).

It runs where the server runs its recordings: on a second thread, whose allocations come
from a glibc arena of its own. Rounds 0-2 follow one another as under traffic; before
rounds 3-5 the server has gone quiet, freed memory and the warm heap were given back to
the OS (`malloc_trim`) and the heap was warmed again; round 6 is under traffic again. Without a warm
heap every round takes about 32,000 faults. From the repository root:

    .venv/bin/python docs/training-issue24/warm_heap_pieces.py
"""

import subprocess
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine.malloc_tuning as malloc_tuning  # noqa: E402

# the sizes (float32 elements) of the tensors a recorded layer of the embedded model saves
# at 100 tokens (hidden 576, K/V 192, MLP 1536, 9 heads), in order: the norm's input and
# scale, Q/K/V's input, RoPE's tables, the attention's (positions, mask, K, Q, V, log-sum-exp,
# output), the output projection's input, the second norm's, the MLP's (gate, SiLU, up, down)
RECORDING_SIZES = (57600, 100, 57600, 12800, 12800, 200, 10000, 19200, 57600, 19200, 900, 57600,
                   57600, 57600, 100, 57600, 153600, 153600, 153600, 153600)
LAYERS = 30


def rounds(piece_bytes: int, results: list) -> None:
    """piece_bytes: the warmer's pieces; 0: its own choice (the largest tensor's size)."""
    warmer = malloc_tuning.HeapWarmer()
    warmer.fit([size * 4 for _ in range(LAYERS) for size in RECORDING_SIZES])
    if piece_bytes:
        warmer.piece_bytes = piece_bytes
    for index in range(7):
        if index in (3, 4, 5):  # a quiet period: freed memory given back, the warm heap too
            warmer.release()
            malloc_tuning.return_freed_memory()
        while warmer.grow():  # warmed again
            pass
        warmer.release()  # a recording is admitted
        before = malloc_tuning.minor_page_faults()
        recording = [torch.empty(size).fill_(1.0) for _ in range(LAYERS) for size in RECORDING_SIZES]
        results.append(malloc_tuning.minor_page_faults() - before)
        del recording  # trained and freed


def one_piece_size(piece: int) -> None:
    """In a fresh process per piece size: the heap starts as the server's does."""
    if not malloc_tuning.keep_freed_memory():
        sys.exit("not glibc")
    results: list = []
    thread = threading.Thread(target=rounds, args=(piece, results))
    thread.start()
    thread.join()
    name = f"{piece >> 20} MiB" if piece >= 1 << 20 else f"{piece >> 10} KiB"
    name = name if piece else "the largest tensor's (600 KiB)"
    print(f"| {name} | {', '.join(f'{f:,}' for f in results[:3])} | "
          f"{', '.join(f'{f:,}' for f in results[3:6])} | {results[6]:,} |", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        return one_piece_size(int(sys.argv[1]))
    total = LAYERS * sum(RECORDING_SIZES) * 4
    print(f"each round writes {total / 2**20:.0f} MiB ({total // 4096:,} pages)")
    print("| piece | rounds 0-2 (traffic) | rounds 3-5 (after a trim) | round 6 |")
    print("| --- | --- | --- | --- |", flush=True)
    for piece in (16 << 20, 2 << 20, 640 << 10, 64 << 10, 0):
        subprocess.run([sys.executable, __file__, str(piece)], check=True)


if __name__ == "__main__":
    main()
