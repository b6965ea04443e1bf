"""The embedded tiny deployment meets the engine-core issue's bar (slow: uses the full build).

On 20 gsm8k test prompts, 128 new tokens, block size 8: stock tau >= 2.5 and >= 1.2x the prompt
lookup drafter's tau; 0 token-forcing violations; the target's greedy continuations have a
distinct-4-gram ratio >= 0.3 (a real little language model, not a loop).
"""

from __future__ import annotations

import json

import pytest
import torch

from specpilot.engine.serve import ServeOptions
from specpilot.deployment import Deployment
from specpilot.prompts import write_prompt_file
from specpilot.engine.config import EngineSpec
from specpilot.engine.serve import serve
from specpilot.forcing import check
from specpilot.models.loading import load_drafter, load_target

pytestmark = pytest.mark.slow


def distinct4(ids: list[int]) -> float:
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / len(grams)


def test_distinct4_counts_repeats():
    assert distinct4([1, 2, 3, 4, 5]) == 1.0
    assert distinct4([1, 2, 3, 4] * 10) == pytest.approx(4 / 37)


@pytest.fixture(scope="module")
def results(tiny_deployment, data_dir, tmp_path_factory):
    torch.set_num_threads(1)
    prompts = write_prompt_file("gsm8k", tiny_deployment / "target", tmp_path_factory.mktemp("p") / "g.jsonl", 20,
                                data_dir=data_dir)
    target = load_target(tiny_deployment / "target")
    drafter = load_drafter(tiny_deployment / "drafter-dflash")
    meta = {"deployment": "tiny", "target": "tiny", "drafter": "dflash", "gpu": "cpu"}
    out = {e: serve(EngineSpec(e, 8), Deployment.of(target, drafter if e == "stock" else None), prompts, 128, 1, meta, ServeOptions(progress=False)) for e in ("ar", "stock", "lookup")}
    out["prompts"] = {p["request_id"]: p["prompt_ids"] for p in prompts}
    out["target"] = target
    return out


def tau(records):
    return sum(sum(r.committed_per_step) for r in records) / sum(r.verify_steps for r in records)


def test_stock_tau_and_lookup_floor(results, tiny_deployment):
    t_stock, t_lookup = tau(results["stock"]), tau(results["lookup"])
    ar_s = sum(r.decode_s for r in results["ar"])
    st_s = sum(r.decode_s for r in results["stock"])
    summary = {"stock_tau": t_stock, "lookup_tau": t_lookup, "stock_over_lookup": t_stock / t_lookup,
               "stock_speedup_sum_time": ar_s / st_s,
               "distinct4": [distinct4(r.output_ids) for r in results["ar"]],
               "build": json.loads((tiny_deployment / "build.json").read_text())}
    print(json.dumps(summary, indent=1))
    assert t_stock >= 2.5
    assert t_stock >= 1.2 * t_lookup


def test_token_forcing_zero_violations(results):
    for eng in ("stock", "lookup"):
        v = check(results[eng], results["ar"], results["prompts"], results["target"], 1e-3)
        assert v["violations"] == 0 and v["tokens_checked"] == 20 * 128


def test_target_is_a_language_model_not_a_loop(results):
    ratios = [distinct4(r.output_ids) for r in results["ar"]]
    assert sum(ratios) / len(ratios) >= 0.3


def test_teacher_cache_equals_the_targets_forward_on_each_batch():
    """The drafter stages' cached target features/logits are what a per-batch forward gives."""
    import random

    from specpilot.models.qwen3 import Transformer
    from specpilot.tiny.build import QUICK, init_weights
    from specpilot.tiny.targets import tiny_target_config
    from specpilot.tiny.train import TeacherCache

    torch.manual_seed(0)
    target = Transformer(tiny_target_config("dense", QUICK, 300))
    init_weights(target)
    rng = random.Random(0)
    seqs = [(p, [rng.randrange(300) for _ in range(p + rng.randrange(5, 20))]) for p in (7, 3, 12, 5, 9)]
    cache = TeacherCache(target, seqs, (1, 3), logits=True, batch=2)
    pick = [4, 0, 2]
    L = max(len(seqs[i][1]) for i in pick)
    feats, logits = cache.batch(pick, seqs, L)
    toks = torch.tensor([seqs[i][1] + [0] * (L - len(seqs[i][1])) for i in pick])
    with torch.no_grad():
        ref_logits, ref_feats = target.forward_causal(toks, capture=(1, 3))
    for row, i in enumerate(pick):
        p, s = seqs[i]
        torch.testing.assert_close(feats[row, :len(s)], ref_feats[row, :len(s)], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[row, p:len(s)], ref_logits[row, p:len(s)], rtol=1e-5, atol=1e-5)
        assert (feats[row, len(s):] == 0).all() and (logits[row, :p] == 0).all()


def test_train_precision_resolves_and_bf16_training_learns():
    """``auto`` resolves to what oneDNN supports; an unknown precision is refused by name; a bf16-
    autocast run of the target loop lowers the loss like fp32 does, and the weights stay fp32."""
    from specpilot.models.qwen3 import Transformer
    from specpilot.tiny.build import QUICK, init_weights
    from specpilot.tiny.targets import tiny_target_config
    from specpilot.tiny.train import resolve_precision, train_target

    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert resolve_precision("auto") == ("bf16" if native else "fp32")
    assert resolve_precision("fp32") == "fp32" and resolve_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match="'fp16'"):
        resolve_precision("fp16")
    stream = torch.arange(4000) % 37  # a periodic stream: learnable in a few steps
    final = {}
    for prec in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = Transformer(tiny_target_config("dense", QUICK, 64))
        init_weights(model)
        losses = train_target(model, stream, 40, 4, 32, lr=5e-3, log=lambda m: None, precision=prec)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        final[prec] = sum(losses[-5:]) / 5
        assert final[prec] < 0.5 * losses[0], (prec, losses[0], final[prec])
    assert final["bf16"] != final["fp32"]  # the autocast really ran in another precision
