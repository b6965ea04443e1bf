"""Trials: measure an engine config on calibration prompts, behind the token-forcing gate.

A candidate passes the gate only if every output token equals both the AR and the stock
references (near-ties below the forcing tolerance excepted, as in :mod:`specpilot.forcing`).
Its gain is the geometric mean over requests of base decode seconds / candidate decode seconds,
each the minimum over ``repeats`` alternating runs (robust to a busy machine).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from ..engine.serve import EngineSpec, serve
from ..forcing import check
from ..records import Record, write_records


def geomean(xs: list[float]) -> float:
    """Geometric mean of positive numbers (nan for an empty list)."""
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


log = logging.getLogger("specpilot.agent")


class Evaluator:
    """Holds the loaded deployment, the calibration prompts and the AR / stock references."""

    def __init__(self, target, drafter, prompts: list[dict], max_new_tokens: int, concurrency: int,
                 meta: dict, stock_block: int, tolerance: float, repeats: int = 2, reload_target=None):
        self.target, self.drafter, self.prompts = target, drafter, prompts
        self.max_new, self.concurrency, self.meta = max_new_tokens, concurrency, meta
        self.stock_block, self.tolerance, self.repeats = stock_block, tolerance, repeats
        self.reload_target = reload_target  # () -> a fresh copy of the target (for weight formats)
        self._w12_target = None
        self.prompt_ids = {p["request_id"]: p["prompt_ids"] for p in prompts}
        self.ar = self.best_of("ar", {})
        self.stock = self.best_of("stock", {"block_size": stock_block})

    def target_for(self, config: dict):
        """The target in the config's weight format (a 12-bit copy is made once and kept)."""
        if config.get("weight_format") != "w12":
            return self.target
        if self._w12_target is None:
            from ..errors import SpecpilotError
            from ..w12 import apply_w12

            if self.reload_target is None:
                raise SpecpilotError("weight_format w12 needs a way to reload the target (reload_target)")
            self._w12_target = self.reload_target()
            apply_w12(self._w12_target)
        return self._w12_target

    def run(self, engine: str, config: dict, prompts: list[dict] | None = None) -> list[Record]:
        """Serve the calibration prompts once with ``engine`` and ``config`` (profiled)."""
        cfg = dict(config)
        block = int(cfg.pop("block_size", self.stock_block))
        spec = EngineSpec(engine, block, cfg)
        n = len(prompts or self.prompts)
        log.info("timing %s %s on %d calibration prompt(s) x %d new tokens", engine,
                 {"block_size": block, **cfg}, n, self.max_new)
        with torch.inference_mode():
            return serve(spec, self.target_for(config), self.drafter, prompts or self.prompts, self.max_new,
                         self.concurrency, self.meta, progress=False, warmup=True)

    def best_of(self, engine: str, config: dict) -> list[Record]:
        """Run ``repeats`` times; keep each request's fastest record (outputs are identical)."""
        best: dict[str, Record] = {}
        for _ in range(self.repeats):
            for r in self.run(engine, config):
                if r.request_id not in best or r.decode_s < best[r.request_id].decode_s:
                    best[r.request_id] = r
        return [best[p["request_id"]] for p in self.prompts]

    def measure(self, config: dict, base: dict, prompts: list[dict] | None = None) -> tuple[list, list]:
        """Alternate base and candidate runs ``repeats`` times; keep each request's fastest run."""
        best_c: dict[str, Record] = {}
        best_b: dict[str, Record] = {}
        for _ in range(self.repeats):
            for cfg, best in ((base, best_b), (config, best_c)):
                for r in self.run("specpilot", cfg, prompts):
                    if r.request_id not in best or r.decode_s < best[r.request_id].decode_s:
                        best[r.request_id] = r
        return list(best_c.values()), list(best_b.values())

    def gate(self, records: list[Record]) -> dict:
        """Token forcing against AR and stock; ``passed`` only with zero violations."""
        v_ar = check(records, self.ar, self.prompt_ids, self.target, self.tolerance)
        v_st = check(records, self.stock, self.prompt_ids, self.target, self.tolerance)
        return {"passed": v_ar["passed"] and v_st["passed"], "violations": v_ar["violations"] + v_st["violations"],
                "near_ties": v_ar["near_ties"] + v_st["near_ties"],
                "tokens_checked": v_ar["tokens_checked"] + v_st["tokens_checked"],
                "mismatches": (v_ar["mismatches"] + v_st["mismatches"])[:10]}

    def trial(self, config: dict, base: dict, evidence: Path | None = None,
              prompts: list[dict] | None = None) -> dict:
        """Gate and measure a candidate against ``base``; write its records as evidence."""
        cand, base_recs = self.measure(config, base, prompts)
        verdict = self.gate(cand)
        if evidence is not None:
            write_records(evidence, cand)
        by_id = {r.request_id: r for r in base_recs}
        ar = {r.request_id: r for r in self.ar}
        gain = geomean([by_id[r.request_id].decode_s / r.decode_s for r in cand])
        steps = sum(r.verify_steps for r in cand)
        return {"config": config, "gate": verdict, "gain": gain if verdict["passed"] else None,
                "raw_gain": gain,
                "speedup_vs_ar": geomean([ar[r.request_id].decode_s / r.decode_s for r in cand]),
                "tau": sum(sum(r.committed_per_step) for r in cand) / max(steps, 1),
                "requests": len(cand), "evidence": str(evidence) if evidence else None}
