"""The lossless 12-bit weight format on CPU: bit-exact round trips, layout, layers, converter.

The Triton kernels are tested under TRITON_INTERPRET=1 in tests/test_w12_triton.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from specpilot.engine.serve import ServeOptions
from specpilot.deployment import Deployment
from specpilot.errors import SpecpilotError
from specpilot.w12 import DIRECTION, W12Linear, apply_w12, escape_rate, load_w12_state, nbytes, pack, unpack
from specpilot.w12 import save_w12_state
from specpilot.w12.format import choose_base, escape_csr

BF16_MAX = 0x7F7F  # largest finite bf16
BF16_MIN_NORMAL = 0x0080
BF16_MIN_SUB = 0x0001


def bits_of(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.int16)


def from_bits(values: list[int]) -> torch.Tensor:
    b = torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in values], dtype=torch.int16)
    return b.view(torch.bfloat16)


def planted_matrix(n: int = 64, k: int = 256, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Normal weights with zeros, -0, subnormals, extremes and outliers at known flat positions."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    special = [0x0000, 0x8000, BF16_MIN_SUB, 0x8000 | BF16_MIN_SUB, 0x007F, BF16_MIN_NORMAL,
               BF16_MAX, 0x8000 | BF16_MAX, 0x7F00, 0x0100]
    special_vals = from_bits(special)
    outliers = torch.tensor([1e30, -1e-30, 65504.0, -3.0e38, 1e-38], dtype=torch.bfloat16)
    vals = torch.cat([special_vals, outliers])
    pos = torch.randperm(n * k, generator=g)[: vals.numel()].tolist()
    flat = w.view(-1)
    for p, v in zip(pos, vals):
        flat[p] = v
    return w, pos


def expected_escapes(w: torch.Tensor, base: int) -> torch.Tensor:
    exp = (bits_of(w).to(torch.int32) >> 7) & 0xFF
    return torch.nonzero(((exp < base + 1) | (exp > base + 15)).reshape(-1)).reshape(-1)


def test_round_trip_bit_exact_with_planted_values():
    w, pos = planted_matrix()
    t = pack(w)
    out = unpack(t)
    assert out.dtype == torch.bfloat16 and out.shape == w.shape
    assert torch.equal(bits_of(out), bits_of(w))
    # every planted value except the in-range ones is an escape, and nothing else is
    assert torch.equal(t.escape_idx, expected_escapes(w, t.base))
    assert set(pos) & set(t.escape_idx.tolist())  # the planted extremes did escape
    assert torch.equal(bits_of(t.escape_val), bits_of(w.view(-1)[t.escape_idx]))


def test_round_trip_inf_nan_and_negative_zero_rows():
    vals = [0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x8000, 0x0000, 0x3F80, 0xBF80]  # +-inf, nans, -0, 0, +-1
    w = from_bits(vals * 4).reshape(4, 8)
    t = pack(w)
    assert torch.equal(bits_of(unpack(t)), bits_of(w))


def test_all_bf16_bit_patterns_round_trip():
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    t = pack(w)
    assert torch.equal(bits_of(unpack(t)), bits_of(w))
    assert t.escape_idx.numel() == 65536 - 15 * 256  # 15 exponents x 2 signs x 128 mantissas fit


def test_escape_rate_of_plain_normal_weights_is_tiny():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16)
    t = pack(w)
    rate = escape_rate(t)
    assert 0.0 <= rate < 5e-4  # only |w| below 2**-15 of the top binade escapes (~1.5e-4)
    assert 100 <= t.base <= 125
    assert nbytes(t) == 1024 * 1024 * 3 // 2 + t.escape_idx.numel() * 10


def test_base_covers_the_most_populated_window():
    # exponents 100..115, one weight at 100, five at 115: the window 101..115 wins (base 100)
    exps = [100] + [e for e in range(101, 115) for _ in range(2)] + [115] * 5
    exps += [0] * (64 - len(exps))  # zeros (exponent 0) never fit any window with base >= 0
    bits = [e << 7 for e in exps]
    w = from_bits(bits).reshape(8, 8)
    t = pack(w)
    assert t.base == 100
    assert choose_base(torch.tensor(exps)) == 100
    assert t.escape_idx.numel() == 1 + exps.count(0)
    assert torch.equal(bits_of(unpack(t)), bits_of(w))


def test_documented_bit_layout():
    # row of 8 weights with exponents base+1..base+8 and sign+mantissa bytes 0x01..0x08 (sign set on e7)
    base = 110
    bits = [((base + 1 + i) << 7) | (i + 1) for i in range(8)]
    bits[7] |= 0x8000
    w = from_bits(bits).reshape(1, 8)
    t = pack(w)
    assert t.base == base + 8 - 15  # every window from base-7 to base covers all 8: the smallest wins
    sm = [i + 1 for i in range(7)] + [0x80 | 8]
    assert t.mant.tolist() == [[sm[0], sm[2], sm[1], sm[3], sm[4], sm[6], sm[5], sm[7]]]
    c = [i + 8 for i in range(8)]  # exponent base+1+i is code 8+i
    assert t.codes.tolist() == [[c[0] | c[2] << 4, c[4] | c[6] << 4, c[1] | c[3] << 4, c[5] | c[7] << 4]]


def swar_decode(t) -> torch.Tensor:
    """The kernels' two-lanes-at-once decode, emulated with int64 arithmetic (no Triton)."""
    n, k = t.shape
    mw = t.mant.view(n, k // 8, 2, 4).to(torch.int64)
    words = mw[..., 0] | mw[..., 1] << 8 | mw[..., 2] << 16 | mw[..., 3] << 24  # [n, g, 2] (A, B)
    cb = t.codes.view(n, k // 8, 4).to(torch.int64)
    C = cb[..., 0] | cb[..., 1] << 8 | cb[..., 2] << 16 | cb[..., 3] << 24
    A, B = words[..., 0], words[..., 1]
    T = [A & 0x00FF00FF, (A >> 8) & 0x00FF00FF, B & 0x00FF00FF, (B >> 8) & 0x00FF00FF]
    out = []
    for p in range(4):
        R = ((T[p] & 0x00800080) * 255 + T[p] + ((C >> (4 * p)) & 0x000F000F) * 128 + t.base * 0x00800080) & 0xFFFFFFFF
        out += [R & 0xFFFF, R >> 16]  # elements 2p, 2p+1
    bits = torch.stack(out, dim=-1).reshape(n, k)
    return (bits - ((bits & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def test_kernel_pair_decode_formula_matches_reference():
    w, _ = planted_matrix(32, 128, seed=3)
    t = pack(w)
    bulk = swar_decode(t)
    ref = unpack(t)
    esc = torch.zeros(w.numel(), dtype=torch.bool)
    esc[t.escape_idx] = True
    esc = esc.view(w.shape)
    assert torch.equal(bits_of(bulk)[~esc], bits_of(ref)[~esc])
    # escapes decode in bulk to +2**(base-127): bits base << 7
    assert (bits_of(bulk)[esc] == t.base << 7).all()


def test_escape_csr_lists_escapes_by_row():
    w, _ = planted_matrix(16, 64, seed=5)
    t = pack(w)
    rowptr, row, col, val = escape_csr(t)
    assert rowptr[0] == 0 and rowptr[-1] == t.escape_idx.numel()
    for n in range(16):
        lo, hi = int(rowptr[n]), int(rowptr[n + 1])
        assert (row[lo:hi] == n).all()
        assert torch.equal(bits_of(val[lo:hi]), bits_of(w[n, col[lo:hi].long()]))


@pytest.mark.parametrize("bad, what", [
    (torch.zeros(8, 16, dtype=torch.float16), "float16"),
    (torch.zeros(8, 16, dtype=torch.float32), "float32"),
    (torch.zeros(2, 8, 16, dtype=torch.bfloat16), "2-D"),
    (torch.zeros(8, 12, dtype=torch.bfloat16), "multiple of 8"),
])
def test_bad_input_raises(bad, what):
    with pytest.raises(SpecpilotError, match=what):
        pack(bad)


def test_inconsistent_w12_tensor_raises():
    t = pack(torch.ones(4, 8, dtype=torch.bfloat16))
    t.base = 250
    with pytest.raises(SpecpilotError, match="base"):
        unpack(t)


def test_w12_linear_matches_nn_linear_bit_for_bit():
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight[3, 5] = 0.0
        lin.weight[7, 9] = 1e20
    x = torch.randn(2, 5, 256).to(torch.bfloat16)
    ref = lin(x)
    w12 = W12Linear.from_linear(lin)
    out = w12(x)
    assert out.shape == (2, 5, 96)
    assert torch.equal(bits_of(out), bits_of(ref))
    assert torch.equal(bits_of(w12.weight_bf16()), bits_of(lin.weight.detach()))


def test_w12_linear_refuses_bias_and_fp32():
    with pytest.raises(SpecpilotError, match="bias"):
        W12Linear.from_linear(nn.Linear(16, 8).to(torch.bfloat16))
    with pytest.raises(SpecpilotError, match="float32"):
        W12Linear.from_linear(nn.Linear(16, 8, bias=False))


class _Attn(nn.Module):
    def __init__(self, h, kv):
        super().__init__()
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class _Layer(nn.Module):
    def __init__(self, h, kv, i):
        super().__init__()
        self.self_attn = _Attn(h, kv)
        self.mlp = _MLP(h, i)


class _Inner(nn.Module):
    def __init__(self, vocab, h, kv, i, n_layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(_Layer(h, kv, i) for _ in range(n_layers))
        self.norm = nn.LayerNorm(h)


class TinyQwen(nn.Module):
    """HF Qwen3-style module names (model.layers.{i}.self_attn.q_proj, ..., lm_head)."""

    def __init__(self, vocab=50, h=64, kv=32, i=96, n_layers=2):
        super().__init__()
        self.model = _Inner(vocab, h, kv, i, n_layers)
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens):
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            a = layer.self_attn
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
            att = torch.softmax(q[..., : k.shape[-1]] @ k.transpose(-1, -2) / 8.0, dim=-1) @ v
            x = x + a.o_proj(torch.cat([att, att], dim=-1))
            m = layer.mlp
            x = x + m.down_proj(torch.nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))
        return self.lm_head(self.model.norm(x))


def _tiny(seed=0):
    torch.manual_seed(seed)
    return TinyQwen().to(torch.bfloat16).eval()


def test_apply_w12_changes_no_output_bit():
    model = _tiny()
    tokens = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        ref = model(tokens)
        stats = apply_w12(model)
        out = model(tokens)
    assert torch.equal(bits_of(out), bits_of(ref))
    assert stats["tensors"] == 14  # 7 linears x 2 layers
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 96 * 3
    assert stats["params"] == 2 * per_layer
    assert stats["bytes_bf16"] == 4 * per_layer
    esc = round(stats["escape_rate"] * stats["params"])
    assert stats["bytes_w12"] == 3 * per_layer + 10 * esc
    assert "lm_head" in stats["skipped"]
    assert isinstance(model.model.layers[1].mlp.down_proj, W12Linear)
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, W12Linear)


def test_apply_w12_include_filter():
    model = _tiny()
    stats = apply_w12(model, include=lambda name: name.endswith("mlp.down_proj"))
    assert stats["tensors"] == 2
    assert isinstance(model.model.layers[0].mlp.down_proj, W12Linear)
    assert not isinstance(model.model.layers[0].mlp.up_proj, W12Linear)


def test_save_and_load_w12_state(tmp_path):
    model = _tiny()
    tokens = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        ref = model(tokens)
    apply_w12(model)
    path = tmp_path / "model.w12.safetensors"
    save_w12_state(model, path)
    fresh = _tiny(seed=123)  # different weights, same shapes
    stats = load_w12_state(fresh, path)
    assert stats["tensors"] == 14
    with torch.no_grad():
        out = fresh(tokens)
    assert torch.equal(bits_of(out), bits_of(ref))
    assert not list(tmp_path.glob(".*.tmp"))


def _write_checkpoint(folder, tensors):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    (folder / "tokenizer.json").write_text("{}")
    save_file(tensors, str(folder / "model.safetensors"))


def test_converter_round_trip(tmp_path, capsys):
    from safetensors.torch import load_file

    from specpilot.cli import main
    from specpilot.w12.linear import w12_from_tensors

    g = torch.Generator().manual_seed(7)
    q, _ = planted_matrix(64, 64, seed=7)
    down32 = torch.randn(64, 128, generator=g) * 0.05  # fp32 weight: cast to bf16, then packed
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.mlp.down_proj.weight": down32,
        "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.randn(50, 64, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(50, 64, generator=g).to(torch.bfloat16),
    }
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write_checkpoint(src, tensors)
    assert main(["convert-w12", "--src", str(src), "--dst", str(dst)]) == 0
    printed = capsys.readouterr().out
    assert "escape rate" in printed and "cast 1 fp32" in printed

    out = load_file(str(dst / "model.w12.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert name not in out
        expect = tensors[name].to(torch.bfloat16)
        got = unpack(w12_from_tensors(name, out))
        assert torch.equal(bits_of(got), bits_of(expect))
    for name in ("model.layers.0.input_layernorm.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(bits_of(out[name]), bits_of(tensors[name]))
    assert (dst / "config.json").read_text() == (src / "config.json").read_text()
    assert (dst / "tokenizer.json").is_file()
    summary = json.loads((dst / "w12.json").read_text())
    params = 64 * 64 + 64 * 128
    assert summary["tensors"] == 2 and summary["params"] == params
    assert summary["bytes_bf16"] == 2 * params
    assert summary["bytes_w12"] == params * 3 // 2 + 10 * summary["escapes"]
    assert summary["escapes"] >= 10  # the planted extremes of q_proj
    assert summary["cast_from_fp32"] == ["model.layers.0.mlp.down_proj.weight"]


def test_converter_refuses_fp16_and_missing_config(tmp_path, capsys):
    from specpilot.cli import main

    src = tmp_path / "src"
    _write_checkpoint(src, {"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 16, dtype=torch.float16)})
    assert main(["convert-w12", "--src", str(src), "--dst", str(tmp_path / "dst")]) == 2
    assert "float16" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert-w12", "--src", str(empty), "--dst", str(tmp_path / "dst2")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_direction_constant_matches_the_registry_and_the_cost_model():
    """w12.DIRECTION is what the agent loop registers, its cost term is one the cost model reports
    with a saving exactly for bf16 weights (a quarter of the weight read), and applying it gives a
    config the deployment loader takes."""
    from specpilot.agent import directions as dirs
    from specpilot.agent.costmodel import analyze
    from types import SimpleNamespace

    from specpilot.records import Record

    reg = dirs.REGISTRY[DIRECTION["name"]]
    assert (reg.cost_term, reg.space) == (DIRECTION["cost_term"], DIRECTION["space"])
    assert DIRECTION["cost_term"] in dirs.COST_TERMS
    cfg = SimpleNamespace(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    rec = Record(request_id="x/0", benchmark="x", deployment="d", target="t", drafter="dflash", gpu="h200",
                 engine="stock", concurrency=1, prompt_tokens=8, new_tokens=9, prefill_s=0.0, decode_s=0.01,
                 verify_steps=2, committed_per_step=[4, 4], output_ids=list(range(9)))
    rec.draft_s, rec.verify_s = 0.002, 0.006
    ceil = {"memory_bandwidth_bytes_per_s": 1e9, "matmul_flop_per_s": 1e12}
    terms = {b: {t["term"]: t for t in analyze([rec], cfg, None, ceil, b, 8)["terms"]} for b in (2, 4)}
    wb = terms[2][DIRECTION["cost_term"]]
    assert wb["gap_s_per_token"] == pytest.approx(wb["measured_s_per_token"] / 4) and wb["gap_s_per_token"] > 0
    assert terms[4][DIRECTION["cost_term"]]["gap_s_per_token"] == 0.0
    assert reg.apply({"block_size": 8}, {"weight_format": "w12"}) == {"block_size": 8, "weight_format": "w12"}
    assert reg.apply({"block_size": 8}, {"weight_format": "bf16"}) == {"block_size": 8}  # bf16 = off


def test_engine_with_w12_passes_token_forcing_against_bf16(quick_deployment, quick_prompts):
    """The tiny target in bf16: the w12 engine's outputs equal the bf16 engine's (0 violations)."""
    from specpilot.deployment import load_deployment
    from specpilot.engine.config import EngineSpec
    from specpilot.engine.serve import serve
    from specpilot.forcing import check

    meta = {"deployment": "quick", "target": "t", "drafter": "dflash", "gpu": "cpu"}
    bf16 = load_deployment(quick_deployment / "target", quick_deployment / "drafter-dflash",
                           torch.device("cpu"), torch.bfloat16)
    w12 = load_deployment(quick_deployment / "target", quick_deployment / "drafter-dflash",
                          torch.device("cpu"), torch.bfloat16, weight_format="w12")
    assert any(type(m).__name__ == "W12Linear" for m in w12.target.modules())
    ref = serve(EngineSpec("stock", 4), Deployment.of(bf16.target, bf16.drafter), quick_prompts[:4], 24, 1, meta, ServeOptions(progress=False))
    cand = serve(EngineSpec("specpilot", 4, {"weight_format": "w12"}), Deployment.of(w12.target, w12.drafter), quick_prompts[:4], 24, 1, meta, ServeOptions(progress=False))
    prompts = {p["request_id"]: p["prompt_ids"] for p in quick_prompts}
    verdict = check(cand, ref, prompts, bf16.target, tolerance=0.0)
    assert verdict["violations"] == 0 and verdict["near_ties"] == 0 and verdict["tokens_checked"] == 4 * 24
