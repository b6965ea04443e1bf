"""The w12 Triton kernels on CPU, under Triton's interpreter (TRITON_INTERPRET=1).

The interpreter must be switched on before the kernels are decorated, so the checks run in a
fresh Python process. They cover the decode kernel (bit-exact, compared as int16) and the fused
kernels (gemv and the three tensor-core variants, with and without split-K, escapes included)
against an fp32 reference. Two interpreter quirks of triton 3.6 are handled: it rounds
fp32 -> bf16 by truncation (so the tolerance allows one bf16 ulp), and it mis-multiplies bf16
``tl.dot`` (the kernel takes an exact fp32 dot when interpreting). The interpreter does not prove
GPU correctness (a persistent variant once passed here and failed on the H200), so
benchmarks/bench_w12.py checks every config on the GPU before timing it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHECK = r'''
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "src")]
import torch
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from triton_interp import patch_interpreter
patch_interpreter()
from kernels import w12_triton as K
from specpilot.w12.format import pack

g = torch.Generator().manual_seed(0)
n, k = 40, 256  # N not a multiple of any block: masked rows
w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
w[0, :4] = torch.tensor([0.0, 100.0, -1e-30, 37.0], dtype=torch.bfloat16)
w[5, 7] = -0.0
w[17, 200] = -250.0
w[39, 255] = 1e-40
t = pack(w)
res = {"escapes": int(t.escape_idx.numel())}
d = K.decode(t.mant, t.codes, t.base, t.escape_idx, t.escape_val)
res["decode_exact"] = bool(torch.equal(d.view(torch.int16), w.view(torch.int16)))
esc = K.prepare_escapes(t.escape_idx, t.escape_val, n, k)
cfgs = [K.Config("gemv", 8, 8, 1), K.Config("gemv", 16, 8, 4), K.Config("mm", 16, 4, 1), K.Config("mmr", 32, 8, 2),
        K.Config("mmx", 16, 4, 2)]
res["cases"] = []
for m in (1, 6, 17):  # 6: the 8-row gemv block with 2 masked rows
    x = (torch.randn(m, k, generator=g)).to(torch.bfloat16)
    ref = x.float() @ w.float().T
    for cfg in cfgs:
        if cfg.kind == "gemv" and m > K.GEMV_MAX_M:
            continue
        y = K.matmul(x, t.mant, t.codes, t.base, esc, cfg)
        excess = ((y.float() - ref).abs() - (2.0 ** -7) * ref.abs()).max().item()
        res["cases"].append({"m": m, "cfg": cfg.key(), "excess": excess,
                             "finite": bool(torch.isfinite(y.float()).all())})
# split-K resets its counters: a second call gives the same bits
x = torch.randn(2, k, generator=g).to(torch.bfloat16)
y1 = K.matmul(x, t.mant, t.codes, t.base, esc, K.Config("gemv", 16, 8, 4))
y2 = K.matmul(x, t.mant, t.codes, t.base, esc, K.Config("gemv", 16, 8, 4))
res["repeat_equal"] = bool(torch.equal(y1.view(torch.int16), y2.view(torch.int16)))
print("RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def interp_result(tmp_path_factory):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install 'specpilot[gpu]' or 'pip install triton')")
    script = tmp_path_factory.mktemp("w12triton") / "check.py"
    script.write_text(CHECK)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script), str(REPO)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_decode_kernel_is_bit_exact(interp_result):
    assert interp_result["escapes"] >= 5  # the planted zero, -0, tiny, subnormal and large values
    assert interp_result["decode_exact"]


def test_fused_kernels_match_fp32_reference(interp_result):
    cases = interp_result["cases"]
    assert len(cases) == 5 + 5 + 3  # gemv for M <= 8 only
    for c in cases:
        assert c["finite"], c
        # |y - ref| <= one bf16 ulp (2**-7 relative, truncation) + fp32 order effects
        assert c["excess"] <= 1e-4, c


def test_split_k_is_repeatable(interp_result):
    assert interp_result["repeat_equal"]


def test_tuned_table_lookup():
    """The committed H200 table loads, and M buckets without an entry use the next larger one."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO))
    from kernels import w12_triton as K

    try:
        K.load_tuned(REPO / "kernels" / "tuned" / "w12_h200.json")
        assert K.default_config(1, 4096, 4096).kind == "gemv"
        assert K.default_config(2, 4096, 4096) == K.default_config(3, 4096, 4096) == K.default_config(4, 4096, 4096)
        assert K.default_config(8, 4096, 4096) == K.default_config(16, 4096, 4096)  # 8 has no entry
        assert K.default_config(16, 4096, 4096).kind in K.MM_KINDS
        assert K.default_config(200, 4096, 12288) == K.default_config(256, 4096, 12288)
        for cfg in K._TUNED.values():
            assert cfg.kind in ("gemv",) + K.MM_KINDS and cfg.split_k >= 1
        fallback = K.default_config(1, 640, 512)  # untuned shape: heuristic
        assert fallback.kind == "gemv" and fallback.split_k >= 1
    finally:
        K.set_tuned({})
