"""``specpilot bench cpu-step``: the CPU step paths of a deployment, timed interleaved in one process.

On a built deployment (``--deployment``, default ``resources/deployments/tiny``: its target and
``--drafter``) with one of its drafter's blocks of context (``--context`` committed positions):

- the target's verify at the stock width (``--block`` in the drafter's counting, default its
  trained block) and its one-token decode: the plain forward, the fused CPU step with each matmul
  kernel (:mod:`specpilot.fastpath.cpu_target`, :mod:`specpilot.fastpath.cpu_linear`), and with
  ``--compile`` torch.compile (inductor, ``dynamic=None``, ``fullgraph``) of the fused aten step,
  compile time included in the result;
- the drafter's draft and its context injection: plain and fused with each matmul kernel.

Times are medians of ``--rounds`` alternating rounds of ``--calls`` back-to-back calls (the
kernel sub-agent's :func:`specpilot.agent.kernel_cpu.interleaved_ms`), so drift on a shared
machine hits every candidate alike; ``--threads`` sets torch's threads. Each row's max |logit|
difference against the plain forward is reported too. ``--dry-run``: the quick recipe's shapes on
random weights, one round, measures nothing.

Measured on the embedded tiny deployment (AMD EPYC, 2 cores shared with other work, 1 thread,
2026-12-05): the fused step 1.3x the plain verify and oneDNN's prepacked matmuls about 2x aten's
for 8-20 rows; torch.compile of the fused step no faster than the fused eager step (1.86 against
1.81 ms warm) at 27-36 s of compile per graph, which is why it is not a candidate of the kernel
sub-agent.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..agent.kernel_cpu import drafter_steps, interleaved_ms
from ..deployment import Deployment, load_deployment
from ..engine.proposers import make_proposer
from ..engine.runner import TargetRunner
from ..fastpath.cpu_linear import onednn_problem
from ..fastpath.cpu_target import FusedTarget
from ..models.config import TargetConfig
from ..models.dflash import DrafterConfig
from ..models.random_checkpoint import materialize_drafter, materialize_target
from ._common import Run, add_common


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "cpu-step")
    p.add_argument("--deployment", default="resources/deployments/tiny", help="a built deployment folder")
    p.add_argument("--drafter", default="dflash", help="its drafter (drafter-NAME)")
    p.add_argument("--block", type=int, help="block in the drafter's counting (default its trained block)")
    p.add_argument("--context", type=int, default=200, help="committed positions before the step")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="also torch.compile the fused aten step (slow to compile)")


def _deployment(args):
    if args.dry_run:
        tc = TargetConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32)
        dc = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32, vocab_size=512, target_layer_ids=[1, 2],
                           mask_token_id=3, block_size=8)
        return Deployment.of(materialize_target(tc, dtype=torch.float32), materialize_drafter(dc, dtype=torch.float32))
    d = Path(args.deployment)
    return load_deployment(d / "target", d / f"drafter-{args.drafter}", torch.device("cpu"), torch.float32)


def measure(args) -> dict:
    """Every path's median times [ms] (see the module docstring), its logit difference and compile time."""
    torch.set_num_threads(1 if args.dry_run else args.threads)
    rounds, calls = (1, 1) if args.dry_run else (args.rounds, args.calls)
    dep = _deployment(args)
    prop = make_proposer(dep.drafter, args.block)
    width, capture = prop.verify_width, prop.capture
    kernels = ["aten"] + ([] if onednn_problem() else ["onednn"])
    runner = TargetRunner(dep.target, 1, args.context + 2 * width + 2, capture, dep.backend)
    prompt = torch.randint(4, dep.target.config.vocab_size, (args.context,)).tolist()
    out = {"verify_width": width, "context": args.context, "threads": torch.get_num_threads(), "kernels": kernels}
    with torch.inference_mode():
        logits, feats, _ = runner.prefill([prompt])
        blk, one = torch.randint(4, 64, (1, width)), torch.randint(4, 64, (1, 1))
        want = runner.verify(blk)[0]
        steps = {k: FusedTarget(dep.target, k) for k in kernels}
        fns = {"verify_plain": lambda: runner.verify(blk), "decode_plain": lambda: runner.verify(one)}
        out["max_logit_diff"] = {}
        for k, st in steps.items():
            fns[f"verify_fused_{k}"] = lambda st=st: st.forward(blk, runner.length, capture)
            fns[f"decode_fused_{k}"] = lambda st=st: st.forward(one, runner.length, capture)
            out["max_logit_diff"][k] = float((st.forward(blk, runner.length, capture)[0] - want).abs().max())
        if args.compile:
            fn = torch.compile(steps["aten"].forward, dynamic=None, fullgraph=True)
            t = time.perf_counter()
            fn(blk, runner.length, capture)
            out["compile_s"] = round(time.perf_counter() - t, 2)
            fns["verify_compiled"] = lambda: fn(blk, runner.length, capture)
            out["max_logit_diff"]["compiled"] = float((fn(blk, runner.length, capture)[0] - want).abs().max())
        out["target_ms"] = interleaved_ms(fns, rounds, calls)
        prop.start(runner, [prompt], feats, logits.argmax(-1))
        last, ctx, at = torch.tensor([5]), runner.verify(blk)[1], runner.length
        out["drafter_ms"] = interleaved_ms(drafter_steps(prop, last, ctx, at, width, kernels), rounds, calls)
    return out


def table(R: dict) -> list[str]:
    m = R.get("measure")
    if not m:
        return ["no measurement"]
    rows = [f"verify width {m['verify_width']}, context {m['context']}, {m['threads']} thread(s); ms per call "
            "(x plain):"]
    for part in ("target_ms", "drafter_ms"):
        t = m[part]
        for name, ms in t.items():
            base = t.get(name.split("_")[0] + "_plain")
            rows.append(f"  {name:<22} {ms:8.3f}  ({base / ms:.2f}x)" if base else f"  {name:<22} {ms:8.3f}")
    rows.append(f"max |logit - plain|: {m['max_logit_diff']}" + (f"; compile {m['compile_s']} s" if "compile_s" in m
                                                                  else ""))
    return rows


def run(args: argparse.Namespace) -> int:
    rn = Run("cpu-step", args)
    rn.phase("measure", lambda: measure(args))
    return rn.finish(table(rn.R))
