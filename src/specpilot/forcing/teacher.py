"""Part 1 of token forcing: the teacher-forced pass, the target's margin at every output token.

Two paths compute the same quantity, ``margin = (target's top-1 logit) - (logit of the
candidate's token)`` at every output position given prompt + the candidate's own prefix:
:func:`teacher_forced` (the target's eager, cache-free forward: the CPU path, and engines that did
not run the Triton step) and :func:`teacher_forced_engine` (the engine's own Triton step, in the
batches of :func:`engine_prefill_batches`). :func:`pick_teacher_forced_path` chooses between them
as the engine chose its kernels; :func:`tolerance_for` gives the near-tie tolerance the margins are
judged against (:mod:`specpilot.forcing.verdict`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..engine.backend import Backend
from ..engine.config import EngineConfig, EngineSpec
from ..engine.runner import TargetRunner
from ..errors import SpecpilotError
from ..fastpath.graphs import StepGraphs
from ..records import Record

# config forcing.tolerance's default (config/schema.yaml), for the CLI without --tolerance
DEFAULT_TOLERANCE = {"fp32": 0.001, "bf16": 0.1}
CHUNK = 512  # output positions whose logits are reduced at once (fp32) in the teacher-forced check
TF_ROWS = 256  # block rows (batch x width) per Triton step of the engine-kernel teacher-forced pass
TF_BATCH = 16  # rows per batch for prompts the engine prefilled through the Triton step
TF_PATHS = ("auto", "eager", "triton")
_DECODE_STATE = ("cache", "state", "cos", "sin")  # the target's attributes a pass puts back


def tolerance_for(setting, dtype: str) -> float:
    """Near-tie tolerance for a compute dtype from config ``forcing.tolerance``.

    Args:
        setting: a number (every dtype) or a mapping ``{fp32: x, bf16: y}``.
        dtype: ``fp32`` or ``bf16`` (the deployment's compute dtype; w12 computes in bf16).
    Returns:
        the tolerance, a top-1 logit margin in logit units (>= 0).
    Raises:
        SpecpilotError: the mapping has no entry for ``dtype``, or the value is negative.
    """
    value = setting.get(dtype) if isinstance(setting, dict) else setting
    if value is None:
        raise SpecpilotError(f"forcing.tolerance has no value for dtype {dtype!r} (has {sorted(setting)})")
    if not isinstance(value, (int, float)) or value < 0:
        raise SpecpilotError(f"forcing.tolerance for {dtype} must be a number >= 0, got {value!r}")
    return float(value)


def teacher_forced(target, prompt_ids: list[int], output_ids: list[int], chunk: int = CHUNK
                   ) -> tuple[list[int], list[float]]:
    """The target's greedy choice and the candidate token's margin at every output position.

    One cache-free causal forward of the target over ``prompt_ids + output_ids[:-1]`` (the last
    output token is predicted, never fed): exact from an empty state for every layer type, so no
    KV entry or recurrent (GDN) state left by an engine run can leak in. The logits of the output
    positions are reduced ``chunk`` rows at a time (fp32). The target's decoding state and RoPE
    tables are put back afterwards, so an engine's captured CUDA graphs stay valid.

    Args:
        target: a loaded target model (:mod:`specpilot.models.target`; any dtype/device).
        prompt_ids, output_ids: token ids, each inside the vocabulary; output_ids non-empty.
        chunk: output positions whose logits are reduced at once (>= 1).
    Returns:
        (top1, margin), each of length ``len(output_ids)``: the target's argmax token id and
        ``max logit - logit[output_ids[j]]`` (float, logit units, >= 0; computed in fp32 from the
        model-dtype logits) at output position j.
    Raises:
        SpecpilotError: empty prompt or output.
    """
    if not prompt_ids or not output_ids:
        raise SpecpilotError("teacher forcing needs a non-empty prompt and output")
    P, n = len(prompt_ids), len(output_ids)
    seq = list(prompt_ids) + list(output_ids[:-1])
    dev = target.lm_head.weight.device
    tokens = torch.tensor([seq], dtype=torch.long, device=dev)
    cand = torch.tensor(output_ids, dtype=torch.long, device=dev)
    saved = {k: getattr(target, k, None) for k in _DECODE_STATE}
    top1, margin = [], []
    try:
        with torch.inference_mode():
            logits, _ = target.forward_causal(tokens)
            out = logits[0, P - 1:]  # row j predicts output token j
            for s in range(0, n, chunk):
                lg = out[s:s + chunk].float()
                best = lg.max(-1)
                top1 += best.indices.tolist()
                margin += (best.values - lg.gather(1, cand[s:s + chunk, None])[:, 0]).tolist()
    finally:
        for k, v in saved.items():
            if hasattr(target, k):
                setattr(target, k, v)
    assert len(top1) == n
    return top1, margin


def pick_teacher_forced_path(backend: Backend, candidate: list[Record], asked: str = "auto") -> str:
    """Which kernels the teacher-forced pass runs for a cell: ``"triton"`` (the engine's) or
    ``"eager"``: the target's backend decides (:meth:`~specpilot.engine.backend.Backend.teacher_forced_path`)
    from the records' engine configs.

    ``auto`` picks ``"triton"`` exactly when the candidate's engine ran its prefix and verify steps
    through the Triton dense step as the engine decides it by default: the backend's path is
    ``triton-dense`` and no record's ``engine_config`` converts the weights (``weight_format`` other
    than bf16) or verifies trees wider than the Triton step takes. Else ``"eager"`` (the CPU path).
    An engine run with ``--graphs off`` or ``--kernels torch`` is not recorded in its records: pass
    ``asked="eager"`` for it.

    Raises:
        SpecpilotError: an unknown ``asked``; ``triton`` asked for a target the Triton step cannot
            run (not dense / not plain linears), or on the CPU without ``TRITON_INTERPRET=1``.
    """
    if asked not in TF_PATHS:
        raise SpecpilotError(f"unknown teacher-forced path {asked!r}; use {', '.join(TF_PATHS)}")
    return backend.teacher_forced_path([r.engine_config or {} for r in candidate], asked)


def engine_prefill_batches(candidate: list[Record], prompt_of: Callable[[Record], list[int] | None]
                           ) -> list[list[Record]]:
    """The batches of the Triton teacher-forced pass: the candidate's records with a prompt, in
    record order, ``TF_BATCH`` at a time.

    On the Triton fast path the engine prefills every prompt the same way whatever the regime,
    the concurrency or the arrival order: row by row through the Triton step
    (:meth:`~specpilot.engine.runner.TargetRunner.prefill` and the continuous-batching refills
    both run :meth:`~specpilot.engine.runner.TargetRunner.prefill_row`), and the step is
    row-invariant, so :func:`teacher_forced_engine` reproduces any request's logits in any batch.

    Args:
        candidate: records; prompt_of: record -> prompt ids (None: the record is left out).
    Returns:
        lists of at most ``TF_BATCH`` records, covering every record with a prompt once.
    """
    recs = [r for r in candidate if prompt_of(r)]
    return [recs[i:i + TF_BATCH] for i in range(0, len(recs), TF_BATCH)]


def _fast_target(backend: Backend, kernel_configs: dict | None = None):
    """A Triton step of the backend's target (dense, or the family step of a hybrid /
    sliding-window target) with the matmul configs the engine's step uses (the backend's, e.g. from
    ``run --kernel-configs``), else the defaults; ``kernel_configs`` on top. Its workspaces are its
    own (the engine's captured graphs keep theirs)."""
    from ..fastpath.dense import FastTarget  # the Triton steps: an optional dependency
    from ..fastpath.family import FastFamilyTarget

    model = backend.model
    fast = FastTarget(model) if model.config.is_dense else FastFamilyTarget(model)
    if backend.fast is not None:
        fast.configs = dict(backend.fast.configs)
        fast.attn_rows = backend.fast.attn_rows
    if kernel_configs:
        fast.set_configs(kernel_configs)
    return fast


def engine_verify_width(candidate: list[Record]) -> int:
    """The widest block the engine of ``candidate`` verified: the largest
    :attr:`~specpilot.engine.config.EngineSpec.verify_width` of the records' engine configs (1 for
    AR; a record whose config does not parse counts 1: the structure check reports it)."""
    width = 1
    for r in candidate:
        try:
            cfg = EngineConfig.parse(r.engine_config or {}, "the record's engine_config", record=True)
            block = cfg.block_size if isinstance(cfg.block_size, int) else 1
            spec = EngineSpec(r.engine, block, cfg.without("block_size"))
        except SpecpilotError:
            continue
        width = max(width, spec.verify_width)
    return width


def _engine_width(prompts: list[list[int]], outputs: list[list[int]], width: int | None) -> int:
    """Output positions per row per Triton step, after checking the rows (see
    :func:`teacher_forced_engine`'s Raises)."""
    if not prompts or len(prompts) != len(outputs):
        raise SpecpilotError(f"teacher forcing needs as many outputs as prompts (got {len(prompts)} / {len(outputs)})")
    if any(not p for p in prompts) or any(not o for o in outputs):
        raise SpecpilotError("teacher forcing needs a non-empty prompt and output")
    W = int(width) if width is not None else max(1, TF_ROWS // len(prompts))
    if W < 1:
        raise SpecpilotError(f"teacher-forced width must be >= 1, got {width}")
    return W


def _prefill_rows(fast, prompts: list[list[int]], outputs: list[list[int]], dev: torch.device,
                  top1: list[list[int]], margin: list[list[float]]) -> None:
    """Prefill each prompt into its own cache row as the engine's ``prefill_row`` does (the whole
    prompt at slot 0, ``last_only``) and append output position 0's top-1 and margin per row."""
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        tok = torch.tensor([list(p)], dtype=torch.long).to(dev)
        lg = fast.forward(tok, zero, rows=slice(b, b + 1), last_only=True)[0][0, 0].float()
        top1[b].append(int(lg.argmax()))
        margin[b].append((lg.max() - lg[outputs[b][0]]).item())


def _feed_chunk(fast, seqs: list[list[int]], outputs: list[list[int]], s: int, w: int,
                start0: torch.Tensor, top1: list[list[int]], margin: list[list[float]]) -> None:
    """Feed the fed positions ``s .. s + w - 1`` of every row (``seqs[b]``: output[:-1]) through
    one Triton step at ``start0 + s`` and append the top-1 and margin of each output position they
    predict (``s + j + 1``); rows shorter than the chunk are padded and their pad columns ignored."""
    B = len(seqs)
    block = torch.zeros(B, w, dtype=torch.long)
    cand = torch.zeros(B, w, dtype=torch.long)
    want = []  # (row, block column, output index)
    for b, x in enumerate(seqs):
        part = x[s:s + w]
        if part:
            block[b, :len(part)] = torch.tensor(part, dtype=torch.long)
        for j in range(len(part)):
            k = s + j + 1
            cand[b, j] = outputs[b][k]
            want.append((b, j, k))
    dev = start0.device
    logits, _ = fast.forward(block.to(dev), start0 + s)
    lg = logits.float()
    best = lg.max(-1)
    mg = best.values - lg.gather(2, cand.to(dev)[:, :, None])[:, :, 0]
    tops, mgs = best.indices.tolist(), mg.tolist()
    for b, j, k in want:
        assert k == len(top1[b])
        top1[b].append(tops[b][j])
        margin[b].append(mgs[b][j])


class _Uncaptured(StepGraphs):
    """A step run directly (the teacher pass captures nothing: its shapes change every chunk)."""

    def run(self, tokens, start, capture=(), tree=None, write=False):
        return self.step(tokens, start, capture, tree, write)


def _family_pass(backend: Backend, fast, prompts: list[list[int]], outputs: list[list[int]], W: int,
                 top1: list[list[int]], margin: list[list[float]], verify_width: int = 1) -> None:
    """The teacher-forced pass of a hybrid / sliding-window target through the family step, as the
    engine runs it: a runner over ``fast``, its rings sized for the engine's ``verify_width`` as
    the engine's were, prefills each prompt with the engine's ``prefill_row`` calls (in the
    runner's fixed pieces on a sliding-window target,
    :attr:`~specpilot.engine.runner.TargetRunner.prefill_piece`: the engine's pieces whatever its
    cache size; the recurrent state written as it goes), then feeds the outputs in verify steps of
    at most ``W`` positions per row (no wider than the ring allows), each committed as the engine
    commits an accepted block (the Gated DeltaNet state re-run over the committed tokens,
    :meth:`~specpilot.fastpath.family.FastFamilyTarget.commit_recurrent`). The family step computes
    a token's row with the same arithmetic whatever the block it is in, the cache size or the
    ring's slot of each position (its attention reads keys by position), so these are the logits
    the engine saw."""
    model = backend.model
    B, P = len(prompts), [len(p) for p in prompts]
    seqs = [list(o[:-1]) for o in outputs]
    total = max(len(x) for x in seqs)
    S = max(P) + max(1, total)
    step = Backend(model, "triton-family", "teacher-forced pass", False, "triton", _Uncaptured(model, fast))
    runner = TargetRunner(model, B, S, (), step, verify_width=verify_width)
    W = min(W, runner.max_block)
    dev = runner.device
    for b, p in enumerate(prompts):
        lg = runner.prefill_row(b, list(p), 0)[0].float()
        top1[b].append(int(lg.argmax()))
        margin[b].append((lg.max() - lg[outputs[b][0]]).item())
    for s in range(0, total, W):
        w = min(W, total - s)
        parts = [x[s:s + w] for x in seqs]
        _feed_chunk(_RunnerStep(runner), seqs, outputs, s, w, runner.length, top1, margin)
        runner.commit(torch.tensor([len(x) for x in parts], dtype=torch.long, device=dev))


class _RunnerStep:
    """``forward(block, start)`` of a runner's verify (:func:`_feed_chunk`'s interface)."""

    def __init__(self, runner: TargetRunner):
        self.runner = runner

    def forward(self, block, start):
        return self.runner.verify(block)


def teacher_forced_engine(backend: Backend, prompts: list[list[int]], outputs: list[list[int]], width: int | None = None,
                          kernel_configs: dict | None = None, verify_width: int = 1
                          ) -> list[tuple[list[int], list[float]]]:
    """The teacher-forced check through the engine's own kernels, for one batch of requests.

    What the Triton fast path of the engine computes, reproduced: each prompt is prefilled as the
    engine prefills every prompt there, into its own cache row through the Triton step
    (:meth:`~specpilot.fastpath.dense.FastTarget.forward` of the prompt alone, ``last_only``: the
    call :meth:`~specpilot.engine.runner.TargetRunner.prefill_row` makes, so the prompt's K/V and
    the first token's logits are the engine's, bit for bit). Then output[:-1] is fed in chunks of
    ``width`` positions per row through ``FastTarget.forward`` (the step the engine's decode and
    chain verify replay under CUDA graphs), all rows at once, and every position's logits are
    read. The step is row- and width-invariant by design (a row's bits do not depend on the
    batch, the block width or the cache size; checked on the GPU by ``specpilot bench verify``),
    so these are the logits the engine saw when it emitted each token, and every token of an
    honest engine has margin exactly 0 (unless matmul configs run cuBLAS, which pads rows and is
    not row-invariant beyond 16 rows: margins then fall to the tolerance). It verifies that every
    output token is the argmax of the target *as the deployment computes it* (these weights and
    kernels), given the candidate's own prefix, whatever the engine did between tokens; a token
    that is not that argmax has the same margin as under any other kernel up to rounding.

    The target's decoding state (``cache``, ``state``, ``cos``, ``sin``, the cache key) is put
    back afterwards and the pass uses a fresh cache and its own FastTarget workspaces, so an
    engine's captured CUDA graphs stay valid.

    Args:
        backend: the target's backend (:func:`~specpilot.engine.backend.choose_backend`; its
            matmul tables are the pass's); the target: a dense target the Triton step supports (CUDA, or CPU under
            ``TRITON_INTERPRET=1``), any float dtype.
        prompts, outputs: per row the prompt and the candidate's output token ids (non-empty,
            inside the vocabulary).
        width: output positions per row per Triton step (default ``TF_ROWS // len(prompts)``, >= 1;
            on a sliding-window target at most the ring's reserve).
        kernel_configs: FastTarget matmul configs on top of the engine's (see :func:`_fast_target`).
        verify_width: the widest block the engine verified (:func:`engine_verify_width` of its
            records): sizes the sliding-window rings as the engine's were.
    Returns:
        per row (top1, margin), each of length ``len(output)``: the target's argmax token id and
        ``max logit - logit[output[j]]`` (float, logit units, >= 0; fp32 from the model-dtype
        logits) at output position j, as :func:`teacher_forced`.
    Raises:
        SpecpilotError: no rows, rows of different counts, an empty prompt or output, a width < 1.
    """
    W = _engine_width(prompts, outputs, width)
    B, P = len(prompts), [len(p) for p in prompts]
    seqs = [list(o[:-1]) for o in outputs]  # position P_b + i holds output[i]; its logits predict output[i + 1]
    total = max(len(x) for x in seqs)
    target = backend.model
    dev = target.lm_head.weight.device
    top1: list[list[int]] = [[] for _ in range(B)]
    margin: list[list[float]] = [[] for _ in range(B)]
    saved = {k: getattr(target, k, None) for k in (*_DECODE_STATE, "_state_key")}
    try:
        target.state = None  # a fresh cache: the engine's (and its graphs' addresses) stay untouched
        fast = _fast_target(backend, kernel_configs)  # fuses q/k/v, gate/up as the engine did before its prefill
        with torch.inference_mode():
            if not target.config.is_dense:
                _family_pass(backend, fast, prompts, outputs, W, top1, margin, verify_width)
                return _finish(top1, margin, outputs)
            target.setup_cache(B, max(P) + max(1, total))  # the step's results do not depend on the cache size
            _prefill_rows(fast, prompts, outputs, dev, top1, margin)
            start0 = torch.tensor(P, dtype=torch.long, device=dev)
            for s in range(0, total, W):
                _feed_chunk(fast, seqs, outputs, s, min(W, total - s), start0, top1, margin)  # full width but the last
    finally:
        for k, v in saved.items():
            setattr(target, k, v)
    return _finish(top1, margin, outputs)


def _finish(top1: list[list[int]], margin: list[list[float]], outputs: list[list[int]]) -> list[tuple]:
    for b in range(len(outputs)):
        assert len(top1[b]) == len(outputs[b]), (b, len(top1[b]), len(outputs[b]))
    return list(zip(top1, margin))
