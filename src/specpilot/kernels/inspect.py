"""What the matmul kernel compiles to, without a GPU: instructions per weight of its main loop.

Triton compiles for a CUDA target on any machine (``triton.compile`` with a ``GPUTarget``; the
wheel ships ``ptxas`` and ``cuobjdump``), so the cost of the 12-bit loader can be read from the
machine code (SASS) the GPU would run: :func:`loop_profile` compiles
:func:`specpilot.kernels.step._linear_kernel` for one config, with the bf16 or the 12-bit loader,
with the argument alignments a launch would have, disassembles it and counts the instructions of
its main loop (the longest backward branch). One iteration covers ``BN x BK`` weights and runs on
``32 x warps`` threads, so thread-instructions per weight = loop instructions x 32 x warps /
(BN x BK; twice that with SwiGLU's gate and up tiles): the issue budget a memory-bound kernel
must fit (an H200 streams ~2.9e12 12-bit weights/s at 4.3 TB/s; 132 SMs x 4 schedulers x 32 lanes x ~1.75 GHz issue ~3e13
thread-instructions/s, so ~10 per weight; its integer pipes about half that).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

from ..errors import SpecpilotError
from ..fastpath.tables import LinearConfig, row_tile

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?")
# argument types of _linear_kernel for each loader, and those a launch passes 16-byte aligned
_SIG = ("x_ptr", "w_ptr", "y_ptr", "r_ptr", "nw_ptr", "M", "N", "K", "stride_xm", "stride_ym", "stride_rm", "eps",
        "m_ptr", "c_ptr", "side_ptr", "side_addr", "base2")
_ALIGNED = ("x_ptr", "w_ptr", "y_ptr", "r_ptr", "nw_ptr", "N", "K", "stride_xm", "stride_ym", "stride_rm",
            "m_ptr", "c_ptr", "side_ptr")


def _bin(name: str) -> str:
    import triton  # an optional dependency

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.isfile(path):
        raise SpecpilotError(f"Triton's {name} is not in this installation ({path}): cannot read the machine code")
    return path


def compile_linear(cfg: LinearConfig, w12: bool, norm: bool = False, residual: bool = True, swiglu: bool = False,
                   rows: int = 16, arch: int = 90):
    """``_linear_kernel`` compiled for ``sm_<arch>`` with ``cfg`` (row tile ``rows``), the bf16 or
    the 12-bit loader (N and K multiples of the tiles, as the engine's shapes are). Returns
    Triton's compiled kernel (``.asm``: ttir, ttgir, llir, ptx, cubin)."""
    import triton  # an optional dependency
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import step

    types = {"M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "stride_rm": "i32",
             "eps": "fp32", "side_addr": "i64", "base2": "i32",
             "m_ptr": "*u8" if w12 else "*bf16", "c_ptr": "*i32" if w12 else "*bf16",
             "side_ptr": "*i32" if w12 else "*bf16"}
    sig = {a: types.get(a, "*bf16") for a in _SIG}
    const = {"NORM": norm, "RES": residual, "SWIGLU": swiglu, "BM_": rows, "BN": cfg.bn, "BK": cfg.bk,
             "EVEN_K": True, "INTERP": False, "W12": w12, "EVEN_N": w12}
    sig.update({k: "constexpr" for k in const})
    attrs = {(list(sig).index(a),): [["tt.divisibility", 16]] for a in _ALIGNED}
    src = ASTSource(step._linear_kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.warps, "num_stages": cfg.stages})


def sass(kernel) -> str:
    """The SASS of a compiled kernel (``cuobjdump -sass``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([_bin("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def registers(kernel) -> int | None:
    """Registers per thread of a compiled kernel (``cuobjdump -res-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([_bin("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else None


def main_loop(text: str) -> list[tuple[int, str]]:
    """(address, opcode) of the instructions of the longest loop (a backward branch) of SASS ``text``."""
    insns = [(int(m.group(1), 16), m.group(3), line) for line in text.splitlines() if (m := _INSN.search(line))]
    best: list = []
    for a, op, line in insns:
        if op == "BRA":
            m = re.search(r"BRA\s+(?:\S+\s+)?(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line)
            if m and int(m.group(1), 16) < a:
                t = int(m.group(1), 16)
                body = [(x, o) for x, o, _ in insns if t <= x <= a]
                if len(body) > len(best):
                    best = body
    return best


def loop_profile(cfg: LinearConfig, w12: bool, rows: int = 16, **layout) -> dict:
    """Instructions per weight of the main loop of ``_linear_kernel`` for ``cfg`` (module docstring);
    ``layout``: ``norm``, ``residual``, ``swiglu`` as :func:`compile_linear` takes them.

    Returns ``{"config", "loader", "rows", "loop_instructions", "thread_instructions_per_weight",
    "registers", "mma" ("v2" mma.sync / "v3" wgmma), "kwidth" (the dot operand's, bf16 kernel's
    and 12-bit loader's must agree), "decode_run" (12-bit loader: the contiguous K elements per
    thread where the decode runs, a multiple of 8 for its groups; None for bf16), "opcodes":
    {opcode: count}}``.

    Raises:
        SpecpilotError: Triton, its ptxas or cuobjdump is missing.
    """
    k = compile_linear(cfg, w12, rows=rows, **layout)
    body = main_loop(sass(k))
    ttgir = k.asm["ttgir"]
    kw = sorted(set(re.findall(r"kWidth = (\d+)", ttgir)))
    run = None  # elements of K in a row each thread holds contiguously where the 12-bit decode runs
    m = re.search(r"tt.elementwise_inline_asm .*?-> tensor<\d+x\d+xbf16, #(\w+)>", ttgir)
    if m:
        d = re.search(r"#%s = #ttg.blocked<\{sizePerThread = \[\d+, (\d+)\].*?order = \[1, 0\]" % m.group(1), ttgir)
        run = int(d.group(1)) if d else 0
    per_iter = cfg.bn * cfg.bk * (2 if layout.get("swiglu") else 1)  # SwiGLU: a gate and an up tile
    return {"config": cfg.key(), "loader": "w12" if w12 else "bf16", "rows": rows,
            "loop_instructions": len(body),
            "thread_instructions_per_weight": len(body) * 32 * cfg.warps / per_iter,
            "registers": registers(k), "mma": "v3" if "versionMajor = 3" in ttgir else "v2",
            "kwidth": ",".join(kw), "decode_run": run,
            "opcodes": dict(collections.Counter(op for _, op in body).most_common())}


def role_profiles(roles: dict[str, tuple[str, bool, bool, bool]], rows: tuple[int, ...] = (1, 16)) -> list[dict]:
    """:func:`loop_profile` of both loaders for each ``{role: (config key, norm, residual, swiglu)}``
    at each row count. Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, which replaces the
    kernels by Python functions that cannot be compiled) it runs itself in a subprocess without it.

    Raises:
        SpecpilotError: the compilation failed (its error), Triton's tools are missing.
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        p = subprocess.run([sys.executable, "-m", "specpilot.kernels.inspect", json.dumps([roles, list(rows)])],
                           capture_output=True, text=True, env=env)
        if p.returncode:
            raise SpecpilotError(f"compiling the matmul kernel for sm_90 failed: {p.stderr.strip()[-600:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])
    out = []
    for role, (key, norm, res, swiglu) in roles.items():
        c = LinearConfig.parse(key)
        for m in rows:
            for w12 in (False, True):
                p = loop_profile(c, w12, rows=row_tile(m, c.bm), norm=norm and not c.prenorm, residual=res,
                                 swiglu=swiglu)
                out.append({**p, "role": role, "M": m})
    return out


if __name__ == "__main__":  # the subprocess of role_profiles
    args = json.loads(sys.argv[1])
    print(json.dumps(role_profiles({r: tuple(v) for r, v in args[0].items()}, tuple(args[1]))))
