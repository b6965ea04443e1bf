"""Trials: measure an engine config on calibration prompts, behind the token-forcing gate.

A candidate passes the gate only if :func:`specpilot.forcing.force` finds no violation: every
output token is the target's own greedy choice under a teacher-forced pass (near-ties below the
forcing tolerance excepted), every record is structurally consistent and its first verify steps
re-run to the same commits, and its requests and token counts equal the AR and stock references'
exactly. It is the same function, with the same rule, that writes the table's verdict files.
Its gain is the geometric mean over requests of base decode seconds / candidate decode seconds,
each the minimum over ``repeats`` alternating runs (robust to a busy machine; on the CPU at
concurrency 1 alternating request by request, as the engine cells), with the interval the
study table uses for its speedups (:func:`specpilot.aggregate.bootstrap_interval`: a seeded
percentile bootstrap over requests and repeats). A trial is sequential: while that interval
straddles ``min_gain`` it is measured on the next rung of calibration prompts, up to a cap
(:meth:`Evaluator.trial`; config ``rounds.calibration_cap``, docs/decisions.md).

What the rounds do with a trial's gain and interval: :mod:`specpilot.agent.decide`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from ..aggregate import bootstrap_interval, geomean, timing_pairs
from ..deployment import Deployment
from ..drafters.replay import AcceptanceProfile
from ..engine.config import EngineConfig, EngineSpec
from ..engine.serve import ServeOptions, default_max_seq, serve
from ..errors import SpecpilotError
from ..forcing import REEXECUTION_TOKENS, Reexecution, force, serve_reexecution
from ..io import write_jsonl
from ..records import Record, record_from_dict, write_records
from ..fastpath.w12 import every_role as every_w12_role
from ..w12 import apply_w12
from .decide import settle


log = logging.getLogger("specpilot.agent")


class Evidence:
    """The trial records of one round step, in one declared JSON-lines file: each line a record
    (:class:`specpilot.records.Record` fields) plus ``trial``, the tag of the trial it belongs to.

    One file per step, not a folder of files, so Snakemake knows every file a run writes
    (``--list-untracked`` looks at files, and a ``directory()`` output's contents are not files
    of the DAG). :meth:`write` writes it atomically once the step has decided.
    """

    def __init__(self, path: str | Path):
        self.path, self.rows = Path(path), []

    def add(self, tag: str, records: list[Record]) -> str:
        """Keep ``records`` under ``tag``; returns the reference ``PATH#TAG`` a result names."""
        self.rows += [{**r.to_dict(), "trial": tag} for r in records]
        return f"{self.path}#{tag}"

    def write(self) -> None:
        write_jsonl(self.path, self.rows)

    @staticmethod
    def read(path: str | Path, tag: str) -> list[Record]:
        """The records of trial ``tag`` in an evidence file (empty when it has none).

        Raises:
            SpecpilotError: the file is missing or a row is not a valid record."""
        p = Path(path)
        if not p.is_file():
            raise SpecpilotError(f"evidence file {p} does not exist")
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return [record_from_dict({k: v for k, v in r.items() if k != "trial"}, f"{p}#{tag}")
                for r in rows if r.get("trial") == tag]


class Evaluator:
    """Holds the loaded deployment, the calibration prompts and the AR / stock references.

    ``references``: ``(ar, stock)`` records of exactly these prompts (the workflow's
    ``round_references`` job, read once and shared by every round step); ``None`` measures them
    here (``repeats`` runs each, fastest kept).

    ``reuse_base``: time a round's base once (issue 61): a config timed on these prompts in this
    step (a trial's candidate, :meth:`time_config`) or given by :meth:`keep` (the plan's base records,
    read back by the agents and the integration) is not re-timed as a later trial's base; only the
    candidate runs (``repeats`` times). The stock references are such timings of stock's config
    (round 1's base) when their records ran exactly that config (:meth:`runs_as`). Off: every trial
    alternates base and candidate as before.

    ``replay``: an acceptance profile (:class:`~specpilot.drafters.replay.AcceptanceProfile`): every
    drafting engine runs the replay drafter over the AR references' outputs (a synthetic
    deployment of random weights; its records are marked ``synthetic``).

    Raises:
        SpecpilotError: given references do not cover the prompts' request ids one to one.
    """

    def __init__(self, dep: Deployment, prompts: list[dict], max_new_tokens: int, concurrency: int,
                 meta: dict, stock_block: int, tolerance: float, repeats: int = 2, reload_target=None,
                 replay_tokens: int = REEXECUTION_TOKENS,
                 references: tuple[list[Record], list[Record]] | None = None,
                 replay: AcceptanceProfile | None = None, rungs: list[int] | None = None,
                 min_gain: float = 1.0, reuse_base: bool = False):
        self.dep, self.pool, self.replay = dep, prompts, replay
        self.rung_sets = rung_prompts(prompts, rungs)
        self.prompts = self.rung_sets[0]  # rung 0: what every trial measures first
        self.min_gain = min_gain  # where a sequential trial stops (agent.decide.settle)
        self.reuse_base = reuse_base
        self.timed: dict[str, dict[str, Record]] = {}  # config key -> request id -> its fastest record
        self.replay_refs: dict[str, list[int]] | None = None
        self.replay_tokens = replay_tokens
        self.max_new, self.concurrency, self.meta = max_new_tokens, concurrency, meta
        self.stock_block, self.tolerance, self.repeats = stock_block, tolerance, repeats
        self.reload_target = reload_target  # () -> a fresh copy of the target (for weight formats)
        self._w12_dep = None
        self.prompt_ids = {p["request_id"]: p["prompt_ids"] for p in prompts}
        if references is None:
            pool_ar = self.best_of("ar", {})
            self.replay_refs = {r.request_id: r.output_ids for r in pool_ar}
            pool_stock = self.best_of("stock", {"block_size": stock_block})
        else:
            pool_ar, pool_stock = (self._matching(name, recs) for name, recs in zip(("ar", "stock"), references))
            self.replay_refs = {r.request_id: r.output_ids for r in pool_ar}
        # every calibration prompt's references (the gate of a later rung); ar / stock: rung 0's
        self.pool_ar, self.pool_stock = pool_ar, pool_stock
        first = {p["request_id"] for p in self.prompts}
        self.ar, self.stock = ([r for r in recs if r.request_id in first] for recs in (pool_ar, pool_stock))
        stock_config = {"block_size": stock_block}  # round 1's base: stock's config, timed by the references
        if reuse_base and self.runs_as(self.pool_stock, stock_config):
            self.keep(stock_config, self.pool_stock if concurrency == 1 else self.stock)

    def _matching(self, name: str, records: list[Record]) -> list[Record]:
        """``records`` in prompt order, checked to be one per calibration prompt and engine ``name``."""
        by_id = {r.request_id: r for r in records}
        want = [p["request_id"] for p in self.pool]
        if sorted(by_id) != sorted(want) or len(records) != len(want) or any(r.engine != name for r in records):
            raise SpecpilotError(f"{name} references do not match the calibration prompts "
                                 f"({len(records)} records for {len(want)} prompts)")
        return [by_id[i] for i in want]

    @property
    def target(self):
        """The loaded target (native weights)."""
        return self.dep.target

    @property
    def drafter(self):
        """The loaded drafter network (or None)."""
        return self.dep.drafter

    def deployment_for(self, config: dict) -> Deployment:
        """The deployment in the config's weight format (a 12-bit copy of the target is made once
        and kept, with its own backend: on bf16 weights every matmul role held in 12 bits and run
        by the fast path's 12-bit loader, :mod:`specpilot.fastpath.w12`, bit-identical to bf16). Raises SpecpilotError when w12 is asked without a way to
        reload the target."""
        if config.get("weight_format") != "w12":
            return self.dep
        if self._w12_dep is None:
            if self.reload_target is None:
                raise SpecpilotError("weight_format w12 needs a way to reload the target (reload_target)")
            target = self.reload_target()
            b = self.dep.backend
            # the fast path's 12-bit loader (every role; the bf16 bits) unless the config turns it off
            fast = EngineConfig.parse(config).w12_fast and target.lm_head.weight.dtype == torch.bfloat16
            if not fast:
                apply_w12(target)
            self._w12_dep = Deployment.of(target, self.dep.drafter, self.dep.eos_id, b.graphs, b.kernels,
                                          w12_choice=every_w12_role() if fast else None)
            if b.tables:
                self._w12_dep.backend.install_tables(b.tables)
        return self._w12_dep

    def spec(self, engine: str, config: dict) -> EngineSpec:
        """The engine spec of ``config`` (its ``block_size``, else the stock block)."""
        cfg = dict(config)
        block = int(cfg.pop("block_size", self.stock_block))
        if engine != "ar" and self.replay is not None:  # the replay drafter over the AR references
            cfg["replay_profile"] = self.replay.name
        return EngineSpec(engine, block, cfg)

    def run(self, engine: str, config: dict, prompts: list[dict] | None = None, max_seq: int | None = None,
            warmup: bool = True) -> list[Record]:
        """Serve the calibration prompts once with ``engine`` and ``config`` (profiled); ``max_seq``:
        the KV-cache slots per row (None: what these prompts need). With a replay profile, stock and
        specpilot draft the AR references with its acceptance (records marked synthetic)."""
        spec = self.spec(engine, config)
        replay, meta = (self.replay if engine != "ar" else None), self.meta
        if replay is not None:
            meta = {**self.meta, "drafter": f"replay:{self.meta.get('drafter')}"}
        n = len(prompts or self.prompts)
        log.info("timing %s %s on %d calibration prompt(s) x %d new tokens", engine,
                 spec.record_config(), n, self.max_new)
        opts = ServeOptions(progress=False, warmup=warmup, max_seq=max_seq, replay=replay,
                            references=self.replay_refs if replay is not None else None)
        with torch.inference_mode():
            return serve(spec, self.deployment_for(config), prompts or self.prompts, self.max_new,
                         self.concurrency, meta, opts)

    def best_of(self, engine: str, config: dict, pool: bool = True) -> list[Record]:
        """Every calibration prompt's record: rung 0's run ``repeats`` times, each request's fastest
        kept (outputs are identical), with every run's ``decode_s`` as its ``decode_s_repeats``; the
        later rungs' prompts once (their references are what the gate compares a later rung with;
        their AR time only enters a trial's ``speedup_vs_ar``); in the calibration file's order.
        ``pool`` False: rung 0's prompts only."""
        runs: dict[str, list[Record]] = {}
        for _ in range(self.repeats):
            for r in self.run(engine, config):
                runs.setdefault(r.request_id, []).append(r)
        every = self.pool if pool else self.prompts
        rest = [p for p in every if p["request_id"] not in runs]
        if rest:
            for r in self.run(engine, config, rest):
                runs.setdefault(r.request_id, []).append(r)
        return [dataclasses.replace(min(rs, key=lambda r: r.decode_s), decode_s_repeats=[r.decode_s for r in rs])
                for rs in (runs[p["request_id"]] for p in every)]

    def runs_as(self, records: list[Record], config: dict) -> bool:
        """Whether ``records`` (e.g. the stock references) ran exactly what the specpilot engine runs
        with ``config``: every record's ``engine_config`` equals that spec's record config (the
        kernels used and the execution path aside: what the run records about this deployment's
        backend, the same for both). The engine has no code path per engine name, only per config, so
        such records are ``config``'s timings."""
        ran = ("kernels", "path")
        want = {k: v for k, v in self.spec("specpilot", config).record_config().items() if k not in ran}
        return bool(records) and all({k: v for k, v in (r.engine_config or {}).items() if k not in ran} == want
                                     for r in records)

    @staticmethod
    def config_key(config: dict) -> str:
        """The key a config's timings are kept under (its JSON, keys sorted)."""
        return json.dumps(config, sort_keys=True)

    def keep(self, config: dict, records: list[Record]) -> int:
        """Keep ``records`` as ``config``'s timings on these prompts (with ``reuse_base``), where the
        evidence allows: a record of one of these prompts, at this step's token count and
        concurrency, timed on this step's GPU kind, with its repeats (``decode_s_repeats``).
        Returns how many were kept (a record that does not fit is left out: its request is timed
        again when asked)."""
        if not self.reuse_base:
            return 0
        if self.concurrency > 1 and {r.request_id for r in records} != {p["request_id"] for p in self.prompts}:
            # batched: a request's time depends on what shares its batch, so only rung 0's set, timed
            # together, is reused (a later rung re-times its base beside the candidate)
            return 0
        gpu = self.meta.get("gpu")
        fit = [r for r in records if r.request_id in self.prompt_ids and r.new_tokens == self.max_new
               and r.concurrency == self.concurrency and (gpu is None or r.gpu == gpu) and r.decode_s_repeats]
        self.timed.setdefault(self.config_key(config), {}).update({r.request_id: r for r in fit})
        return len(fit)

    def _kept(self, config: dict, rows: list[dict]) -> list[Record] | None:
        """``config``'s kept records of ``rows`` (every one), else None."""
        have = self.timed.get(self.config_key(config), {}) if self.reuse_base else {}
        if not rows or any(p["request_id"] not in have for p in rows):
            return None
        return [have[p["request_id"]] for p in rows]

    def time_config(self, config: dict) -> list[Record]:
        """``config``'s records on every calibration prompt: its kept timings (``reuse_base``), else
        ``repeats`` runs, each request's fastest with every run's ``decode_s`` (kept for reuse)."""
        kept = self._kept(config, self.prompts)
        if kept is not None:
            log.info("reusing the timings of %s (timed once this round)", json.dumps(config))
            return kept
        out = self.best_of("specpilot", config, pool=False)
        self.keep(config, out)
        return out

    def measure(self, config: dict, base: dict, prompts: list[dict] | None = None) -> tuple[list, list]:
        """Alternate base and candidate runs ``repeats`` times; keep each request's fastest run,
        with every run's ``decode_s`` as its ``decode_s_repeats`` (for the gain's interval). With
        ``reuse_base`` and ``base`` timed on these prompts already (:meth:`keep`), only the
        candidate runs and the base's kept records are the comparison.

        At concurrency 1 on an eager device (the CPU) they alternate request by request (which goes
        first rotating per request and repeat), each at the KV-cache size its run over all the
        prompts allocates, as the engine cells time them (:mod:`specpilot.engine.cli`): drift of a
        shared machine then hits both alike instead of whichever pass ran during it."""
        runs: dict[str, dict[str, list[Record]]] = {"base": {}, "cand": {}}
        rows = prompts or self.prompts
        kept = self._kept(base, rows)
        sides = (("base", base), ("cand", config)) if kept is None else (("cand", config),)
        if kept is not None:
            log.info("base %s: its timings of this round reused; timing the candidate only", json.dumps(base))
        if self.concurrency == 1 and self.dep is not None and not self.dep.backend.graphs:
            sizes = {side: default_max_seq(self.spec("specpilot", cfg), self.deployment_for(cfg), rows, self.max_new, 1)
                     for side, cfg in sides}
            warm = set()
            for rep in range(self.repeats):
                for i, p in enumerate(rows):
                    for side, cfg in (sides if (i + rep) % 2 == 0 else sides[::-1]):
                        [r] = self.run("specpilot", cfg, [p], sizes[side], warmup=side not in warm)
                        warm.add(side)
                        runs[side].setdefault(r.request_id, []).append(r)
        else:
            for _ in range(self.repeats):
                for side, cfg in sides:
                    for r in self.run("specpilot", cfg, prompts):
                        runs[side].setdefault(r.request_id, []).append(r)

        def fastest(side: dict[str, list[Record]]) -> list[Record]:
            return [dataclasses.replace(min(rs, key=lambda r: r.decode_s), decode_s_repeats=[r.decode_s for r in rs])
                    for rs in side.values()]

        cand, base_recs = fastest(runs["cand"]), (kept if kept is not None else fastest(runs["base"]))
        self.keep(config, cand)
        self.keep(base, base_recs)
        return cand, base_recs

    def gate(self, records: list[Record], prompts: list[dict] | None = None) -> dict:
        """Token forcing (:func:`specpilot.forcing.force`) of a candidate's records.

        References: the AR and stock records of the prompts the candidate was asked to serve
        (``prompts``, default all calibration prompts), so a missing, extra or short request is
        a violation. The spot re-execution re-runs the candidate's first verify steps with its own
        engine config on this deployment. Returns the verdict's summary: passed, violations (and
        by check), near_ties, max_near_tie_margin, tokens_checked, tokens_generated, coverage,
        exact_match (rate per reference) and ``mismatches``: the first 10 violations, then
        near-ties, each with ``kind`` ``violation`` / ``near_tie`` and its evidence.
        """
        ids = [p["request_id"] for p in (prompts or self.prompts)]
        ar, st = {r.request_id: r for r in self.pool_ar}, {r.request_id: r for r in self.pool_stock}
        refs = {"ar": [ar[i] for i in ids], "stock": [st[i] for i in ids]}
        serve_fn = serve_reexecution(lambda cfg: self.deployment_for(cfg.to_dict()), self.meta)
        reexecution = Reexecution(serve_fn, self.replay_tokens, self.max_new)
        v = force(records, refs, self.prompt_ids, self.dep.backend, self.tolerance, reexecution, candidate_name="trial")
        listed = [{"kind": "violation", **x} for x in v["violation_list"]] + \
                 [{"kind": "near_tie", **x} for x in v["near_tie_list"]]
        return {"passed": v["passed"], "violations": v["violations"],
                "violations_by_check": v["violations_by_check"], "near_ties": v["near_ties"],
                "max_near_tie_margin": v["max_near_tie_margin"], "tokens_checked": v["tokens_checked"],
                "tokens_generated": v["tokens_generated"], "coverage": v["coverage"],
                "exact_match": {k: rep["exact_match_rate"] for k, rep in v["references"].items()},
                "replay_reproduced": f"{v['replay']['reproduced']}/{v['replay']['requests']}",
                "mismatches": listed[:10]}

    def trial(self, config: dict, base: dict, evidence: "Evidence | Path | None" = None,
              prompts: list[dict] | None = None, tag: str = "trial", sequential: bool = True) -> dict:
        """Gate and measure a candidate against ``base``, sequentially over the calibration rungs;
        keep its records as evidence (``tag``'s part of an :class:`Evidence` file, or a records
        file of their own at a path).

        With ``prompts`` given (a screening subset), ``sequential`` False or one rung: one
        measurement (``decision`` ``one measurement`` for the first two). Otherwise rung 0's
        prompts first; while the gain's interval straddles ``min_gain``
        (:func:`specpilot.agent.decide.settle`) the next rung's prompts are measured too, until the
        interval clears ``min_gain``, falls below it, the point gain is at most ``min_gain``
        (futile: more requests would not lift the interval above it), or the last rung (the cap)
        is reached: then ``decision`` is ``"undecided at the cap"`` (the trial does not clear, so it is rejected).
        At concurrency 1 a rung measures only its new prompts and the interval pools every rung's
        requests (requests are independent there); at a batched concurrency a rung re-measures all
        its prompts, so every measurement runs at the regime's batch. Each rung's gate covers the
        records it measured: one violation anywhere fails the trial.

        Returns ``gain`` (geomean over requests of base / candidate fastest decode time; None when
        token forcing failed), ``gain_lo``/``gain_hi`` (its 95 % bootstrap interval over requests
        and repeats, :func:`specpilot.aggregate.bootstrap_interval`), the verdict, the speedup over
        AR and tau, ``requests``, ``rungs`` (one ``{rung, requests, gain, gain_lo, gain_hi}`` per
        rung measured) and ``decision`` (``clears min_gain``, ``below min_gain``, ``undecided at the
        cap``, ``futile: point gain at most min_gain``, ``failed token forcing``, ``one
        measurement``). A candidate the engine refuses to run (a :class:`SpecpilotError` naming the setting, or the device running out of memory)
        is a rejected trial with ``gate.refused`` = the reason (:func:`refused_trial`), not a
        failed job."""
        once = prompts is not None or not sequential
        sets = [prompts or self.prompts] if once else self.rung_sets
        pooled = self.concurrency == 1
        cand, base_recs, verdicts, rungs, parts = [], [], [], [], []
        decision = "one measurement" if once else None
        for k, rung in enumerate(sets):
            seen = {r.request_id for r in cand}
            new = [p for p in rung if p["request_id"] not in seen] if pooled else rung
            try:
                c, b = self.measure(config, base, new)
            except (SpecpilotError, torch.cuda.OutOfMemoryError) as e:
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                log.warning("candidate %s refused: %s", config,
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                return refused_trial(config, e)
            verdicts.append(self.gate(c, new))
            cand, base_recs = (cand + c, base_recs + b) if pooled else (c, b)
            parts.append(c)
            by_id = {r.request_id: r for r in base_recs}
            gain = geomean([by_id[r.request_id].decode_s / r.decode_s for r in cand])
            lo, hi = bootstrap_interval([timing_pairs(base_recs, cand)])
            rungs.append({"rung": k, "requests": len(cand), "gain": gain, "gain_lo": lo, "gain_hi": hi})
            if once:
                break
            state = settle(lo, hi, self.min_gain, gain)
            if not verdicts[-1]["passed"]:
                decision = "failed token forcing"
            elif state == "futile":
                decision = "futile: point gain at most min_gain"
            elif state != "straddles":
                decision = f"{state} min_gain"
            elif k == len(sets) - 1:
                decision = "undecided at the cap"
            if len(sets) > 1:
                log.info("%s rung %d: %d requests, gain %.3f (95%% interval %.3f-%.3f, min_gain %.3f): %s", tag, k,
                         len(cand), gain, lo, hi, self.min_gain, decision or "straddles: next rung")
            if decision is not None:
                break
        verdict = merge_verdicts(verdicts)
        ref = self._keep(evidence, tag, parts if pooled else parts[-1:], [] if pooled else parts[:-1])
        ar = {r.request_id: r for r in self.pool_ar}
        steps = sum(r.verify_steps for r in cand)
        last = rungs[-1]
        return {"config": config, "gate": verdict, "gain": last["gain"] if verdict["passed"] else None,
                "raw_gain": last["gain"], "gain_lo": last["gain_lo"], "gain_hi": last["gain_hi"],
                "speedup_vs_ar": geomean([ar[r.request_id].decode_s / r.decode_s for r in cand]),
                "tau": sum(sum(r.committed_per_step) for r in cand) / max(steps, 1),
                "requests": len(cand), "rungs": rungs, "decision": decision, "evidence": ref}

    @staticmethod
    def _keep(evidence: "Evidence | Path | None", tag: str, kept: list[list[Record]],
              earlier: list[list[Record]]) -> str | None:
        """Keep a trial's records: ``kept`` (the records its gain is over) under ``tag``, the
        ``earlier`` rungs' re-measured records under ``{tag}.rung{k}``; the reference of ``tag``."""
        if isinstance(evidence, Evidence):
            for k, recs in enumerate(earlier):
                evidence.add(f"{tag}.rung{k}", recs)
            return evidence.add(tag, [r for recs in kept for r in recs])
        if evidence is not None:
            write_records(evidence, [r for recs in kept for r in recs])
            return str(evidence)
        return None


def merge_verdicts(verdicts: list[dict]) -> dict:
    """One gate summary (:meth:`Evaluator.gate`) of the records of several rungs: passed only when
    every rung's passed; counts summed, the largest near-tie margin, the smallest coverage and
    exact-match rate, the first 10 mismatches."""
    if len(verdicts) == 1:
        return verdicts[0]
    out = dict(verdicts[-1])

    def total(key):
        vals = [v.get(key) for v in verdicts if v.get(key) is not None]
        return sum(vals) if vals else None

    out["passed"] = all(v["passed"] for v in verdicts)
    for key in ("violations", "near_ties", "tokens_checked", "tokens_generated"):
        if any(key in v for v in verdicts):
            out[key] = total(key)
    if any("violations_by_check" in v for v in verdicts):
        by: dict[str, int] = {}
        for v in verdicts:
            for check, n in (v.get("violations_by_check") or {}).items():
                by[check] = by.get(check, 0) + n
        out["violations_by_check"] = by
    margins = [v["max_near_tie_margin"] for v in verdicts if v.get("max_near_tie_margin") is not None]
    if any("max_near_tie_margin" in v for v in verdicts):
        out["max_near_tie_margin"] = max(margins) if margins else None
    if any("coverage" in v for v in verdicts):
        out["coverage"] = min(v.get("coverage", 0.0) for v in verdicts)
    if any("exact_match" in v for v in verdicts):
        keys = {k for v in verdicts for k in v.get("exact_match", {})}
        out["exact_match"] = {k: min(v.get("exact_match", {}).get(k, 0.0) for v in verdicts) for k in sorted(keys)}
    if any(v.get("replay_reproduced") for v in verdicts):
        done = [tuple(map(int, v["replay_reproduced"].split("/"))) for v in verdicts if v.get("replay_reproduced")]
        out["replay_reproduced"] = f"{sum(a for a, _ in done)}/{sum(b for _, b in done)}"
    if any("mismatches" in v for v in verdicts):
        out["mismatches"] = [m for v in verdicts for m in v.get("mismatches", [])][:10]
    return out


def rung_prompts(prompts: list[dict], rungs: list[int] | None) -> list[list[dict]]:
    """The calibration prompts of each rung: rung k holds the first ``rungs[k]`` prompts of every
    benchmark (a prompt's ``benchmark``, else its request id's part before ``/``; all of them
    where its reserve is smaller; a rung adding none is dropped), in file order; ``None``: one rung of every prompt. A smaller calibration subset is
    a prefix of a larger one (:func:`specpilot.prompts.select`), so rung 0 of a file written for
    the cap is the file the rung-0 count alone would have written.

    Raises:
        SpecpilotError: rungs not rising positive integers, or a benchmark with fewer prompts than
            rung 0.
    """
    if not rungs:
        return [list(prompts)]
    if any(not isinstance(n, int) or n < 1 for n in rungs) or any(b <= a for a, b in zip(rungs, rungs[1:])):
        raise SpecpilotError(f"--calibration-rungs {','.join(map(str, rungs))}: need rising positive integers "
                             f"(prompts per benchmark at each rung)")
    by: dict[str, list[dict]] = {}
    for p in prompts:
        by.setdefault(p.get("benchmark") or p["request_id"].split("/")[0], []).append(p)
    short = {b: len(ps) for b, ps in by.items() if len(ps) < rungs[0]}
    if short:
        raise SpecpilotError(f"--calibration-rungs {','.join(map(str, rungs))}: the calibration file holds fewer "
                             f"prompts than rung 0 for {short} (config rounds.calibration_prompts)")
    sets: list[list[dict]] = []
    for n in rungs:
        keep = {id(p) for ps in by.values() for p in ps[:n]}
        rung = [p for p in prompts if id(p) in keep]
        if not sets or len(rung) > len(sets[-1]):  # a rung no benchmark has more prompts for is none
            sets.append(rung)
    return sets


def refused_trial(config: dict, error: BaseException) -> dict:
    """The result of a trial whose candidate could not run: the gate not passed, ``refused`` = the
    error's first line (what the engine said about the setting), every measurement None."""
    reason = (str(error).splitlines() or [type(error).__name__])[0]
    gate = {"passed": False, "refused": f"{type(error).__name__}: {reason}", "violations": None,
            "violations_by_check": {}, "near_ties": None, "max_near_tie_margin": None, "tokens_checked": 0,
            "tokens_generated": 0, "coverage": 0.0, "exact_match": {}, "replay_reproduced": None, "mismatches": []}
    return {"config": config, "gate": gate, "gain": None, "raw_gain": None, "gain_lo": None, "gain_hi": None,
            "speedup_vs_ar": None, "tau": None, "requests": 0, "rungs": [], "decision": "refused", "evidence": None}
