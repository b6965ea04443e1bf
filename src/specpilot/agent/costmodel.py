"""Cost model: per verify step floors from bytes and FLOPs against measured device ceilings,
compared with instrumented component times, as seconds lost per committed token.

Floors (roofline: a step cannot beat max(bytes / bandwidth, FLOPs / matmul rate)):
- verify: target weights + KV cache read for B rows x N block tokens; FLOPs 2 x params x B x N
  plus attention 4 x B x N x context x heads x head_dim x layers;
- draft: drafter weights + the target's LM head (shared) + the draft context K/V;
- host (acceptance decision, bookkeeping, Python): floor 0.
Terms reported, each in seconds per committed token (divide per-step seconds by tau):
- ``acceptance``: step time x (1/tau - 1/block_size), time lost to rejected drafts;
- ``verify``, ``draft``, ``host``: measured minus floor;
- ``weight_bytes``: the weight-read part of the verify floor that a 12-bit format would save
  (a quarter of it), only for bf16 weights.
Batched terms (continuous batching, records with times; the verify floor above is already at
M = batch x block rows):
- ``prefill_stall``: neighbours' prefill steps a running request waited through
  (``prefill_stall_s``; taken out of ``host``), floor 0; with the mixed prefill step
  (``mixed_prefill``, :mod:`specpilot.engine.mixed`, the direction that attacks this term) what
  the newcomers' chunks added to the steps it ran (taken out of its ``verify_s`` there);
- ``idle_slots``: the share f of slot-time without a running request (1 - sum of the requests'
  time in flight / (c x wall time of the cell)); gap = f x the step's per-token cost, the
  throughput the empty slots forgo;
- ``speculation`` (given AR records at the same concurrency): the speculative step's measured
  seconds per committed token above AR's seconds per token, floor AR's: what AR steps would save
  where speculating loses under load (SmartSpec's goodput test, per step: drafters.goodput_gate).
Ceilings: a step is held to the ceilings measured with the threads it ran with (the records'
``threads``; :func:`specpilot.ceilings.for_threads`: CPU ceilings are measured per thread count, so a
one-thread timed CPU job is not held to every core's bandwidth and matmul rate); the analysis names
the thread count the floors assume (``floor_threads``) and the steps' (``step_threads``).
Kernel launch configs are tuned apart from the rounds, by the kernel sub-agent
(:mod:`specpilot.agent.kernel_agent`), whose winners every round step and engine cell use.
"""

from __future__ import annotations

import math

from ..ceilings import for_threads
from ..models.config import TargetConfig
from ..models.dflash import DrafterConfig
from ..records import Record


def _linear_params(hidden, inter, layers, heads, kv, hd) -> int:
    attn = hidden * heads * hd * 2 + hidden * kv * hd * 2
    return layers * (attn + 3 * hidden * inter)


def target_bytes(cfg: TargetConfig, dtype_bytes: int) -> dict:
    """Bytes of the target's weights read per forward (embedding rows excluded, LM head included)."""
    lin = _linear_params(cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                         cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    head = cfg.hidden_size * cfg.vocab_size
    return {"linear": lin * dtype_bytes, "lm_head": head * dtype_bytes, "params": lin + head}


def step_floors(cfg: TargetConfig, dcfg: DrafterConfig | None, ceilings: dict, batch: int, block: int,
                context: float, dtype_bytes: int) -> dict:
    """Roofline floors [seconds] of one verify step and one draft step."""
    bw = ceilings["memory_bandwidth_bytes_per_s"]
    peak = ceilings["matmul_flop_per_s"]
    tb = target_bytes(cfg, dtype_bytes)
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    flops = 2 * tb["params"] * batch * block + 4 * batch * block * context * cfg.num_attention_heads \
        * cfg.head_dim * cfg.num_hidden_layers
    verify = max((tb["linear"] + tb["lm_head"] + kv) / bw, flops / peak)
    out = {"verify": verify, "verify_weight_read": (tb["linear"] + tb["lm_head"]) / bw,
           "ar_step": max((tb["linear"] + tb["lm_head"] + kv) / bw, 2 * tb["params"] * batch / peak),
           "draft": 0.0}
    if dcfg is not None:
        dlin = _linear_params(dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_hidden_layers,
                              dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim)
        dkv = batch * context * dcfg.num_hidden_layers * 2 * dcfg.num_key_value_heads * dcfg.head_dim * dtype_bytes
        dbytes = (dlin + cfg.hidden_size * cfg.vocab_size) * dtype_bytes + dkv
        dflops = 2 * (dlin + cfg.hidden_size * cfg.vocab_size) * batch * block
        out["draft"] = max(dbytes / bw, dflops / peak)
    return out


def record_threads(records: list[Record]) -> int | None:
    """The thread count the records were timed with (their ``threads``): the largest one recorded,
    None when no record carries it (records written before the field)."""
    known = [r.threads for r in records if getattr(r, "threads", None)]
    return max(known) if known else None


def threads_line(analysis: dict) -> str:
    """The report's line on the threads behind the floors and behind the measured steps."""
    ft, st = analysis.get("floor_threads"), analysis.get("step_threads")
    if analysis.get("device") == "cuda":
        return "floors: the GPU's ceilings"
    if ft is None:  # ceilings (or an analysis) from before thread counts were recorded
        return "floors: the device's ceilings (their thread count not recorded)"
    if st is None:
        return (f"floors: ceilings measured with {ft} thread(s); the steps' thread count not recorded "
                f"(records from before it was)")
    if ft != st:
        return (f"floors: ceilings measured with {ft} thread(s), none with the steps' {st}: the floors assume "
                f"{ft} thread(s)")
    return f"floors: ceilings measured with {ft} thread(s), as the steps were timed"


def idle_fraction(records: list[Record]) -> float:
    """Share of slot-time without a running request: 1 - sum(finish - arrival) / (c x wall), c =
    the records' concurrency, wall = last finish - first arrival; 0 without times."""
    if not records or any(getattr(r, "finish_s", None) is None or getattr(r, "arrival_s", None) is None
                          for r in records):
        return 0.0
    c = max(r.concurrency for r in records)
    wall = max(r.finish_s for r in records) - min(r.arrival_s for r in records)
    if wall <= 0:
        return 0.0
    busy = sum(r.finish_s - r.arrival_s for r in records)
    return max(0.0, 1.0 - busy / (c * wall))


def ar_seconds_per_token(ar: list[Record] | None) -> float | None:
    """Mean per-request seconds per token of AR records (at their concurrency); None without any."""
    rows = [r.decode_s / r.new_tokens for r in ar or [] if r.new_tokens]
    return sum(rows) / len(rows) if rows else None


def analyze(records: list[Record], cfg: TargetConfig, dcfg: DrafterConfig | None, ceilings: dict,
            dtype_bytes: int, block_size: int, ar: list[Record] | None = None) -> dict:
    """Rank the cost terms of an instrumented run (records with draft_s / verify_s).

    ``ar``: AR records of the same requests at the same concurrency; with them the ``speculation``
    term is the measured per-token time of the speculative step above AR's (what an AR step would
    save where it wins under load; 0 where speculating wins).

    Returns a dict with per-step measured times and floors [seconds], tau, and ``terms``: a list
    sorted by ``gap_s_per_token`` (largest first) of {term, measured_s_per_token,
    floor_s_per_token, gap_s_per_token, ratio_to_floor}.
    """
    steps = [r for r in records if r.verify_steps]
    n = len(steps)
    per = lambda f: sum(f(r) / r.verify_steps for r in steps) / n  # noqa: E731 mean per-step seconds
    draft, verify, total = per(lambda r: r.draft_s), per(lambda r: r.verify_s), per(lambda r: r.decode_s)
    stall = per(lambda r: getattr(r, "prefill_stall_s", 0.0) or 0.0)
    host = max(total - draft - verify - stall, 0.0)
    tau = sum(sum(r.committed_per_step) for r in steps) / sum(r.verify_steps for r in steps)
    batch = max(r.concurrency for r in steps)
    context = sum(r.prompt_tokens + r.new_tokens / 2 for r in steps) / n
    step_threads = record_threads(steps)
    device = ceilings.get("device", "cpu")
    ceil, floor_threads = for_threads(ceilings, step_threads if device == "cpu" else None)
    fl = step_floors(cfg, dcfg, ceil, batch, block_size, context, dtype_bytes)

    def term(name, measured, floor):
        gap = max(measured - floor, 0.0) / tau
        return {"term": name, "measured_s_per_token": measured / tau, "floor_s_per_token": floor / tau,
                "gap_s_per_token": gap, "ratio_to_floor": (measured / floor) if floor > 0 else math.inf}

    step = draft + verify + host
    terms = [
        {"term": "acceptance", "measured_s_per_token": step / tau, "floor_s_per_token": step / block_size,
         "gap_s_per_token": max(step / tau - step / block_size, 0.0), "ratio_to_floor": block_size / tau},
        term("verify", verify, fl["verify"]),
        term("draft", draft, fl["draft"]),
        term("host", host, 0.0),
    ]
    saving = fl["verify_weight_read"] * 0.25 / tau if dtype_bytes == 2 else 0.0
    terms.append({"term": "weight_bytes", "measured_s_per_token": fl["verify_weight_read"] / tau,
                  "floor_s_per_token": fl["verify_weight_read"] * 0.75 / tau, "gap_s_per_token": saving,
                  "ratio_to_floor": 4 / 3 if saving else 1.0})
    terms.append(term("prefill_stall", stall, 0.0))
    idle = idle_fraction(steps)
    terms.append({"term": "idle_slots", "measured_s_per_token": step * idle / tau, "floor_s_per_token": 0.0,
                  "gap_s_per_token": step * idle / tau, "ratio_to_floor": math.inf if idle else 1.0})
    ar_tok = ar_seconds_per_token(ar)
    if ar_tok is not None:
        spec_tok = total / tau
        terms.append({"term": "speculation", "measured_s_per_token": spec_tok, "floor_s_per_token": min(spec_tok, ar_tok),
                      "gap_s_per_token": max(spec_tok - ar_tok, 0.0), "ratio_to_floor": spec_tok / min(spec_tok, ar_tok)})
    terms.sort(key=lambda t: -t["gap_s_per_token"])
    return {"tau": tau, "block_size": block_size, "batch": batch, "context_tokens": context,
            "measured_step_s": {"draft": draft, "verify": verify, "host": host, "prefill_stall": stall,
                                "total": total},
            "verify_rows": batch * block_size, "idle_slot_fraction": idle,
            "floor_step_s": fl, "terms": terms, "step_threads": step_threads, "floor_threads": floor_threads,
            "device": device, "ceilings": ceil}


def report_text(analysis: dict, title: str) -> str:
    """A short plain-text report of an analysis (for humans and LLM prompts)."""
    ms = analysis["measured_step_s"]
    lines = [f"{title}", f"tau {analysis['tau']:.2f} at block {analysis['block_size']}, batch "
             f"{analysis['batch']}, context ~{analysis['context_tokens']:.0f} tokens",
             f"per step: draft {ms['draft'] * 1e3:.2f} ms, verify {ms['verify'] * 1e3:.2f} ms, "
             f"host {ms['host'] * 1e3:.2f} ms; verify floor {analysis['floor_step_s']['verify'] * 1e3:.3f} ms, "
             f"draft floor {analysis['floor_step_s']['draft'] * 1e3:.3f} ms",
             threads_line(analysis),
             "gaps (seconds per committed token lost to each term, largest first):"]
    for t in analysis["terms"]:
        ratio = "inf" if math.isinf(t["ratio_to_floor"]) else f"{t['ratio_to_floor']:.1f}x"
        lines.append(f"  {t['term']:<13} gap {t['gap_s_per_token'] * 1e3:8.3f} ms/token  "
                     f"(measured {t['measured_s_per_token'] * 1e3:.3f}, floor {t['floor_s_per_token'] * 1e3:.3f}, {ratio})")
    return "\n".join(lines) + "\n"
