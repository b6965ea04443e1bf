"""Lossless 12-bit weights in the engine's fast path (specpilot.w12.planes, specpilot.fastpath.w12,
the ``W12`` loader of specpilot.kernels.step._linear_kernel).

The claim under test: the 12-bit loader gives the bf16 kernel's output bit for bit, because it
feeds the same ``tl.dot`` the same bf16 values in the same K order. Under Triton's CPU interpreter
(a subprocess, as tests/test_gpu_path.py runs it) each role layout at M = 1, 4, 16, 64 and whole
tiny dense, hybrid and Muse steps are compared as int16 bits, with two negative controls that must
fail the same comparison: another K tiling (the interpreter sums each K tile as one block, so a
different BK changes the order of the sum) and one corrupted plane byte. On the GPU the same
comparison is scripts/gpu_w12.sh's. The CPU parts (the planes, the conversion of the tiny
families through the converter's checkpoints, the choice format, the wiring) run without Triton.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from specpilot.errors import SpecpilotError
from specpilot.fastpath import w12 as fw
from specpilot.models.random_checkpoint import build_target
from specpilot.w12.format import GROUP, pack
from specpilot.w12.planes import decode_planes, planes_of, tile_planes

REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def planted(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """N(0, 0.02) bf16 with every kind of escape planted: zeros, subnormals, outliers, inf, nan."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    special = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 300.0, -2e4, float("inf"), float("nan"), 1e-30, 65504.0])
    idx = torch.randperm(n * k, generator=g)[: special.numel() * 3]
    w.view(-1)[idx] = special.repeat(3)[: idx.numel()].to(torch.bfloat16)
    w[0, :GROUP] = 0.0  # a whole group of escapes
    return w


@pytest.mark.parametrize("n, k", [(64, 256), (33, 136), (1, 8), (7, 1024)])
def test_tile_planes_decode_bit_exact(n, k):
    w = planted(n, k, seed=n + k)
    p = planes_of(w)
    assert torch.equal(bits(decode_planes(p)), bits(w))
    esc = p.codes == 0  # escape groups: code word 0, the others' codes all 1..15
    assert int(esc.sum()) == p.escape_groups > 0 and p.side.numel() == 4 * p.escape_groups
    plain = p.codes[~esc].to(torch.int64) & 0xFFFFFFFF
    assert all(bool((((plain >> (4 * i)) & 0xF) >= 1).all()) for i in range(8))
    assert p.nbytes() == n * k * 3 // 2 + 16 * p.escape_groups
    r = p.rows(1, n) if n > 1 else p.rows(0, 1)  # row views decode to the rows
    assert torch.equal(bits(decode_planes(r)), bits(w[1:] if n > 1 else w))


def test_tile_planes_of_plain_weights_have_few_escape_groups():
    p = planes_of((torch.randn(512, 1024, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16))
    assert p.escape_groups / (512 * 1024 / GROUP) < 3e-3  # ~1.5e-4 escaped weights, 8 per group
    assert tile_planes(pack(torch.zeros(8, 16, dtype=torch.bfloat16))).escape_groups == 16


def test_planes_refuse_other_dtypes():
    with pytest.raises(SpecpilotError, match="bfloat16"):
        planes_of(torch.zeros(8, 16, dtype=torch.float16))


def test_choice_parse_round_trip_and_errors():
    c = fw.parse_choice({"qkv": "w12", "o": {"16": "w12:bn32-bk256-w4-s4", "64": "bf16"}, "down": "bf16"})
    assert set(c) == {"qkv", "o"}  # an all-bf16 role is no w12 role
    assert fw.choice_json(c) == {"qkv": "w12", "o": {"16": "w12:bn32-bk256-w4-s4", "64": "bf16"}}
    assert fw.parse_choice(fw.choice_json(c)) == c
    assert fw.runs_w12(c["o"], 1) and fw.runs_w12(c["o"], 16) and not fw.runs_w12(c["o"], 17)
    assert not fw.runs_w12(c["o"], 1000) and fw.runs_w12(c["qkv"], 1000)
    assert fw.tier(c["o"], 3)[1].key() == "bn32-bk256-w4-s4" and fw.tier(c["qkv"], 3)[1] is None
    assert fw.lean(c["qkv"]) and not fw.lean(c["o"])
    assert fw.parse_choice(None) == {} and set(fw.every_role()) == set(fw.ROLES)
    for bad, what in (({"lm_head": "w12"}, "role 'lm_head'"), ({"o": "w13"}, "'w13'"),
                      ({"o": {"0": "w12"}}, "row count"), ({"o": "w12:bk1"}, "bad linear config"), ([], "object")):
        with pytest.raises(SpecpilotError, match=what):
            fw.parse_choice(bad)


def _logits(model, tokens):
    """The eager, cache-free forward's logits (the linear layers' own forward: decoded 12-bit roles)."""
    with torch.inference_mode():
        return model.forward_causal(tokens)[0]


@pytest.mark.parametrize("shape", ["tiny", "tiny-hybrid", "tiny-muse"])
def test_prepare_is_lossless_for_every_family(shape):
    """Every role of a tiny dense / hybrid / Muse target converted in place: its eager forward
    (the 12-bit roles decoded) gives the bf16 model's logits bit for bit, the bf16 copies of roles
    that run w12 at every M are freed, a role with a bf16 bucket keeps its copy."""
    model = build_target(shape, dtype=torch.bfloat16, seed=3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, tokens)
    choice = fw.parse_choice({"qkv": "w12", "o": "w12", "gate_up": {"4": "w12", "64": "bf16"}, "down": "w12"})
    stats = fw.prepare(model, choice)
    assert torch.equal(bits(_logits(model, tokens)), bits(ref))
    layer = model.model.layers[0]
    fused = layer.fused_in if layer.kind == "linear_attention" else layer.fused_qkv
    assert isinstance(fused, fw.W12Weight) and fused.dense is None
    assert isinstance(layer.fused_gate_up, fw.W12Weight) and layer.fused_gate_up.dense is not None  # bf16 at M > 4
    assert isinstance(layer.mlp.down_proj, fw.PlanesLinear) and isinstance(layer.mlp.down_proj.weight, fw.W12Weight)
    n = model.config.num_hidden_layers
    assert stats["weights_converted"] == 4 * n and stats["bf16_bytes_freed"] > 0
    assert fw.w12_bytes(model) > 0 and type(model.lm_head) is nn.Linear  # the LM head stays bf16
    assert fw.prepare(model, choice)["weights_converted"] == 4 * n  # prepared before: nothing changes
    assert torch.equal(bits(_logits(model, tokens)), bits(ref))


@pytest.mark.parametrize("shape", ["tiny-hybrid", "tiny-muse"])
def test_converter_checkpoint_of_the_families_loads_and_prepares_exactly(shape, tmp_path):
    """``specpilot random-checkpoint`` of a family shape in bf16, ``specpilot convert-w12``, the
    w12 checkpoint loaded into a fresh model (``W12Linear`` layers), then prepared for the fast path:
    the eager logits equal the bf16 checkpoint's at every step."""
    from specpilot.cli import main
    from specpilot.models.loading import load_target
    from specpilot.w12 import W12Linear, load_w12_state

    src, dst = tmp_path / "bf16", tmp_path / "w12"
    assert main(["random-checkpoint", "--shape", shape, "--out", str(src), "--drafter-out", str(tmp_path / "d"),
                 "--dtype", "bf16"]) == 0
    assert main(["convert-w12", "--src", str(src), "--dst", str(dst)]) == 0
    ref_model = load_target(src, dtype=torch.bfloat16)
    tokens = torch.randint(0, ref_model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(2))
    ref = _logits(ref_model, tokens)
    model = build_target(shape, dtype=torch.bfloat16, seed=99)  # other weights, same shapes
    load_w12_state(model, dst / "model.w12.safetensors")
    assert any(isinstance(m, W12Linear) for m in model.modules())
    assert torch.equal(bits(_logits(model, tokens)), bits(ref))
    fw.prepare(model, fw.every_role())
    assert not any(isinstance(m, W12Linear) for m in model.model.layers.modules())
    assert torch.equal(bits(_logits(model, tokens)), bits(ref))


def test_backend_prepares_and_forcing_takes_the_triton_teacher_for_w12():
    """choose_backend with a w12 choice converts the target (any path; eager on the CPU); a cell of
    w12 engine configs is token-forced through the Triton step (the same bits as bf16) unless it
    turned the fast path off."""
    from specpilot.engine.backend import Backend, choose_backend

    model = build_target("tiny", dtype=torch.bfloat16)
    b = choose_backend(model, graphs=False, w12_choice=fw.every_role())
    assert b.path == "eager" and b.w12 == {r: "w12" for r in fw.ROLES} and b.w12_stats["weights_converted"] == 24
    assert isinstance(model.model.layers[0].self_attn.o_proj, fw.PlanesLinear)
    fake = Backend(model, "triton-dense", "test", True)
    assert fake.teacher_forced_path([{"weight_format": "w12"}]) == "triton"
    assert fake.teacher_forced_path([{"weight_format": "w12", "w12_fast": False}]) == "eager"
    assert fake.teacher_forced_path([{}, {"weight_format": "bf16"}]) == "triton"
    with pytest.raises(SpecpilotError, match="bf16 weights"):
        choose_backend(build_target("tiny", dtype=torch.float32), graphs=False, w12_choice=fw.every_role())


def test_w12_choice_for_engine_configs():
    from specpilot.engine.config import EngineConfig
    from specpilot.kernels_build import agent_w12_choice, w12_choice_for

    w12, bf16 = EngineConfig.parse({"weight_format": "w12"}), EngineConfig.parse({})
    assert w12_choice_for({}, bf16) is None
    assert w12_choice_for({}, w12) == fw.every_role()  # untuned: every role, every M
    tuned = {"w12_choice": {"down": {"1": "w12", "64": "bf16"}}}
    assert w12_choice_for(tuned, w12) == fw.parse_choice(tuned["w12_choice"])
    assert w12_choice_for(tuned, EngineConfig.parse({"weight_format": "w12", "w12_fast": False})) is None
    assert agent_w12_choice({"w12_choice": {"o": {"16": "w12"}}}, "x") == {"o": {"16": "w12"}}
    with pytest.raises(SpecpilotError, match="x: w12_choice"):
        agent_w12_choice({"w12_choice": {"o": "fast"}}, "x")


@needs_triton
def test_machine_code_of_the_loaders():
    """sm_90 SASS compiled here: the 12-bit loader keeps the bf16 kernel's MMA and dot operand
    layout (kWidth: the K order inside each MMA) and costs a few instructions per weight more."""
    from specpilot.fastpath.tables import LinearConfig
    from specpilot.kernels import inspect

    try:
        c = LinearConfig.parse("bn32-bk256-w4-s4")
        b, w = inspect.loop_profile(c, False), inspect.loop_profile(c, True)
    except SpecpilotError as e:
        pytest.skip(str(e))
    assert (b["mma"], b["kwidth"]) == (w["mma"], w["kwidth"]) == ("v2", "2")
    assert w["decode_run"] % 8 == 0 and w["decode_run"] >= 8 and b["decode_run"] is None  # whole groups per thread
    assert w["opcodes"].get("HMMA") == b["opcodes"].get("HMMA") > 0
    assert w["opcodes"].get("PRMT", 0) >= 4 * 8  # 4 byte permutes per group of 8, 8 groups per thread
    assert b["thread_instructions_per_weight"] + 1.5 < w["thread_instructions_per_weight"] < 6.0


CHECK = r'''
torch.set_grad_enabled(False)
from specpilot.fastpath.tables import LinearConfig
from specpilot.kernels import step as S
from specpilot.w12.planes import planes_of
from specpilot.bench._engine import dry_target
from specpilot.fastpath import w12 as fw
from specpilot.fastpath.dense import FastTarget
from specpilot.fastpath.family import FastFamilyTarget
from specpilot.engine.backend import Backend
from specpilot.engine.runner import TargetRunner
from specpilot.fastpath.graphs import StepGraphs
from specpilot.tuning.w12 import plant_escapes

def eq(a, b):
    return bool(torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16)))


res = {"linear": {}, "models": {}}
g = torch.Generator().manual_seed(0)
N, K = 48, 256
w = (torch.randn(2 * N, K, generator=g) * 0.02).to(torch.bfloat16)
w[0, :4] = torch.tensor([0.0, 100.0, -1e-30, 37.0])
w[70, 9] = -300.0
wh = w[:N].contiguous()
p, ph = planes_of(w), planes_of(wh)
res["decode_exact"] = eq(S.decode(p), w) and p.escape_groups >= 2
nw = (1 + 0.1 * torch.randn(K, generator=g)).to(torch.bfloat16)
for M in (1, 4, 16, 64):
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    r = torch.randn(M, N, generator=g).to(torch.bfloat16)
    c = LinearConfig(16, 128, 4, 1, bm=64 if M > 16 else 16)
    o1, o2 = r.clone(), r.clone()
    S.linear(x, wh, o1, cfg=c, residual=o1)
    S.linear(x, ph, o2, cfg=c, residual=o2)
    f32 = lambda: torch.empty(M, N)  # fp32 outputs: the accumulators compared before any bf16 rounding
    res["linear"][str(M)] = {
        "plain": eq(S.linear(x, wh, f32(), cfg=c).view(torch.int32), S.linear(x, ph, f32(), cfg=c).view(torch.int32)),
        "norm": eq(S.linear(x, wh, cfg=c, norm=nw), S.linear(x, ph, cfg=c, norm=nw)),
        "residual": eq(o1, o2),
        "swiglu": eq(S.linear(x, w, cfg=c, norm=nw, swiglu=True), S.linear(x, p, cfg=c, norm=nw, swiglu=True))}
    if M == 16:  # negative controls: another K tiling; one plane byte changed
        ref = S.linear(x, wh, f32(), cfg=c).view(torch.int32)
        res["other_bk_equal"] = eq(ref, S.linear(x, ph, f32(), cfg=LinearConfig(16, 64, 4, 1)).view(torch.int32))
        bad = planes_of(wh)
        bad.mant[3, 17] ^= 1
        res["corrupted_equal"] = eq(ref, S.linear(x, bad, f32(), cfg=c).view(torch.int32))

class Uncaptured(StepGraphs):
    def run(self, tokens, start, capture=(), tree=None, write=False):
        return self.step(tokens, start, capture, tree, write)

def steps(model, choice):
    step = FastTarget(model) if model.config.is_dense else FastFamilyTarget(model)
    if choice:
        step.use_w12(choice)
    b = Backend(model, "triton-dense" if model.config.is_dense else "triton-family", "test", False, "triton",
                Uncaptured(model, step))
    run = TargetRunner(model, 1, 32, (), b)
    out = [run.prefill([list(range(3, 11))])[0]]
    for m in (1, 4):
        out.append(run.verify(torch.arange(m).view(1, m) + 20)[0])
    model.state = None
    return out

for shape in ("tiny", "tiny-hybrid", "tiny-muse"):
    model = dry_target(shape, layers=2 if shape == "tiny" else 4, seed=1)
    plant_escapes(model.model.layers[0].mlp.down_proj.weight, seed=2)
    for prm in model.parameters():  # the interpreter computes in fp32: matrices holding bf16 values
        if prm.dim() == 2:
            prm.data.copy_(prm.data.to(torch.bfloat16))
    ref = steps(model, None)
    if shape == "tiny":  # negative control: the 12-bit loader with another K tiling of down (K = 128)
        other = {"down": ((1 << 30, "w12", LinearConfig(32, 64, 4, 3)),)}
        import copy
        res["models"]["tiny_other_bk_equal"] = all(eq(a, b) for a, b in zip(ref, steps(copy.deepcopy(model), other)))
    got = steps(model, fw.every_role())
    res["models"][shape] = [eq(a, b) for a, b in zip(ref, got)]

from specpilot.bench._engine import dry_drafter
from specpilot.fastpath.drafter import FastDrafter

tgt = dry_target("tiny", layers=2, seed=1)
drafter = dry_drafter(tgt, "tiny", block_size=4, seed=1)
for prm in list(tgt.parameters()) + list(drafter.parameters()):
    if prm.dim() == 2:
        prm.data.copy_(prm.data.to(torch.bfloat16))
feats = torch.randn(1, 6, drafter.fc.weight.shape[1], generator=torch.Generator().manual_seed(4))

def drafts(choice):
    fd = FastDrafter(drafter, tgt.model.embed_tokens.weight, tgt.lm_head.weight)
    if choice:
        fd.use_w12(choice)
    drafter.setup_cache(1, 32)
    fd.add_context(feats, torch.zeros(1, dtype=torch.long))
    toks = fd.draft(torch.tensor([5]), torch.tensor([6]), 4)
    return toks, next(ws.logits for ws in fd._ws.values()).clone()

(t1, l1), (t2, l2) = drafts(None), drafts(fw.every_role())
res["drafter"] = bool(torch.equal(t1, t2)) and eq(l1, l2)
print("RESULT " + json.dumps(res))
'''


@needs_triton
def test_loader_bit_identical_under_the_interpreter(tmp_path):
    """The 12-bit loader against the bf16 loader under Triton's interpreter (module docstring):
    every role layout at M = 1, 4, 16, 64 bit for bit, the decode kernel exact, tiny dense / hybrid
    / Muse steps (prefill, verify of 1 and 4) and the DFlash draft step bit for bit with every role
    in 12 bits; the negative controls (another K tiling, a corrupted byte) differ."""
    from triton_interp import run_interpreted

    r = run_interpreted(tmp_path / "check.py", CHECK, REPO)
    assert r["decode_exact"]
    assert set(r["linear"]) == {"1", "4", "16", "64"}
    for m, d in r["linear"].items():
        assert d == {"plain": True, "norm": True, "residual": True, "swiglu": True}, m
    assert r["other_bk_equal"] is False and r["corrupted_equal"] is False
    for shape in ("tiny", "tiny-hybrid", "tiny-muse"):
        assert r["models"][shape] == [True, True, True], shape
    assert r["models"]["tiny_other_bk_equal"] is False
    assert r["drafter"]  # the DFlash draft step with its roles in 12 bits: the same drafts and logits
