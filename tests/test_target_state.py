"""Per-layer state commit/rollback on the hybrid (Gated DeltaNet + gated attention) and the
Muse-Glimmer-style (sliding window + global NoPE + softcap) tiny targets (CPU, seconds).

Speculative decoding driven straight through the runner contract (``verify``/``commit``) with
scripted drafts must equal greedy AR token for token: every draft rejected, random acceptance,
rows that accept nothing beside rows that accept everything (batch 3, prompts of different
lengths), and tree verification (accepted path off the spine). Batched AR equals per-request AR.
"""

from __future__ import annotations

import random

import pytest
import torch

from specpilot.engine.serve import ServeOptions
from specpilot.deployment import Deployment
from specpilot.engine.runner import TargetRunner
from specpilot.errors import SpecpilotError
from specpilot.models.config import TargetConfig
from specpilot.models.target import Transformer

V = 128


def hybrid_config(**over) -> TargetConfig:
    """A tiny Qwen3.5-style hybrid (3 GDN + 1 gated attention layer); ``over`` replaces fields."""
    return TargetConfig(**{**dict(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=12, rope_theta=10000.0,
                                  family="qwen3_5", architecture="Qwen3_5ForCausalLM",
                                  layer_types=["linear_attention"] * 3 + ["full_attention"],
                                  norm_offset=True, final_norm_offset=True, attn_gate="interleaved",
                                  partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
                                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4), **over})


def muse_config(**over) -> TargetConfig:
    """A tiny Muse-Glimmer-style target (3 sliding + 1 global NoPE layer); ``over`` replaces fields."""
    return TargetConfig(**{**dict(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=12, rope_theta=10000.0,
                                  family="muse_glimmer", architecture="MuseGlimmerForCausalLM", qk_norm=False,
                                  layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=6,
                                  layer_rope=[True, True, True, False], norm_offset=True, attn_gate="proj",
                                  qk_scaleless=True, qk_scale_factor=3.87, sandwich_norm=True, post_norm_eps=1e-8,
                                  embed_norm=True, final_logit_softcapping=20.0, output_multiplier=0.196), **over})


def build(cfg: TargetConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0.0, 0.3 if p.dim() > 1 else 0.2)
    return m.eval()


@pytest.fixture(scope="module", params=["hybrid", "muse"])
def target(request):
    return build(hybrid_config() if request.param == "hybrid" else muse_config())


_REF = {}


def reference(model):
    """Batched greedy AR of PROMPTS (computed once per target; the model is kept with its result, so
    a later model that reuses a freed one's id never gets its outputs)."""
    if id(model) not in _REF or _REF[id(model)][0] is not model:
        _REF[id(model)] = (model, ar(model, PROMPTS))
    return _REF[id(model)][1]


PROMPTS = [[3, 17, 5, 9, 11], list(range(20, 43)), [(7 * i) % V for i in range(40)]]
NEW = 28


def ar(model, prompts, new=NEW):
    r = TargetRunner(model, len(prompts), max(map(len, prompts)) + new + 20)
    logits, _, _ = r.prefill(prompts)
    last = logits.argmax(-1)
    out = [[t] for t in last.tolist()]
    for _ in range(new - 1):
        last = r.decode(last).argmax(-1)
        for b, t in enumerate(last.tolist()):
            out[b].append(t)
    return out


class Script:
    """Drafts from the AR reference: row b's draft j is right with probability p[b] while all
    earlier drafts were right (else a random wrong token)."""

    def __init__(self, ref, p, seed=0):
        self.ref, self.p, self.rng = ref, p, random.Random(seed)

    def drafts(self, b, pos, k):
        out = []
        for j in range(k):
            true = self.ref[b][pos + j] if pos + j < len(self.ref[b]) else 0
            ok = self.rng.random() < self.p[b]
            out.append(true if ok else (true + 1 + self.rng.randrange(V - 1)) % V)
        return out


def spec_chain(model, prompts, script, k, new=NEW):
    B = len(prompts)
    r = TargetRunner(model, B, max(map(len, prompts)) + new + k + 20)
    logits, _, _ = r.prefill(prompts)
    last = logits.argmax(-1).tolist()
    out = [[t] for t in last]
    accepted = []
    while min(len(o) for o in out) < new:
        drafts = [script.drafts(b, len(out[b]), k) for b in range(B)]
        block = torch.tensor([[last[b]] + drafts[b] for b in range(B)])
        logits, _ = r.verify(block)
        post = logits.argmax(-1).tolist()
        counts = []
        for b in range(B):
            if len(out[b]) >= new:
                counts.append(0)
                continue
            a = 0
            while a < k and drafts[b][a] == post[b][a]:
                a += 1
            accepted.append(a)
            out[b] += drafts[b][:a] + [post[b][a]]
            last[b] = post[b][a]
            counts.append(a + 1)
        r.commit(torch.tensor(counts))
    return [o[:new] for o in out], accepted


def spec_tree(model, prompts, script, k, branch=2, new=NEW):
    """Tree = drafted spine + ``branch`` leaves per spine node where one leaf is the true token
    when the spine is wrong there, so accepted paths leave the spine."""
    B = len(prompts)
    r = TargetRunner(model, B, max(map(len, prompts)) + new + 2 * k + 20)
    logits, _, _ = r.prefill(prompts)
    last = logits.argmax(-1).tolist()
    out = [[t] for t in last]
    par = [-1] + list(range(k)) + [i for i in range(k) for _ in range(branch)]
    parents = torch.tensor([par] * B)
    off_spine = 0
    while min(len(o) for o in out) < new:
        rows, truth = [], []
        for b in range(B):
            spine = script.drafts(b, len(out[b]), k)
            true = [script.ref[b][len(out[b]) + j] if len(out[b]) + j < len(script.ref[b]) else 0
                    for j in range(k)]
            leaves = []
            for i in range(k):  # leaves under node i (block index i) predict position i + 1
                alt = [(true[i] + 3 + j) % V for j in range(branch)]
                if spine[i] != true[i]:
                    alt[script.rng.randrange(branch)] = true[i]
                leaves += alt
            rows.append([last[b]] + spine + leaves)
            truth.append(true)
        tokens = torch.tensor(rows)
        logits, _ = r.verify(tokens, parents)
        post = logits.argmax(-1).tolist()
        counts, paths = [], []
        for b in range(B):
            children = {}
            for i, p in enumerate(par):
                if p >= 0:
                    children.setdefault(p, []).append(i)
            node, path = 0, [0]
            while True:
                nxt = next((c for c in children.get(node, []) if rows[b][c] == post[b][node]), None)
                if nxt is None:
                    break
                path.append(nxt)
                node = nxt
            if len(out[b]) >= new:
                counts.append(0), paths.append([0] * (k + 1))
                continue
            off_spine += any(p > k for p in path)
            out[b] += [rows[b][i] for i in path[1:]] + [post[b][node]]
            last[b] = post[b][node]
            counts.append(len(path))
            paths.append(path + [0] * (k + 1 - len(path)))
        r.commit(torch.tensor(counts), path_slots=torch.tensor(paths))
    return [o[:new] for o in out], off_spine


def test_batched_ar_equals_single(target):
    together = reference(target)
    alone = [ar(target, [p])[0] for p in PROMPTS]
    assert together == alone


def test_every_draft_rejected(target):
    ref = reference(target)
    out, acc = spec_chain(target, PROMPTS, Script(ref, [0.0, 0.0, 0.0]), k=7)
    assert max(acc) == 0
    assert out == ref


def test_random_acceptance(target):
    ref = reference(target)
    out, acc = spec_chain(target, PROMPTS, Script(ref, [0.7, 0.8, 0.6], seed=1), k=5)
    assert 0 < sum(acc) / len(acc) < 5 and max(acc) >= 3
    assert out == ref


def test_zero_accepted_rows_beside_full_rows(target):
    ref = reference(target)
    out, acc = spec_chain(target, PROMPTS, Script(ref, [0.0, 1.0, 0.0], seed=2), k=6)
    assert 0 in acc and 6 in acc
    assert out == ref


def test_tree_verification_equals_ar(target):
    ref = reference(target)
    out, off_spine = spec_tree(target, PROMPTS, Script(ref, [0.6, 0.7, 0.5], seed=3), k=4)
    assert off_spine > 0  # some accepted paths left the spine (KV compaction + GDN path replay used)
    assert out == ref


def test_rollback_of_committed_tokens_refused_on_stateful_target(target):
    r = TargetRunner(target, 1, 64)
    r.prefill([PROMPTS[0]])
    r.verify(torch.tensor([[1, 2, 3]]))
    r.rollback(r.length.clone())  # dropping an uncommitted verify is fine
    with pytest.raises(SpecpilotError, match="roll back"):
        r.rollback(r.length - 1)


def test_verify_wider_than_ring_refused():
    m = build(muse_config())
    r = TargetRunner(m, 1, 400)
    r.prefill([PROMPTS[1]])
    with pytest.raises(SpecpilotError, match="ring"):
        r.verify(torch.zeros(1, 65, dtype=torch.long))


def test_state_bytes_per_request_27b_shape():
    """Memory per request of the rollback choice at the Qwen3.8-27B shape: the live GDN state only
    (conv K-1 columns + fp32 recurrent state); checkpoint + replay keeps no per-position copies."""
    from specpilot.models.random_checkpoint import target_config

    cfg = target_config("qwen3.8-27b")
    with torch.device("meta"):
        m = Transformer(cfg)
    m.setup_cache(1, 4096, dtype=torch.bfloat16)
    b = m.state_bytes_per_row()
    rec = 48 * 48 * 128 * 128 * 4
    conv = 48 * (2 * 16 * 128 + 48 * 128) * 3 * 2
    assert b["gdn"] == rec + conv  # 144 MiB + 2.8 MiB
    assert b["kv"] == 16 * 2 * 4 * 4096 * 256 * 2


def test_closed_loop_refills_equal_each_request_alone(target):
    """Continuous batching refills a finished request's slot (its row emptied, recurrent state
    zeroed): more requests than slots give each request's AR output alone, on every layer type."""
    from specpilot.engine.config import EngineSpec
    from specpilot.engine.serve import serve

    rows = [{"request_id": f"gsm8k/{i:04d}", "benchmark": "gsm8k", "prompt_ids": p}
            for i, p in enumerate(PROMPTS + PROMPTS[::-1])]
    meta = {"deployment": "t", "target": "t", "drafter": "none", "gpu": "cpu"}
    recs = serve(EngineSpec("ar"), Deployment.of(target, None), rows, 12, 2, meta, ServeOptions(progress=False, warmup=False))
    alone = [ar(target, [r["prompt_ids"]], 12)[0] for r in rows]
    assert [r.output_ids for r in recs] == alone
