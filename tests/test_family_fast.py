"""The fast path of the hybrid (Gated DeltaNet + gated attention) and Muse-Glimmer-style (sliding
window over a wrapping ring + global NoPE + sandwich norms + softcap) targets, under Triton's CPU
interpreter: :class:`~specpilot.fastpath.family.FastFamilyTarget` driven through the runner
(row prefill, chain verify + commit replay of the accepted tokens, decode) against the eager
forward on a copy of the same model, fp32: logits and the committed states agree at every step,
and greedy speculative decoding with scripted drafts (some rows accepting nothing, some
everything) equals greedy AR token for token. A negative control (the commit replay switched
off) must break the state parity.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CHECK = r'''
import copy, random
from specpilot.engine.backend import choose_backend
from specpilot.engine.runner import TargetRunner
from specpilot.models.config import TargetConfig
from specpilot.models.target import Transformer

from test_target_state import build, hybrid_config, muse_config

V = 96
# the Triton kernels tile by powers of two; one layer of each kind (the family step's per-layer code
# is the same for every layer of a kind, and the interpreter's cost grows with the layers)
POW2 = dict(vocab_size=V, hidden_size=64, head_dim=16, num_hidden_layers=2)
def hybrid():
    return hybrid_config(**POW2, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16,
                         linear_value_head_dim=16)
def muse():
    return muse_config(**POW2, layer_types=["sliding_attention", "full_attention"], layer_rope=[True, False],
                       sliding_window=8)
def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))

out = {}
S, WIDTH = 64, 6
prompts = [[(5 * i + 3) % V for i in range(13)], [(7 * i + 1) % V for i in range(6)]]
for kind, cfg in (("hybrid", hybrid()), ("muse", muse())):
    for control in ((False, True) if kind == "hybrid" else (False,)):
        eager = build(cfg)
        fastm = copy.deepcopy(eager)
        re = TargetRunner(eager, 2, S)
        rf = fast_runner(fastm, 2, S)
        eager.setup_cache(2, S, verify_width=WIDTH)  # rings of window + WIDTH slots: they wrap
        fastm.setup_cache(2, S, verify_width=WIDTH)
        if control:
            rf.steps.fast.commit_recurrent = lambda counts: None
        le, _, _ = re.prefill(prompts)
        lf, _, _ = rf.prefill(prompts)
        err, st = [rel(lf, le)], []
        rng = random.Random(1)
        for step in range(5):
            block = torch.tensor([[rng.randrange(V) for _ in range(WIDTH)] for _ in range(2)])
            ve, _ = re.verify(block)
            vf, _ = rf.verify(block)
            err.append(rel(vf, ve))
            counts = torch.tensor([rng.randrange(WIDTH + 1), rng.randrange(WIDTH + 1)])
            re.commit(counts)
            rf.commit(counts)
            tok = le.argmax(-1) if step % 2 else torch.tensor([rng.randrange(V), rng.randrange(V)])
            de = re.decode(tok)
            df = rf.decode(tok)
            err.append(rel(df, de))
            le = de
            if eager.state.gdn is not None:
                st.append(rel(fastm.state.gdn.rec, eager.state.gdn.rec))
                st.append(rel(fastm.state.gdn.conv, eager.state.gdn.conv))
        out[f"{kind}{'_control' if control else ''}"] = {"logits": max(err), "state": max(st) if st else 0.0,
                                                         "ring_R": eager.state.ring.R if eager.state.ring is not None else 0}

# row independence: a verify of WIDTH tokens gives bit for bit the logits of decoding them one by one
for kind, cfg in (("hybrid", hybrid()), ("muse", muse())):
    m = build(cfg)
    r = fast_runner(m, 2, S)
    m.setup_cache(2, S, verify_width=WIDTH)
    ids = torch.tensor([[(3 * i + 1) % V for i in range(WIDTH)], [(11 * i + 2) % V for i in range(WIDTH)]])
    long = [[(5 * i + 3) % V for i in range(29)], [(7 * i + 1) % V for i in range(17)]]  # past the window
    r.prefill(long)
    dec = torch.stack([r.decode(ids[:, t]).clone() for t in range(WIDTH)], 1)
    r.prefill(long)
    ver, _ = r.verify(ids)
    out[f"{kind}_verify_vs_decode"] = float((ver - dec).abs().max())

# greedy speculative decoding with scripted drafts through the fast runner == greedy AR
from specpilot.engine.verify import accept_greedy
for kind, cfg in (("hybrid", hybrid()), ("muse", muse())):
    m = build(cfg)
    r = fast_runner(m, 2, S)
    m.setup_cache(2, S, verify_width=WIDTH)
    last, _, _ = r.prefill(prompts)
    ar = [[], []]
    cur = last.argmax(-1)
    for _ in range(16):
        for b in range(2):
            ar[b].append(int(cur[b]))
        cur = r.decode(cur).argmax(-1)
    r.rollback(torch.zeros(2, dtype=torch.long))
    last, _, _ = r.prefill(prompts)
    got = [[int(x)] for x in last.argmax(-1)]
    rng = random.Random(2)
    while min(len(g) for g in got) < 16:
        block = []
        for b in range(2):
            ref = ar[b][len(got[b]) - 1:len(got[b]) - 1 + WIDTH] + [0] * WIDTH
            row = [got[b][-1]]
            k = 0 if b == 0 and rng.random() < 0.5 else rng.randrange(WIDTH)  # row 0 often accepts nothing
            for j in range(1, WIDTH):
                row.append(ref[j] if j <= k else (ref[j] + 1) % V)
            block.append(row)
        block = torch.tensor(block)
        logits, _ = r.verify(block)
        acc, bonus = accept_greedy(block[:, 1:], logits)
        counts = acc + 1
        r.commit(counts)
        for b in range(2):
            got[b] += [int(t) for t in block[b, 1:int(acc[b]) + 1]] + [int(bonus[b])]
    out[f"{kind}_spec_equals_ar"] = all(got[b][:16] == ar[b] for b in range(2))
print("RESULT " + json.dumps(out))
'''


def test_family_fast_path_matches_eager_interpreted(tmp_path):
    """Fast hybrid / Muse step == eager forward (fp32) through prefill, verify + commit, decode;
    the ring wraps (window 8, reserve 6); scripted speculative decoding equals AR."""
    from triton_interp import run_interpreted

    res = run_interpreted(tmp_path / "check.py", CHECK, __import__("pathlib").Path(__file__).resolve().parents[1])
    for kind in ("hybrid", "muse"):
        assert res[kind]["logits"] < 1e-4, res
        assert res[kind]["state"] < 1e-4, res
        assert res[f"{kind}_spec_equals_ar"], res
        assert res[f"{kind}_verify_vs_decode"] == 0.0, res  # bit for bit (row independence)
    assert res["muse"]["ring_R"] == 14  # window 8 + reserve 6 < max_seq 64: the ring wraps
    # negative control: without the commit replay the recurrent state goes stale
    assert res["hybrid_control"]["state"] > 1e-2 and res["hybrid_control"]["logits"] > 1e-2, res


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("shape", ["tiny-hybrid", "tiny-muse"])
def test_family_fast_path_on_cuda(shape):
    """On a GPU: the runner takes the family fast path under CUDA graphs; speculative decoding
    (a random DFlash drafter: mostly rejected drafts) equals the fast path's own greedy AR token
    for token at batch 2 (tiny-muse's ring of window 64 + 64 wraps at 256 slots), and a verify of
    24 tokens gives bit for bit the logits of decoding them one by one (row independence; the
    eager bf16 forward is not a reference here: random weights amplify its rounding, and fp32
    parity with it is the interpreted test above)."""
    import torch

    from specpilot.engine.loop import generate, generate_ar
    from specpilot.drafters.dflash import DFlashProposer
    from specpilot.engine.backend import choose_backend
    from specpilot.engine.runner import TargetRunner
    from specpilot.models.random_checkpoint import build_drafter, build_target

    target = build_target(shape, device="cuda", dtype=torch.bfloat16, seed=3)
    drafter = build_drafter(shape, device="cuda", dtype=torch.bfloat16, seed=3)
    prompts = [list(range(3, 90)), list(range(100, 130))]
    fast = TargetRunner(target, 2, 256, backend=choose_backend(target, None, "triton"))
    assert fast.steps is not None and type(fast.steps.fast).__name__ == "FastFamilyTarget"
    ar = generate_ar(fast, prompts, 48)
    cap = tuple(drafter.config.target_layer_ids)
    spec = generate(TargetRunner(target, 2, 256, cap, backend=choose_backend(target, None, "triton")),
                    DFlashProposer(drafter, block_size=8), prompts, 48)
    same = [a.output_ids == b.output_ids for a, b in zip(spec, ar)]
    r = TargetRunner(target, 2, 256, backend=choose_backend(target, None, "triton"))
    ids = torch.tensor([p[:24] for p in (list(range(200, 300)), list(range(400, 500)))], device="cuda")
    r.prefill([list(range(5, 60)), list(range(7, 40))])
    dec = torch.stack([r.decode(ids[:, t]).clone() for t in range(24)], 1)
    r.prefill([list(range(5, 60)), list(range(7, 40))])
    ver, _ = r.verify(ids)
    diff = float((ver.float() - dec.float()).abs().max())
    assert all(same) and diff == 0.0, (same, diff)
