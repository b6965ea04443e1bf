"""Issue 63: the attention of a lattice tree against its same-row chain, the kernels alone (no
model), on the GPU, in bf16 at an attention shape (default the Qwen3-8B's: 32 query heads, 8 KV
heads, head dim 128), and every node of every tree bit for bit against a one-token decode at its
position (its ancestors at the slots of their depths, its own key next).

Trees: the lattice trees of 63 / 127 / 255 nodes in the measured profile's geometry (as
``specpilot bench verify --part trees`` builds them), at block starts 512 + 88 (start's chunk holds
a prefix tile below start's tile) and 640 (start at a chunk boundary). Times: median of CUDA-graph
replays of ``attention`` (all its launches). ``--old FILE``: a second copy of
``specpilot/kernels/step.py`` (e.g. the previous commit's) timed and checked beside it.

Usage: python3 scripts/gpu_tree_attention.py [--heads 32 --kv 8 --dim 128] [--old FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys

import torch


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("specpilot.kernels._old_step", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def graph_ms(fn, iters: int = 50) -> float:
    """Median ms of one CUDA-graph replay of ``fn``."""
    from specpilot.tuning import timing

    g = timing.capture_graph(fn)
    g.replay()
    torch.cuda.synchronize()
    return statistics.median(timing.event_times(g.replay, iters)[0]) * 1e3


def main() -> int:
    from specpilot.bench import _engine as E

    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--max-seq", type=int, default=1024)
    p.add_argument("--old")
    a = p.parse_args()
    from specpilot.kernels import step as new

    mods = {"new": new}
    if a.old:
        mods["old"] = load_old(a.old)
    dev, dt, Hq, Hkv, D, S = "cuda", torch.bfloat16, a.heads, a.kv, a.dim, a.max_seq
    g = torch.Generator(device=dev).manual_seed(0)
    prof = E.lattice_of(E.load_profile("tiny_dflash2_lattice"))
    for n in (63, 127, 255):
        par, _ = E.shape_parents(prof.counts(n))
        T = len(par)
        depth = [0] * T
        for i in range(1, T):
            depth[i] = depth[par[i]] + 1
        _, dep, path = E.tree_inputs(torch.tensor([par], dtype=torch.long, device=dev), 11)
        for st in (600, 640):
            kc = torch.randn(1, Hkv, S, D, device=dev, generator=g).to(dt)
            vc = torch.randn(1, Hkv, S, D, device=dev, generator=g).to(dt)
            q = torch.randn(T, Hq * D, device=dev, generator=g).to(dt)
            start = torch.tensor([st], device=dev)
            line = [f"tree {T} nodes (depth <= {max(depth)}) start {st}:"]
            for name, K in mods.items():
                ws = K.AttnWorkspace(1, T, Hq, Hkv, D, S, dev)
                out = torch.zeros(T, Hq * D, device=dev, dtype=dt)
                ms_tree = graph_ms(lambda: K.attention(q, kc, vc, start, T, Hq, Hkv, D, out, ws, path=path,
                                                       depth=dep))
                wsc = K.AttnWorkspace(1, T, Hq, Hkv, D, S, dev)
                outc = torch.zeros(T, Hq * D, device=dev, dtype=dt)
                ms_chain = graph_ms(lambda: K.attention(q, kc, vc, start, T, Hq, Hkv, D, outc, wsc))
                K.attention(q, kc, vc, start, T, Hq, Hkv, D, out, ws, path=path, depth=dep)
                ws1 = K.AttnWorkspace(1, 1, Hq, Hkv, D, S, dev)
                o1 = torch.zeros(1, Hq * D, device=dev, dtype=dt)
                equal = 0
                for t in range(T):
                    anc, m = [], t
                    while m > 0:
                        m = par[m]
                        anc.append(m)
                    anc = anc[::-1] + [t]
                    k1, v1 = kc.clone(), vc.clone()
                    idx = torch.tensor(anc, device=dev)
                    k1[0, :, st:st + len(anc)] = kc[0, :, st + idx]
                    v1[0, :, st:st + len(anc)] = vc[0, :, st + idx]
                    K.attention(q[t:t + 1].contiguous(), k1, v1, start + depth[t], 1, Hq, Hkv, D, o1, ws1)
                    equal += int(torch.equal(o1[0], out[t]))
                line.append(f"{name}: tree {ms_tree * 1e3:.1f} us, chain {ms_chain * 1e3:.1f} us "
                            f"(+{(ms_tree - ms_chain) * 1e3:.1f} us), nodes bit-equal to decodes {equal}/{T};")
            print(" ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
