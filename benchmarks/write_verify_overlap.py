"""Can the write overlap the proof's forwards? torch.save of a GPT-2 124M (fsynced) in a thread while the main
thread runs eager forwards, against the two one after the other (issue 32: "overlap reading, rewriting, verifying
and writing on both cores").

    python benchmarks/write_verify_overlap.py [--rounds 4] [--forwards 6] [--seq 16]

Each round: the forwards alone, the save alone, then both at once (the save in a thread). If torch.save released
the GIL and left the cores free, "both" would approach max(forwards, save); it approaching their sum means the
write cannot hide behind the proof.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import torch


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--forwards", type=int, default=6)
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    x = torch.randint(0, 50000, (2, args.seq))
    path = os.path.join(tempfile.mkdtemp(), "m.pt")

    def forwards() -> None:
        with torch.no_grad():
            for _ in range(args.forwards):
                model(x)

    def save() -> None:
        torch.save(model, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def both() -> None:
        th = threading.Thread(target=save)
        th.start()
        forwards()
        th.join()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    print("| round | forwards s | save s | sum s | overlapped s |")
    print("|---|---|---|---|---|")
    for r in range(args.rounds):
        a, b, c = timed(forwards), timed(save), timed(both)
        print(f"| {r} | {a:.2f} | {b:.2f} | {a + b:.2f} | {c:.2f} |")


if __name__ == "__main__":
    main()
