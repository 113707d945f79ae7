"""Time the native attention kernels of one or more compiled libraries, side by side, in one run.

    python -m engine.kernels.cpu.bench old.so new.so      # each library in its own subprocess, rounds alternate

Why subprocesses: a library built with -ffast-math turns on flush-to-zero for its whole process, which
would change the other library's figures. Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim
64): decode of 64 requests at context 370, extend (prefill) of 8 prompts of 300 tokens. Decode is timed
twice: on one layer's pool called again and again (18 MB in bfloat16: it stays in a large L3), and as a
model step reads it, each of 30 layers' pools once in turn (`decode_*_30_layers`, ms a layer, the fastest of
3 passes: from memory; 30 layers' pools are about 0.6 GB in bfloat16 and 1.2 GB in float32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

H, HKV, D = 9, 3, 64
LAYERS = 30  # SmolLM2-135M's


def _time_library(path: str, repeats: int) -> dict:
    """Fastest of `repeats` calls in milliseconds, per (kernel, dtype); None when the build lacks the kernel."""
    import ctypes

    import torch

    from engine.kernels.cpu.build import bind

    lib = bind(ctypes.CDLL(path))
    threads = torch.get_num_threads()
    scale = D**-0.5
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        bf16 = int(dtype == torch.bfloat16)
        gen = torch.Generator().manual_seed(0)
        n_pool = 64 * 400
        k = torch.randn(n_pool, HKV, D, generator=gen).to(dtype)
        v = torch.randn(n_pool, HKV, D, generator=gen).to(dtype)
        # scattered rows
        table = torch.randperm(n_pool, generator=gen).reshape(64, 400).contiguous()
        # decode: 64 requests, 370 tokens each
        q = torch.randn(64, H, D, generator=gen).to(dtype)
        o = torch.empty_like(q)
        slots = torch.arange(64, dtype=torch.int64)
        lens = torch.full((64,), 370, dtype=torch.int64)

        def decode() -> int:
            return lib.decode_attention(
                q.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                o.data_ptr(),
                table.data_ptr(),
                table.stride(0),
                slots.data_ptr(),
                lens.data_ptr(),
                64,
                H,
                HKV,
                D,
                scale,
                bf16,
                threads,
            )

        layers = [
            (
                torch.randn(n_pool, HKV, D, generator=gen).to(dtype),
                torch.randn(n_pool, HKV, D, generator=gen).to(dtype),
            )
            for _ in range(LAYERS - 1)
        ] + [(k, v)]

        # a step's pass over every layer: each pool out of cache when its turn comes
        def decode_layers() -> int:
            rc = 0
            for lk, lv in layers:
                rc |= lib.decode_attention(
                    q.data_ptr(),
                    lk.data_ptr(),
                    lv.data_ptr(),
                    o.data_ptr(),
                    table.data_ptr(),
                    table.stride(0),
                    slots.data_ptr(),
                    lens.data_ptr(),
                    64,
                    H,
                    HKV,
                    D,
                    scale,
                    bf16,
                    threads,
                )
            return rc

        # extend: 8 prompts of 300 new tokens, no prefix
        ext = torch.full((8,), 300, dtype=torch.int64)
        prefix = torch.zeros(8, dtype=torch.int64)
        q_start = torch.cumsum(ext, 0) - ext
        qe = torch.randn(8 * 300, H, D, generator=gen).to(dtype)
        oe = torch.empty_like(qe)
        eslots = torch.arange(8, dtype=torch.int64)

        def extend() -> int:
            return lib.extend_attention(
                qe.data_ptr(),
                k.data_ptr(),
                v.data_ptr(),
                oe.data_ptr(),
                table.data_ptr(),
                table.stride(0),
                eslots.data_ptr(),
                prefix.data_ptr(),
                ext.data_ptr(),
                q_start.data_ptr(),
                8,
                H,
                HKV,
                D,
                scale,
                bf16,
                threads,
            )

        name = "bf16" if bf16 else "f32"
        for key, fn, calls, per in (
            (f"decode_{name}", decode, repeats, 1),
            (f"extend_{name}", extend, repeats, 1),
            (f"decode_{name}_{LAYERS}_layers", decode_layers, 3, LAYERS),
        ):
            if fn() != 0:  # warm-up, and: does this build have the kernel at all
                out[key] = None
                continue
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) / per)
            out[key] = min(times) * 1e3  # the least disturbed call: 2-core machines are noisy
        layers.clear()  # the pools go before the next dtype's
    return out


def _cpu() -> str:
    from engine.scheduler.device import cpu_has_native_bf16, cpu_model

    try:
        with open("/proc/cpuinfo") as f:
            avx512 = "avx512f" in f.read()
    except OSError:
        avx512 = False
    return f"{cpu_model()}; avx512f: {avx512}; native bfloat16: {cpu_has_native_bf16()}"


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "--one":
        print(json.dumps(_time_library(argv[1], int(argv[2]) if len(argv) > 2 else 30)))
        return
    paths = argv
    if not paths or any(a in ("-h", "--help") for a in paths):
        raise SystemExit(__doc__)
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise SystemExit(f"no such library: {', '.join(missing)}\n{__doc__}")
    # ctypes looks a bare name up on the library path, not here
    paths = [os.path.abspath(p) for p in paths]
    rounds: dict[str, list[dict]] = {p: [] for p in paths}
    for _ in range(5):
        for p in paths:
            res = subprocess.run(
                [sys.executable, "-m", "engine.kernels.cpu.bench", "--one", p],
                capture_output=True,
                text=True,
            )
            if res.returncode != 0:
                raise SystemExit(res.stderr)
            rounds[p].append(json.loads(res.stdout))
    print(f"CPU: {_cpu()}")
    print(
        "ms per call: the fastest of 5 alternating rounds x 30 calls (the 30-layer rows: x 3 passes, per layer), "
        "each library in its own process"
    )
    keys = list(rounds[paths[0]][0])
    print(f"{'kernel':<24}" + "".join(f"{p[-28:]:>30}" for p in paths))
    for key in keys:
        cells = []
        for p in paths:
            values = [r[key] for r in rounds[p] if r[key] is not None]
            cells.append(f"{min(values):>30.3f}" if values else f"{'not in this build':>30}")
        print(f"{key:<24}" + "".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
