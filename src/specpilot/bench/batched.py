"""``specpilot bench batched``: the batched (c16) speculative step per shape against its floors,
against the AR c16 step and the c1 step of the same run, and where each family's excess goes
(issue 62).

For each shape of ``--shapes`` (default the study's three: ``qwen3-8b``, the ``qwen3.8-27b``
Gated DeltaNet hybrid, ``muse-glimmer-30b``; random bf16 weights drawn on the GPU), ``--batch``
requests (16) of ``--context`` random tokens (336: the study's batched rounds' mean context) on
the engine's runner (the Triton fast path under CUDA graphs, as ``specpilot run`` serves):

0. ``tune`` (``--tune-rows 16 256``, CUDA): the target's and the draft step's matmul tables of those
   row buckets tuned for the shape (:func:`tune_shape`, as the kernel sub-agent tunes them: family
   targets on their own role weights) before its weights are built, and ``tables``: installed before
   every later phase (also ``--tables-from`` an earlier run's);
1. ``floors``: the cost model's roofline floors (:func:`specpilot.agent.costmodel.step_floors`:
   bytes against the copy bandwidth measured here, FLOPs against the bf16 matmul rate measured
   here) of the verify (B x block rows), the draft, the AR c16 and the c1 step; the GEMM part of
   the verify floor (weights read once, or the FLOPs of B x block rows); on a recurrent target the
   commit's state traffic against its floor (today: every GDN layer's recurrent + conv state read
   and written again and the verify's tape of ``block`` tokens read; floor: the state written once;
   keeping the verify's per-token states instead: ``block`` states per row, against the free
   device memory);
2. ``steps``: each part alone, median of CUDA-event times: the c1 AR step, the AR c16 step, the
   verify of B x block tokens, the commit of the replay profile's expected accepted tokens per row
   (verify + commit minus verify), the draft step (context injection + draft, the drafter's Triton
   step under its graphs);
3. ``loop``: the speculative loop at c = B through the continuous-batching scheduler (what ``specpilot
   run`` serves), replay drafter ``--profile`` over AR's own outputs (every output checked equal to
   AR), per step: verify (+ acceptance decision), draft, and the rest (the step minus both: the
   commit, the drafter's context injection, the scheduler's bookkeeping), with AR's c16 step of the
   same loop;
4. ``host``: the loop again under cProfile: the engine's Python functions by own time per step
   (``Scheduler._record``, the acceptance decision, ...), largest first;
5. ``kernels`` (last: the profiler slows every later call): device time per kernel of the c1 step,
   the AR c16 step, the verify, the commit (verify + commit minus verify, per kernel) and the draft,
   grouped (GEMM tiles, attention, GDN recurrence, GDN conv, norms and elementwise, copies: the KV /
   ring / state moves, other); each verify group against the AR c16 step's (same weights, 16 rows
   instead of B x block).

The table prints one line per figure: the parts against their floors and the AR steps first, then
the groups with their excess. ``--dry-run``: tiny shapes on the CPU under Triton's interpreter
(measures nothing).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import re
import time
from pathlib import Path

import torch

from ..agent.costmodel import step_floors
from ..ceilings import measure as measure_ceilings
from ..io import read_json, write_json
from . import _engine as E
from ._common import Run, add_common, fmt, kernel_profile, random_tokens

SHAPES = ["qwen3-8b", "qwen3.8-27b", "muse-glimmer-30b"]
DRY_SHAPES = {"qwen3-8b": "tiny", "qwen3.8-27b": "tiny-hybrid", "muse-glimmer-30b": "tiny-muse"}

# kernel name -> group (first match wins); cuBLAS / CUTLASS names for eager GEMMs
GROUPS = [("gemm", r"_linear_kernel|gemm|cutlass|nvjet|xmma|sm\d+_"),
          ("attention", r"_attn|_qk_rope|flash|fmha|sdpa"),
          ("gdn_recurrent", r"_gdn_recurrent"),
          ("gdn_conv", r"_gdn_conv"),
          ("norm_elementwise", r"norm|_silu|_gate_mul|elementwise|vectorized|reduce|softmax|argmax"),
          ("copy", r"[Cc]opy|[Mm]emcpy|[Mm]emset|index|scatter|gather|cat")]


def group_of(kernel: str) -> str:
    """The group of a kernel name (:data:`GROUPS`; "other" when none matches)."""
    return next((g for g, pat in GROUPS if re.search(pat, kernel)), "other")


def grouped(kernels: dict) -> dict:
    """{group: ms} of a :func:`kernel_profile` kernels dict ({name: {"ms", "launches"}})."""
    out: dict[str, float] = {}
    for name, v in kernels.items():
        out[group_of(name)] = out.get(group_of(name), 0.0) + v["ms"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def accepted_counts(profile, block: int, B: int) -> list[int]:
    """Tokens each of ``B`` rows commits in the commit phase: the profile's expected tau at
    ``block`` spread over the rows (their mean is tau rounded to 1/B), each in [1, block]."""
    tau = E.expected_tau(profile, block)
    total = max(B, min(B * block, round(tau * B)))
    return [total // B + (1 if b < total % B else 0) for b in range(B)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, "batched")
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    p.add_argument("--batch", type=int, default=16, help="concurrency c: requests in the batched step")
    p.add_argument("--context", type=int, default=336, help="prompt tokens per request")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--new", type=int, default=128, help="new tokens per request of the loop phase")
    p.add_argument("--profile", default="study_stock", help="replay profile of the loop and commit phases")
    p.add_argument("--part", choices=("all", "timings", "kernels"), default="all",
                   help="timings: every phase but the kernel profiles; kernels: the profiles only (once torch.profiler "
                        "ran in a process every later call is slower, the next shapes' timings too: run the two "
                        "parts as two processes, as scripts/gpu_batched.sh does)")
    p.add_argument("--top", type=int, default=6, help="engine functions listed by the host phase")
    p.add_argument("--tune-rows", type=int, nargs="*", default=[],
                   help="CUDA: first tune the matmul tables of these row buckets (e.g. 16 256) for the shape's target "
                        "and drafter (as the kernel sub-agent does) and run every phase with them")
    p.add_argument("--tune-configs", type=int, default=8, help="candidates per (role, bucket) with --tune-rows")
    p.add_argument("--tables-from", help="the result JSON of an earlier --tune-rows run: install the tables it wrote "
                   "per shape (<result>_tables_<shape>.json, <result>_drafter_tables_<shape>.json)")


class Shape:
    """The phases over one target shape (module docstring)."""

    def __init__(self, run: Run, a: argparse.Namespace, shape: str, ceilings: dict):
        self.run, self.a, self.shape, self.dev, self.ceil = run, a, shape, run.device, ceilings
        t = time.time()
        self.model, self.drafter = E.target_and_drafter(run, shape, a.block, a.seed)
        self.prof = E.load_profile(a.profile)
        self.V = self.model.config.vocab_size
        self.S = a.context + a.new + 2 * a.block + 64
        self.prompts = [random_tokens(a.context, self.V, 100 + b) for b in range(a.batch)]
        self.capture = tuple(self.drafter.config.target_layer_ids)
        self.info = {"build_s": round(time.time() - t, 1), "batch": a.batch, "context": a.context, "block": a.block,
                     "layer_types": {k: self.model.config.layer_types.count(k)
                                     for k in set(self.model.config.layer_types)}}

    def runner(self, B: int, capture=()):
        r = E.runner(self.model, B, self.S, capture, self.run.cuda, "triton", self.a.block)
        if self.run.cuda and E.step_fast(r) is None:
            raise RuntimeError("the runner did not take the Triton fast path")
        return r

    # -- 1. floors ---------------------------------------------------------------------------
    def floors(self) -> dict:
        a, c, m = self.a, self.model.config, self.model
        esz = m.lm_head.weight.element_size()
        fl = step_floors(c, self.drafter.config, self.ceil, a.batch, a.block, a.context, esz)
        c1 = step_floors(c, None, self.ceil, 1, 1, a.context, esz)
        bw, peak = self.ceil["memory_bandwidth_bytes_per_s"], self.ceil["matmul_flop_per_s"]
        rows = a.batch * a.block
        w = E.weight_bytes_per_step(m, rows)
        params = sum(p.numel() for n, p in m.named_parameters() if "embed_tokens" not in n)
        out = {"verify_ms": fl["verify"] * 1e3, "draft_ms": fl["draft"] * 1e3, "ar_c16_ms": fl["ar_step"] * 1e3,
               "c1_ms": c1["ar_step"] * 1e3, "gemm_verify_ms": max(w / bw, 2 * params * rows / peak) * 1e3,
               "gemm_ar_c16_ms": max(E.weight_bytes_per_step(m, a.batch) / bw, 2 * params * a.batch / peak) * 1e3,
               "weight_bytes": w, "rows": rows}
        if c.is_recurrent:
            out["commit"] = self.commit_bytes(bw)
        return out

    def commit_bytes(self, bw: float) -> dict:
        """The commit's state traffic today and its floor (module docstring, phase 1) [bytes, ms]."""
        a, c, m = self.a, self.model.config, self.model
        m.setup_cache(1, 64)
        gdn = m.state.gdn
        rec = gdn.rec[0].numel() * gdn.rec.element_size()
        conv = gdn.conv[0].numel() * gdn.conv.element_size()
        n = c.layer_types.count("linear_attention")
        kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        esz = m.lm_head.weight.element_size()
        tape_tok = n * ((2 * kd + vd) * esz + 4 * (kd + vd + 2 * c.linear_num_value_heads))
        B, T = a.batch, a.block
        today = B * (2 * (rec + conv) + T * tape_tok)
        floor = B * (rec + conv)
        keep = B * T * rec  # the verify's per-token recurrent states
        free = torch.cuda.mem_get_info(self.dev)[0] if self.run.cuda else None
        return {"state_bytes_per_row": rec + conv, "tape_bytes_per_token": tape_tok, "today_bytes": today,
                "today_ms": today / bw * 1e3, "floor_bytes": floor, "floor_ms": floor / bw * 1e3,
                "keep_states_bytes": keep, "free_bytes": free,
                "keep_states_fit": None if free is None else keep < free // 2}

    def load_tables(self) -> dict:
        """``--tables-from``: the tables an earlier ``--tune-rows`` run of this shape wrote, installed."""
        got = {}
        b = E.backend(self.model, self.run.cuda, "triton")  # the runners' backend (Shape.runner)
        for kind in ("", "drafter_"):
            f = _tables_file(Path(self.a.tables_from), self.shape, kind)
            if f.exists():
                t = read_json(f)
                got[f"{kind}tables"] = b.install_drafter_tables(t) if kind else b.install_tables(t, strict=True)
        return got

    # -- 2. the parts alone -------------------------------------------------------------------
    def _ar(self, rows: int):
        """The AR step of ``rows`` requests on a fresh runner (the model holds one runner's state)."""
        r = self.runner(rows)
        r.prefill(self.prompts[:rows])
        tok = torch.tensor(random_tokens(rows, self.V, 6), device=self.dev)
        return self._resetting(r, lambda: r.decode(tok))

    def _block(self):
        """(verify, verify + commit, draft) of the c16 step on a fresh runner with the drafter's
        capture layers: B x block tokens verified, the replay profile's expected accepted tokens
        per row committed, the draft step (context injection of those tokens + the draft) through
        the deployment's draft step (its tables) as the loop drafts."""
        a, dev, B = self.a, self.dev, self.a.batch
        r = self.runner(B, self.capture)
        r.prefill(self.prompts)
        blk = torch.tensor([random_tokens(a.block, self.V, 7 + b) for b in range(B)], device=dev)
        counts = torch.tensor(accepted_counts(self.prof, a.block, B), dtype=torch.long, device=dev)

        def verify_commit():
            r.verify(blk)
            r.commit(counts)

        _, feats = r.verify(blk)
        self.drafter.setup_cache(B, self.S)
        embed, head = self.model.model.embed_tokens, self.model.lm_head
        if self.run.cuda:
            g = r.backend.drafter_graphs(self.drafter, embed, head)
            ctx_fn, draft_fn = g.add_context, lambda x, s: g.draft(x, s, a.block)
        else:
            ctx_fn, draft_fn = E.draft_step(self.drafter, embed, head, "triton", a.block, False)
        start = r.length.clone()
        ctx_fn(torch.zeros(B, a.context, feats.shape[-1], dtype=feats.dtype, device=dev),
               torch.zeros(B, dtype=torch.long, device=dev))
        anchor, n = blk[:, 0].contiguous(), max(1, round(float(counts.float().mean())))
        part = feats[:, :n].clone()

        def draft():
            ctx_fn(part, start)
            return draft_fn(anchor, start + n)

        return {"verify": self._resetting(r, lambda: r.verify(blk)), "verify_commit": self._resetting(r, verify_commit),
                "draft": draft, "commit_tokens_per_row": float(counts.float().mean())}

    def steps(self) -> dict:
        out = {"c1_ms": self.run.median_s(self._ar(1)) * 1e3, "ar_c16_ms": self.run.median_s(self._ar(self.a.batch)) * 1e3}
        parts = self._block()
        for key in ("verify", "verify_commit", "draft"):
            out[f"{key}_ms"] = self.run.median_s(parts[key]) * 1e3
        out["commit_ms"] = out["verify_commit_ms"] - out["verify_ms"]
        out["commit_tokens_per_row"] = parts["commit_tokens_per_row"]
        return out

    def _resetting(self, r, fn):
        """``fn`` then the runner back at its prefilled lengths (so every timed call sees one context)."""
        base, bound = r.length.clone(), r._bound

        def call():
            out = fn()
            r.length.copy_(base)
            r._bound = bound
            return out

        return call

    # -- 3. / 4. the loop ---------------------------------------------------------------------
    def loop(self) -> dict:
        a, B = self.a, self.a.batch
        r = self.runner(B)
        E.generate_ar(r, self.prompts, 4)  # warm-up: the decode graphs
        ar = E.generate_ar(r, self.prompts, a.new)
        out = {"new": a.new, "ar_c16_loop_ms": ar[0].decode_s / max(1, a.new - 1) * 1e3}
        self.refs = [x.output_ids for x in ar]
        self.rs = rs = self.runner(B, self.capture)
        self._serve(rs, 2 * a.block)  # warm-up: the drafter's graphs
        sched, res = self._serve(rs, a.new)
        steps = max(1, sched.steps)
        first = min(x.first_token_s for x in res)
        step_ms = (max(x.finish_s for x in res) - first) / steps * 1e3
        # per step of each request's own steps (a request that finished early stops accumulating)
        ver = sum(x.verify_s / max(1, x.verify_steps) for x in res) / len(res) * 1e3
        dr = sum(x.draft_s / max(1, x.verify_steps) for x in res) / len(res) * 1e3
        tau = sum(sum(x.committed_per_step) for x in res) / sum(len(x.committed_per_step) for x in res)
        out.update(steps=steps, step_ms=step_ms, verify_ms=ver, draft_ms=dr, rest_ms=step_ms - ver - dr, tau=tau,
                   outputs_equal_ar=all(x.output_ids == y for x, y in zip(res, self.refs)),
                   speedup_vs_ar_formula=tau * out["ar_c16_loop_ms"] / step_ms)
        return out

    def _serve(self, runner, new: int):
        net = E.DFlashProposer(self.drafter, block_size=self.a.block)
        prop = E.ReplayProposer(self.refs, self.prof, self.V, net, seed=0, block_size=self.a.block)
        sched = E.Scheduler(runner, prop, profile=True)
        res = sched.run([E.Request(p, new, ref) for p, ref in zip(self.prompts, self.refs)])
        return sched, res

    def host(self) -> dict:
        """The engine's Python functions by own time per step of the loop under cProfile."""
        prof = cProfile.Profile()
        prof.enable()
        sched, _ = self._serve(self.rs, self.a.new)
        prof.disable()
        steps = max(1, sched.steps)
        st = pstats.Stats(prof)
        rows = []
        for (path, line, fn), (_, _, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
            if "specpilot" in path:
                name = f"{path.split('specpilot/')[-1]}:{fn}"
                rows.append((name, tt / steps * 1e3, ct / steps * 1e3))
        rows.sort(key=lambda x: -x[1])
        return {"steps": steps, "functions": [{"name": n, "own_ms_per_step": t, "cum_ms_per_step": c}
                                              for n, t, c in rows[: self.a.top]]}

    # -- 5. kernels ---------------------------------------------------------------------------
    def kernels(self) -> dict:
        self.run.need_cuda("the per-kernel profile")
        prof = {"c1": kernel_profile(self._ar(1), top=None), "ar_c16": kernel_profile(self._ar(self.a.batch), top=None)}
        parts = self._block()
        prof.update({k: kernel_profile(parts[k], top=None) for k in ("verify", "verify_commit", "draft")})
        vc, v = prof.pop("verify_commit")["kernels"], prof["verify"]["kernels"]
        none = {"ms": 0.0, "launches": 0.0}
        commit = {k: {"ms": x["ms"] - v.get(k, none)["ms"], "launches": x["launches"] - v.get(k, none)["launches"]}
                  for k, x in vc.items()}
        prof["commit"] = {"kernels": {k: x for k, x in commit.items() if x["ms"] > 1e-4},
                          "kernel_sum_ms": sum(max(0.0, x["ms"]) for x in commit.values())}
        for p in prof.values():
            p["groups"] = grouped(p["kernels"])
            p["kernels"] = dict(list(p["kernels"].items())[:12])
        return prof

    def measure(self) -> dict:
        part = self.a.part
        phases = [("tables", self.load_tables)] if self.a.tables_from else []
        phases.append(("floors", self.floors))
        if part in ("all", "timings"):
            phases += [("steps", self.steps), ("loop", self.loop), ("host", self.host)]
        if part in ("all", "kernels") and self.run.cuda:
            phases.append(("kernels", self.kernels))
        self.run.R.setdefault("shapes", {})[self.shape] = self.info
        for key, fn in phases:
            v = self.run.phase(f"{self.shape}:{key}", fn, keep=False)
            if v is not None:
                self.info[key] = v
        return self.info


def tune_shape(rn: Run, a: argparse.Namespace, shape: str, ceil: dict) -> dict:
    """``--tune-rows``: ``shape``'s target and draft-step tables of those buckets tuned (:mod:`specpilot.tuning.matmul`,
    as the kernel sub-agent tunes them: a family target on its own role weights) from the shape's
    configs alone, before its weights are built (the tuner's one-layer stand-ins need the memory), and
    written beside the result (:func:`_tables_file`: the target's as a ``--kernel-configs`` file) for
    the shape's phases to install."""
    rn.need_cuda("--tune-rows")
    M = E.tuning_matmul()
    kw = dict(device="cuda", max_configs=a.tune_configs, bandwidth=ceil["memory_bandwidth_bytes_per_s"])
    cfg = E.target_config(shape)
    t = M.tune_engine_configs(cfg, rows=tuple(a.tune_rows), **kw)
    d = M.tune_drafter_configs(E.drafter_config(shape, a.block), cfg.vocab_size, t["engine_configs"],
                               tuple(a.tune_rows), **kw)
    for kind, configs in (("", t["engine_configs"]), ("drafter_", d["drafter_engine_configs"])):
        f = _tables_file(rn.out, shape, kind)
        tables = E.engine_tables(configs)
        if tables:
            write_json(f, tables)
        elif f.exists():
            f.unlink()  # a rerun that tuned nothing new: no stale tables
    return {"engine_configs": t["engine_configs"], "drafter_engine_configs": d["drafter_engine_configs"],
            "summary": t["engine_summary"] + d["drafter_engine_summary"]}


def _tables_file(result: Path, shape: str, kind: str = "") -> Path:
    """Where a ``--tune-rows`` run with result ``result`` keeps ``shape``'s tuned target (``kind`` "")
    or draft-step (``kind`` "drafter_") tables."""
    return result.with_name(f"{result.stem}_{kind}tables_{shape}.json")


def _x(a, b) -> str:
    return fmt(a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None, "{:.2f}x")


def _commit_line(name: str, cb: dict) -> str:
    """The hybrid commit's state traffic today against its floor (phase ``floors``)."""
    mib = {k: cb[k] / 2**20 for k in ("today_bytes", "floor_bytes")}
    return (f"{name} commit state traffic {mib['today_bytes']:.1f} MiB = {fmt(cb['today_ms'])} ms at copy bandwidth "
            f"(floor: state written once {mib['floor_bytes']:.1f} MiB = {fmt(cb['floor_ms'])} ms); per-token states "
            f"kept {cb['keep_states_bytes'] / 2**30:.2f} GiB (fits in half the free memory: {cb['keep_states_fit']})")


def table(R: dict) -> list[str]:
    """One line per figure: per shape the parts against their floors and the AR steps, the loop's
    step, the commit's state traffic, the kernel groups and the host functions."""
    L = []
    for name, S in R.get("shapes", {}).items():
        f, s, lp = S.get("floors", {}), S.get("steps", {}), S.get("loop", {})
        B = S.get("batch")
        if s:
            L += _step_lines(name, B, f, s)
        if lp:
            L.append(_loop_line(name, B, lp))
        if f.get("commit"):
            L.append(_commit_line(name, f["commit"]))
        L += _kernel_lines(name, B, f, S.get("kernels", {}))
        h = S.get("host", {}).get("functions", [])
        if h:
            L.append(f"{name} host per step (cProfile own ms): " + ", ".join(
                f"{x['name'].split('/')[-1]} {x['own_ms_per_step']:.3f}" for x in h))
        tu, got = R.get(f"{name}:tune"), S.get("tables")
        if tu:
            L.append(f"{name} tuned tables (installed: {json.dumps(got)}): target {json.dumps(tu['engine_configs'])}, "
                     f"drafter {json.dumps(tu['drafter_engine_configs'])}")
    return L


def _step_lines(name: str, B, f: dict, s: dict) -> list[str]:
    """The parts alone against their floors and the AR steps (phase ``steps``)."""
    v, d = s.get("verify_ms"), s.get("draft_ms")
    return [f"{name} c{B} verify {fmt(v)} ms = {_x(v, f.get('verify_ms'))} floor {fmt(f.get('verify_ms'))} ms = "
            f"{_x(v, s.get('ar_c16_ms'))} AR c{B} {fmt(s.get('ar_c16_ms'))} ms (floor {fmt(f.get('ar_c16_ms'))}) = "
            f"{_x(v, s.get('c1_ms'))} c1 {fmt(s.get('c1_ms'))} ms (floor {fmt(f.get('c1_ms'))})",
            f"{name} c{B} draft {fmt(d)} ms = {_x(d, f.get('draft_ms'))} floor {fmt(f.get('draft_ms'))} ms; commit "
            f"{fmt(s.get('commit_ms'))} ms ({fmt(s.get('commit_tokens_per_row'), '{:.2f}')} tokens per row)"]


def _loop_line(name: str, B, lp: dict) -> str:
    """The scheduler loop's step split into verify, draft and the rest (phase ``loop``)."""
    return (f"{name} c{B} loop step {fmt(lp.get('step_ms'))} ms: verify {fmt(lp.get('verify_ms'))}, draft "
            f"{fmt(lp.get('draft_ms'))}, rest {fmt(lp.get('rest_ms'))} ms (bar <= 0.60); tau "
            f"{fmt(lp.get('tau'), '{:.2f}')}, AR c{B} loop step {fmt(lp.get('ar_c16_loop_ms'))} ms, "
            f"tau x AR / step {fmt(lp.get('speedup_vs_ar_formula'), '{:.2f}')}x, = AR {lp.get('outputs_equal_ar', '-')}")


def _kernel_lines(name: str, B, f: dict, k: dict) -> list[str]:
    """Device time per kernel group of each part, the verify's against the AR c16 step's (phase ``kernels``)."""
    if not k:
        return []
    L, ar = [], k.get("ar_c16", {}).get("groups", {})
    for part in ("verify", "commit", "draft", "ar_c16", "c1"):
        g = k.get(part, {}).get("groups", {})
        items = ", ".join(f"{n} {ms:.3f}" + (f" ({_x(ms, ar.get(n))} AR c{B})" if part == "verify" else "")
                          for n, ms in list(g.items())[:6])
        L.append(f"{name} kernels {part}: {fmt(k.get(part, {}).get('kernel_sum_ms'))} ms: {items}")
    gv = k.get("verify", {}).get("groups", {}).get("gemm")
    return L + [f"{name} verify GEMM {fmt(gv)} ms = {_x(gv, f.get('gemm_verify_ms'))} its floor "
                f"{fmt(f.get('gemm_verify_ms'))} ms ({f.get('rows')} rows; AR c{B} GEMM floor "
                f"{fmt(f.get('gemm_ar_c16_ms'))} ms)"]


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        args.shapes = [DRY_SHAPES.get(s, s) for s in args.shapes]
        args.batch, args.context, args.block, args.new = 2, 16, 4, 8
    rn = Run("batched", args)
    dev = "cuda" if rn.cuda else "cpu"
    ceil = rn.phase("ceilings", lambda: measure_ceilings(dev, 1024 if rn.cuda else 16, 8192 if rn.cuda else 256,
                                                         10 if rn.cuda else 2))
    if ceil is None:
        return rn.finish(table(rn.R))
    for shape in args.shapes:
        if args.tune_rows:  # before the weights are built; the shape's phases install what it wrote
            rn.phase(f"{shape}:tune", lambda shape=shape: tune_shape(rn, args, shape, ceil))
            args.tables_from = str(rn.out)
        s = rn.phase(f"{shape}:build", lambda shape=shape: Shape(rn, args, shape, ceil), keep=False)
        if s is not None:
            s.measure()
            E.release(s.model)
            del s
            gc.collect()  # the parts' closures hold runners in reference cycles
            if rn.cuda:
                torch.cuda.empty_cache()
    return rn.finish(table(rn.R))
