"""Issue 54 (1): localise the illegal memory access of `specpilot bench verify --part trees`.

The Qwen3-8B shape cut to LAYERS layers (default 2), bf16 on the GPU; every tree / chain step of
verify_trees.SHAPES built as the benchmark builds it (eager call, CUDA graph), each graph replayed
and synchronised right after its capture, then all replayed again in build order, then eager
calls at each check start. Prints one line per step; the first failure names the step and phase.
Run under `compute-sanitizer --tool memcheck` for the faulting kernel.

Cause found (issue 54): the benchmark kept each graph but not the tree's inputs, which only the
captured closure referenced. KEEP_TREE=0 drops them after the capture as the benchmark did (the
crash expected at the replays after all builds), KEEP_TREE=1 (default) keeps them as it does now."""
import os
import sys

import torch

from specpilot.bench import _engine as E
from specpilot.bench import verify_trees as VT
from specpilot.tuning import timing

layers = int(os.environ.get("LAYERS", "2"))
use_graphs = os.environ.get("GRAPHS", "1") == "1"
keep_tree = os.environ.get("KEEP_TREE", "1") == "1"
dev = torch.device("cuda")
model = E.dry_target("qwen3-8b", layers=layers, dtype=torch.bfloat16).to(dev)
fast = E.fastpath()[0].FastTarget(model, checked_cublas=os.environ.get("CHECKED", "1") == "1")
cap = (0, layers - 1)
starts = [512, 509, 541, 600, 637]
S = max(512, *starts) + 384
model.setup_cache(1, S)
g = torch.Generator(device=dev).manual_seed(1)
for buf in (model.cache.k, model.cache.v):
    buf.normal_(generator=g)
start = torch.full((1,), 512, dtype=torch.long, device=dev)
steps = {}


def sync(label):
    try:
        torch.cuda.synchronize()
        print("ok  ", label, flush=True)
    except Exception as e:  # noqa: BLE001
        print("FAIL", label, type(e).__name__, str(e).splitlines()[0], flush=True)
        sys.exit(1)


for name, B, br, d in [("ar", 1, 0, 0)] + list(VT.SHAPES):
    tree = None
    if br < 0:
        par, spine = E.shape_parents(E.lattice_of(E.load_profile(VT.LATTICE_PROFILE)).counts(d))
        tree = E.tree_inputs(torch.tensor([par], dtype=torch.long, device=dev), B - 1)
        T = len(par)
    elif br:
        par = E.spine_tree_parents(B - 1, br, d)
        tree = E.tree_inputs(torch.tensor([par], dtype=torch.long, device=dev))
        T = len(par)
    else:
        T = B
    shapes = [tuple(t.shape) for t in tree] if tree else None
    tok = torch.randint(0, model.config.vocab_size, (1, T), device=dev)
    c = () if name == "ar" else cap

    def fn(tok=tok, tree=tree, c=c):
        return fast.forward(tok, start, c, tree=tree)[0]

    out = fn()
    sync(f"{name} T={T} tree={shapes} eager")
    gr = None
    if use_graphs:
        gr = timing.capture_graph(fn)
        sync(f"{name} capture")
        gr.replay()
        sync(f"{name} replay right after capture")
    steps[name] = (gr, None if gr else fn, tok, tree if keep_tree else None)  # a graph holds no reference to fn

for name, (gr, fn, tok, _) in steps.items():
    (gr.replay if gr else fn)()
    sync(f"{name} replay after all builds")
for st in starts:
    start.fill_(st)
    for name, (gr, fn, tok, _) in steps.items():
        (gr.replay if gr else fn)()
        sync(f"{name} replay at start {st}")
print("all steps ran")
