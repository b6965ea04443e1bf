"""The w12 roles of the engine's fast path (specpilot.fastpath.w12, FastTarget.use_w12, w12_apply).

On the CPU the tensor-core kernel is replaced by its own fp32 emulation (``reference_matmul``, which
tests/test_w12_mma.py checks against the format bit for bit), and the step's RMSNorm / SwiGLU by
torch: what is tested is the dispatch (which roles and calls run w12, the launch by M, prefill
staying bf16), the epilogues and the buffers. The CUDA test runs the real kernel in a step."""

from __future__ import annotations

import types

import pytest
import torch

# the fast path's step imports Triton (kernels/step.py): without it these tests are skipped, as README says
pytest.importorskip("triton", reason="triton is not installed (the Triton fast path's tests need it)")

from specpilot.fastpath import w12 as w12_fast  # noqa: E402
from specpilot.fastpath.dense import FastTarget, fuse_weights  # noqa: E402
from specpilot.errors import SpecpilotError  # noqa: E402
from specpilot.kernels import w12_mma  # noqa: E402
from specpilot.models.config import TargetConfig  # noqa: E402
from specpilot.models.qwen3 import Transformer  # noqa: E402
from specpilot.models.random_checkpoint import fill_random_  # noqa: E402

CFG = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def _rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class _Kernels:
    """The two step kernels w12_apply calls, in torch."""

    @staticmethod
    def rmsnorm(x, w, out, eps):
        out.copy_(_rms(x, w, eps))
        return out

    @staticmethod
    def silu_mul(gu, out):
        n = gu.shape[1] // 2
        out.copy_((torch.nn.functional.silu(gu[:, :n].float()) * gu[:, n:].float()).to(out.dtype))
        return out


def rowwise_reference(x, f):
    """The kernel emulated (:func:`w12_mma.reference_matmul`) one row at a time: the kernel's rows do
    not depend on M (one split for every M), while the CPU's fp32 GEMM picks its kernel, and so its
    summation order, by M and thread count."""
    return torch.cat([w12_mma.reference_matmul(x[i:i + 1], f) for i in range(x.shape[0])])


@pytest.fixture
def fake_target(monkeypatch):
    """A FastTarget shell over a bf16 two-layer model (fused weights), the kernel emulated; records
    each w12 call's (N, K, split, launch, rows)."""
    calls = []

    def fake_matmul(x, f, split=1, tn=1, warps=4, unroll=2, out=None):
        assert w12_mma.valid(x.shape[0], split, tn, warps, unroll, f.shape[1])
        calls.append((f.shape, split, (tn, warps, unroll), x.shape[0]))
        y = rowwise_reference(x, f)
        if out is None:
            return y
        assert out.is_contiguous() and out.shape == y.shape
        return out.copy_(y)

    monkeypatch.setattr(w12_mma, "matmul", fake_matmul)
    model = fill_random_(Transformer(CFG), 3).eval().to(torch.bfloat16)
    fuse_weights(model)
    fast = FastTarget.__new__(FastTarget)
    fast.model, fast.k, fast._prefilling, fast._ws, fast.w12 = model, _Kernels, False, {}, None
    return fast, calls


def _ws(rows, cfg=CFG):
    return types.SimpleNamespace(rows=rows, xn=torch.zeros(rows, cfg.hidden_size, dtype=torch.bfloat16), extra={})


CHOICE = {"qkv": {"split": 1, "launch": {"1": "t1-w4-u2", "64": "t2-w4-u2"}},  # K = 64: split x unroll <= 2 chunks
          "o": {"split": 2, "launch": {"64": "t1-w2-u2"}},  # K = 128
          "gate_up": {"split": 1, "launch": {"16": "t1-w2-u2", "64": "t1-w4-u2"}},
          "down": {"split": 1, "launch": {"64": "t1-w4-u2"}}}


def test_w12_roles_compute_the_epilogues_of_their_bf16_roles(fake_target):
    fast, calls = fake_target
    fast.use_w12(w12_fast.parse_choice(CHOICE))
    layer = fast.model.model.layers[1]
    eps = CFG.rms_norm_eps
    g = torch.Generator().manual_seed(0)
    for M in (1, 5, 16, 70):
        x = torch.randn(M, 64, generator=g).to(torch.bfloat16)
        ws = _ws(M)
        # qkv: norm, no epilogue, straight into out
        out = torch.zeros(M, 256, dtype=torch.bfloat16)
        fast._linear("qkv", x, layer.fused_qkv, out, ws, norm=layer.input_layernorm.weight)
        want = rowwise_reference(_rms(x, layer.input_layernorm.weight, eps), w12_mma.frag_pack(
            w12_fast_pack(layer.fused_qkv)))
        assert torch.equal(out, want)
        assert calls[-1][1:] == (1, (2, 4, 2) if M > 1 else (1, 4, 2), M)
        # gate_up: norm, SwiGLU epilogue
        h = torch.zeros(M, 96, dtype=torch.bfloat16)
        fast._linear("gate_up", x, layer.fused_gate_up, h, ws, norm=layer.post_attention_layernorm.weight, swiglu=True)
        gu = rowwise_reference(_rms(x, layer.post_attention_layernorm.weight, eps),
                                      w12_mma.frag_pack(w12_fast_pack(layer.fused_gate_up)))
        assert torch.equal(h, _Kernels.silu_mul(gu, torch.empty_like(h)))
        assert calls[-1][2] == ((1, 2, 2) if M <= 16 else (1, 4, 2))
        # down: residual (out is the residual stream)
        r = torch.randn(M, 64, generator=g).to(torch.bfloat16)
        res = r.clone()
        hin = torch.randn(M, 96, generator=g).to(torch.bfloat16)
        fast._linear("down", hin, layer.mlp.down_proj.weight, res, ws, residual=res)
        y = rowwise_reference(hin, w12_mma.frag_pack(w12_fast_pack(layer.mlp.down_proj.weight)))
        assert torch.equal(res, r + y)
        # and the result is the bf16 product up to bf16 rounding
        exact = (_rms(x, layer.input_layernorm.weight, eps).float() @ layer.fused_qkv.float().T)
        assert ((out.float() - exact).norm() / exact.norm()).item() < 1e-2


def w12_fast_pack(w):
    from specpilot.w12 import pack

    return pack(w)


def test_only_chosen_roles_and_never_prefill_run_w12(fake_target, monkeypatch):
    fast, calls = fake_target
    fast.use_w12(w12_fast.parse_choice({"gate_up": CHOICE["gate_up"]}))
    assert len(fast.w12.packed) == CFG.num_hidden_layers  # one packed weight per layer, the chosen role's
    seen = []
    monkeypatch.setattr(FastTarget, "_pick", lambda self, role, *a, **k: seen.append(role) or "bf16-sentinel")
    monkeypatch.setattr(FastTarget, "_apply", lambda self, cfg, x, w, out, *a, **k: out)
    layer = fast.model.model.layers[0]
    x = torch.randn(4, 64).to(torch.bfloat16)
    ws = _ws(4)
    fast._linear("qkv", x, layer.fused_qkv, torch.zeros(4, 256, dtype=torch.bfloat16), ws,
                 norm=layer.input_layernorm.weight)
    assert seen == ["qkv"] and not calls  # qkv not chosen: the bf16 step
    fast._linear("gate_up", x, layer.fused_gate_up, torch.zeros(4, 96, dtype=torch.bfloat16), ws,
                 norm=layer.post_attention_layernorm.weight, swiglu=True)
    assert len(calls) == 1 and seen == ["qkv"]
    with fast.prefilling():
        fast._linear("gate_up", x, layer.fused_gate_up, torch.zeros(4, 96, dtype=torch.bfloat16), ws,
                     norm=layer.post_attention_layernorm.weight, swiglu=True)
    assert len(calls) == 1 and seen == ["qkv", "gate_up"]  # a prefill matmul stays bf16
    fast.use_w12({})
    assert fast.w12 is None


def test_use_w12_refuses_a_launch_the_library_lacks_for_the_weight(fake_target):
    fast, _ = fake_target
    with pytest.raises(SpecpilotError, match="qkv.*split 2.*unroll 4.*K = 64"):
        fast.use_w12(w12_fast.parse_choice({"qkv": {"split": 2, "launch": {"64": "t1-w4-u4"}}}))
    assert fast.w12 is None


def test_w12_rows_do_not_depend_on_the_batch(fake_target):
    """One split for every M: a row computed in a batch of 40 equals that row alone (the emulation
    computes each row alone; on the GPU `specpilot bench w12` checks the kernel's rows in the step)."""
    fast, _ = fake_target
    fast.use_w12(w12_fast.parse_choice(CHOICE))
    layer = fast.model.model.layers[0]
    x = torch.randn(40, 64).to(torch.bfloat16)
    full = torch.zeros(40, 96, dtype=torch.bfloat16)
    fast._linear("gate_up", x, layer.fused_gate_up, full, _ws(40), norm=layer.post_attention_layernorm.weight,
                 swiglu=True)
    for r in (0, 17, 39):
        one = torch.zeros(1, 96, dtype=torch.bfloat16)
        fast._linear("gate_up", x[r:r + 1], layer.fused_gate_up, one, _ws(1),
                     norm=layer.post_attention_layernorm.weight, swiglu=True)
        assert torch.equal(one, full[r:r + 1])


def test_parse_choice_names_the_bad_value():
    ok = w12_fast.parse_choice(CHOICE)
    assert ok["qkv"].launch(1) == (1, 4, 2) and ok["qkv"].launch(2) == (2, 4, 2) and ok["qkv"].launch(500) == (2, 4, 2)
    assert w12_fast.parse_choice({r: ok[r].to_dict() for r in ok}) == ok  # round trip through JSON's form
    for bad, msg in (({"lm_head": CHOICE["o"]}, "lm_head"), ({"o": {"split": 3, "launch": {"1": "t1-w4-u2"}}}, "split 3"),
                     ({"o": {"split": 1, "launch": {"0": "t1-w4-u2"}}}, "'0'"),
                     ({"o": {"split": 1, "launch": {"1": "t3-w4-u2"}}}, "t3-w4-u2"),
                     ({"o": {"split": 1, "launch": {"1": "fast"}}}, "'fast'"), ({"o": 1}, "'o'")):
        with pytest.raises(SpecpilotError, match=msg):
            w12_fast.parse_choice(bad)


def test_to_plain_linears_is_lossless():
    from specpilot.w12 import apply_w12

    model = fill_random_(Transformer(CFG), 4).eval().to(torch.bfloat16)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    apply_w12(model)
    assert w12_fast.to_plain_linears(model) > 0
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)


def test_kernel_agent_w12_choice_is_validated_and_reaches_the_outputs(tmp_path):
    from specpilot.io import write_json
    from specpilot.kernels_build import use_kernel_outputs

    man = tmp_path / "manifest.json"
    write_json(man, {"gpu": "h200", "applies": True, "kernels": {}})
    ka = tmp_path / "kernel-agent.json"
    write_json(ka, {"gpu": "h200", "applies": True, "configs": {}, "w12_choice": {"down": CHOICE["down"]}})
    out = use_kernel_outputs(str(man), str(ka))
    assert out["w12_choice"] == {"down": CHOICE["down"]}
    write_json(ka, {"gpu": "h200", "applies": True, "configs": {}, "w12_choice": {"down": {"split": 5, "launch": {"1": "t1-w4-u2"}}}})
    with pytest.raises(SpecpilotError, match="kernel-agent.json: w12_choice.*split 5"):
        use_kernel_outputs(str(man), str(ka))
    # a manifest naming a built library that is not there: one clear error
    write_json(man, {"gpu": "h200", "applies": True, "kernels": {},
                     "w12_mma": {"built": True, "ok": True, "library": "libw12mma_sm90.so"}})
    write_json(ka, {"gpu": "h200", "applies": True, "configs": {}})
    with pytest.raises(SpecpilotError, match="libw12mma_sm90.so is missing"):
        use_kernel_outputs(str(man), str(ka))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and nvcc")
def test_w12_fast_step_on_cuda(tmp_path):
    """The real kernel in a one-layer step: a 16-row block's logits equal its 16 one-row decodes."""
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    from specpilot.kernels_build import build_w12_mma

    rep = build_w12_mma(tmp_path)
    assert rep["built"] and rep["ok"], rep
    cfg = TargetConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    model = fill_random_(Transformer(cfg), 1).eval().to(torch.bfloat16).cuda()
    model.setup_cache(1, 128)
    fast = FastTarget(model)
    fast.use_w12(w12_fast.parse_choice({r: {"split": 1, "launch": {"64": "t1-w4-u2"}} for r in w12_fast.ROLES}))
    tok = torch.randint(0, 1024, (1, 16), device="cuda")
    start = torch.tensor([8], device="cuda")
    blk = fast.forward(tok, start)[0].clone()
    one = torch.cat([fast.forward(tok[:, i:i + 1], start + i)[0].clone() for i in range(16)], 1)
    assert torch.equal(blk, one)


def test_w12_choice_needs_the_engine_config_to_ask():
    """The sub-agent's w12 roles go into a w12 target only with ``w12_fast: true`` (off by default:
    they change logits by bf16 ulps, which token forcing flags)."""
    from specpilot.engine.config import EngineConfig
    from specpilot.kernels_build import w12_choice_for

    outs = {"w12_choice": {"down": CHOICE["down"]}}
    assert w12_choice_for(outs, EngineConfig.parse({"weight_format": "w12"})) is None
    assert w12_choice_for(outs, EngineConfig()) is None
    assert w12_choice_for(outs, EngineConfig.parse({"w12_fast": True})) is None  # bf16 weights: nothing to run in w12
    got = w12_choice_for(outs, EngineConfig.parse({"weight_format": "w12", "w12_fast": True}))
    assert got == w12_fast.parse_choice({"down": CHOICE["down"]})
    assert w12_choice_for({}, EngineConfig.parse({"weight_format": "w12", "w12_fast": True})) is None
