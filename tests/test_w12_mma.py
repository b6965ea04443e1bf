"""The fragment-ordered w12 layout of the tensor-core kernel (specpilot/kernels/w12_mma.cu), on CPU.

The CUDA kernel itself runs on the GPU only (gpu_bench/bench_w12_mma.py checks it against the fp32
reference and across M). Here: the layout and decode logic it relies on, emulated with integer ops,
must reproduce every bf16 bit pattern, and the registers it feeds to mma.sync, read with the PTX
ISA's m16n8k16 fragment definitions, must compute x @ W.T.
"""

import pytest
import torch

from specpilot.errors import SpecpilotError
from specpilot.kernels.w12_mma import (FragW12, frag_decode_reference, frag_pack, raw_pairs,
                                       reference_matmul)
from specpilot.w12 import pack, unpack


def _specials(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    flat = w.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[:64]
    vals = [0.0, -0.0, 1e-40, -1e-41, float("inf"), float("-inf"), float("nan"), 3e4, -7e-30, 1.0]
    for i, v in zip(idx.tolist(), vals * 7):
        flat[i] = v
    return w


def test_every_bf16_pattern_decodes_bit_exactly():
    """All 65,536 bf16 bit patterns, shuffled into one 16 x 4096 matrix, through frag_pack and the
    kernel's emulated decode (prmt with sign replication, shift, masks, exponent rebase)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32)
    bits = bits[torch.randperm(bits.numel(), generator=torch.Generator().manual_seed(1))]
    w = bits.to(torch.int16).view(torch.bfloat16).view(16, 4096)
    t = pack(w)
    f = frag_pack(t)
    out = frag_decode_reference(f)
    assert torch.equal(out.view(torch.int16), w.view(torch.int16))
    assert torch.equal(unpack(t).view(torch.int16), w.view(torch.int16))


def test_planted_escapes_decode_bit_exactly_and_counts():
    w = _specials(64, 96)
    t = pack(w)
    f = frag_pack(t)
    assert f.fm.shape == (4, 3, 32, 16) and f.fc.shape == (4, 3, 32, 8)
    assert int(f.rowptr[-1]) == t.escape_idx.numel() >= 6
    assert torch.equal(frag_decode_reference(f).view(torch.int16), w.view(torch.int16))
    # a negative control: one flipped code nibble must change a weight
    bad = FragW12(f.fm, f.fc.clone(), f.base, f.rowptr, f.col, f.val, f.shape)
    bad.fc[1, 2, 5, 3] ^= 0x10
    assert not torch.equal(frag_decode_reference(bad).view(torch.int16), w.view(torch.int16))


def _mma_emulated(f: FragW12, x: torch.Tensor) -> torch.Tensor:
    """y_raw = x @ Wraw.T computed from the kernel's registers with the PTX m16n8k16 fragment maps
    (A row-major 16x16: a0,a1 (g, 2t..), a2,a3 (g+8, 2t..), a4,a5 (g, 2t+8..), a6,a7 (g+8, 2t+8..);
    B col-major 16x8: b0,b1 (k 2t.., n g), b2,b3 (k 2t+8.., n g); C: c0,c1 (g, 2t..), c2,c3 (g+8, 2t..)),
    with x's B fragments taken as the kernel takes them: lane (g, t) reads x[row, 8t .. 8t+7] of a
    32-column chunk; k-step j uses words 2j (b0,b1) and 2j+1 (b2,b3)."""
    R = raw_pairs(f)  # [T, KI, 32, 2, 4, 2] raw bf16 bits
    R = R - ((R & 0x8000) << 1)
    A = R.to(torch.int16).view(torch.bfloat16).float()
    T, KI = A.shape[:2]
    M = x.shape[0]
    y = torch.zeros(M, T * 16, dtype=torch.float64)
    xf = x.double()
    for tile in range(T):
        for i in range(KI):
            for j in range(2):
                Am = torch.zeros(16, 16, dtype=torch.float64)  # mma A (rows, slots)
                Bm = torch.zeros(16, M, dtype=torch.float64)  # mma B (slots, x rows)
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    a = A[tile, i, lane, j]  # [4 regs, 2 halves]
                    for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                        Am[row, col], Am[row, col + 1] = a[r, 0], a[r, 1]
                    words = xf[:, 32 * i + 8 * t: 32 * i + 8 * t + 8].view(M, 4, 2)  # 4 bf16x2 words
                    for m in range(M):  # B column n = g of tile m // 8; every m handled by lane (m % 8, t)
                        if m % 8 != g:
                            continue
                        Bm[2 * t, m], Bm[2 * t + 1, m] = words[m, 2 * j, 0], words[m, 2 * j, 1]
                        Bm[2 * t + 8, m], Bm[2 * t + 9, m] = words[m, 2 * j + 1, 0], words[m, 2 * j + 1, 1]
                y[:, tile * 16:(tile + 1) * 16] += (Am @ Bm).T
    return y


def test_fragments_follow_the_ptx_mma_layout():
    """The registers the kernel builds, placed by the PTX fragment maps, multiply to x @ Wraw.T."""
    w = (torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    t = pack(w)
    f = frag_pack(t)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y = _mma_emulated(f, x) * (2.0 ** (f.base - 112))
    ref = x.double() @ unpack(t).double().T  # no escapes in these weights
    assert int(f.rowptr[-1]) == 0
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-9)


def test_reference_matmul_matches_fp32_with_escapes():
    w = _specials(48, 128, seed=5)
    w[~torch.isfinite(w.float())] = 2.5  # keep the product finite; zeros and subnormals stay escapes
    t = pack(w)
    f = frag_pack(t)
    assert int(f.rowptr[-1]) > 0
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    y = reference_matmul(x, f).float()
    ref = (x.float() @ w.float().T)
    torch.testing.assert_close(y, ref.to(torch.bfloat16).float(), rtol=2e-2, atol=2e-2)


def test_bad_shapes_are_refused():
    with pytest.raises(SpecpilotError, match="multiple of 16"):
        frag_pack(pack(torch.zeros(24, 64, dtype=torch.bfloat16)))
    with pytest.raises(SpecpilotError, match="multiple of 16 and K of 32"):
        frag_pack(pack(torch.zeros(16, 40, dtype=torch.bfloat16)))


def test_launch_shapes_and_clear_errors(monkeypatch, tmp_path):
    """Which launches exist (w12_mma.valid), and the one-line errors for bad input on any machine."""
    from specpilot.kernels import w12_mma

    assert w12_mma.valid(1, 8, 1, 4, 8, 4096) and w12_mma.valid(16, 1, 2, 2, 4, 4096)
    assert not w12_mma.valid(16, 1, 2, 4, 8, 4096)  # unroll 8 only for tiles x 8-row tiles <= 2
    assert not w12_mma.valid(1, 16, 1, 4, 2, 4096)  # splits are cluster sizes <= 8
    assert not w12_mma.valid(1, 8, 1, 4, 8, 128)  # 8 x 8 chunks of 32 > K / 32 = 4
    f = frag_pack(pack(torch.zeros(16, 64, dtype=torch.bfloat16)))
    with pytest.raises(SpecpilotError, match=r"x must be bf16 \[M, 64\]"):
        w12_mma.matmul(torch.zeros(2, 32, dtype=torch.bfloat16), f)
    with pytest.raises(SpecpilotError, match="both must be on one GPU"):
        w12_mma.matmul(torch.zeros(2, 64, dtype=torch.bfloat16), f)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(SpecpilotError, match="'nvcc' not found"):
        w12_mma.build("90", tmp_path)
    with pytest.raises(SpecpilotError, match="pipe must be 0, 1 or 2, got 3"):
        w12_mma.build("90", tmp_path, pipe=3)
    assert not list(tmp_path.iterdir())  # nothing half-written
