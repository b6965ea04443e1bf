"""Target runner: the static-state target model plus per-row committed lengths.

Operations (all shapes static per batch): prefill prompts, decode one token, verify a block or
tree of candidates, commit the accepted path and roll back the rest. The per-layer state behind
commit/rollback (KV truncation and tree compaction, sliding-window rings, Gated DeltaNet
checkpoint + replay) lives in :mod:`specpilot.models.state`.
"""

from __future__ import annotations

import torch

from ..errors import SpecpilotError
from ..models.layers import chain_ancestors, tree_ancestors
from ..models.ragged import Segment, forward_ragged, ragged_supported
from ..models.state import check_width
from ..models.target import PREFILL_PIECE, Transformer, ring_reserve
from .backend import Backend, choose_backend
from .verify import compact_path_, compact_ring_path_, tree_inputs


# Token trees on a Gated DeltaNet hybrid target in the Triton family step run on a GPU again. On the
# H200 (2026-12-05, scripts/gpu_families.sh, BENCHMARKS.md "Targets by family") 31- and 63-node
# static trees on the Qwen3.8-27B hybrid shape differed from AR (0/3 at c1, first at a 0.125-logit
# margin) and were refused here (HYBRID_TREE_REFUSAL) until the cause was found: the tree
# attention by paths (kernels/step.py, _attn_partial_kernel, PATH) put a node's G query rows in
# the row tile a chain gives them, and with G = 24 / 4 = 6 (not a divisor of the 16-row tile) the
# rows of some nodes crossed the tile's end and were never computed (their partial sums over the
# tree's chunks stayed empty, > 16 nodes, or stale, fewer). Fixed by ending such a node's tile at
# its last row (test: tests/test_family_trees.py, heads straddling tiles); the tiny hybrid (G = 2)
# never hit it. On the H100 (3c525d7) the 27B's 31- and 63-node trees then equal AR at c1 and c16.


class TargetRunner:
    """Drives a :class:`Transformer` over a batch of rows with independent committed lengths.

    ``length[b]`` is the number of positions of row b whose K/V are in the cache and committed.

    How it runs is the ``backend``'s decision (:func:`~specpilot.engine.backend.choose_backend`;
    default: chosen for ``model`` with graphs and kernels auto). Under CUDA graphs chain verify and
    decode steps replay captured graphs (:class:`~specpilot.fastpath.graphs.StepGraphs`); so does
    tree verification on the Triton dense step (ancestor bits, the accepted path compacted on the
    device by :func:`~specpilot.engine.verify.compact_path_`); the eager backends run trees eager. Prefill runs
    through the Triton step row by row on the Triton paths (:attr:`can_prefill_rows`:
    batch-invariant, the path every continuous-batching refill takes too), else eager. Hybrid (GDN)
    and Muse-Glimmer targets on the Triton family step run the same way (decode graphs advance the
    GDN state; a verify's accepted tokens, a tree's accepted path, are re-run into it at
    :meth:`commit`); their trees verify in the family step too. The runner never reads ``length`` on the host inside a step: a host
    upper bound of it decides whether the cache has room, and only when that bound is too loose
    is the exact length read (a synchronization).
    """

    def __init__(self, model: Transformer, batch: int, max_seq: int, capture: tuple[int, ...] = (),
                 backend: Backend | None = None, verify_width: int = 1, fused: bool = False):
        self.model = model
        self.batch, self.max_seq, self.capture = batch, max_seq, tuple(capture)
        self.device = model.lm_head.weight.device
        self.backend = backend if backend is not None else choose_backend(model)
        if self.backend.model is not model:
            raise SpecpilotError("the runner's backend was chosen for another model")
        self.verify_width = int(verify_width)  # the widest block the engine verifies (sizes the rings)
        model.setup_cache(batch, max_seq, verify_width=ring_reserve(self.verify_width))
        # verify and decode steps through the fused CPU step (engine config verify_path: fused)
        self.fused = self.backend.fused_step() if fused else None
        self.length = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.steps = self.backend.step_graphs  # the captured steps (None: eager)
        self._recurrent = model.config.is_recurrent
        self._tree_pending = False  # the last verify was a tree in the Triton step (commit compacts on the device)
        self._bound = 0  # host upper bound of max(length)
        self._pending = 0  # entries written by the last verify, not yet committed
        self._grew = 0  # how much the last commit raised the bound (settle() may lower it)
        self._tree_key, self._tree = None, None  # (the last tree's parents tensor, fast) and its mask or Triton inputs

    def _check_room(self, n: int) -> None:
        if self._bound + n <= self.max_seq:
            return
        self._bound = int(self.length.max())
        need = self._bound + n
        if need > self.max_seq:
            raise SpecpilotError(f"sequence needs {need} KV-cache slots but the cache holds {self.max_seq}")

    @property
    def prefill_path(self) -> str:
        """How :meth:`prefill` runs by default: ``"triton"`` (row by row through the Triton step,
        :attr:`can_prefill_rows`) or ``"eager"`` (one right-padded block through the eager forward)."""
        return "triton" if self.can_prefill_rows else "eager"

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], pad_id: int = 0, rows: bool | None = None,
                chunk: int | None = None):
        """Process prompts from an empty cache.

        ``rows`` None (default) = :attr:`prefill_path`. Triton (``rows`` True, needs
        :attr:`can_prefill_rows`): each prompt through :meth:`prefill_row` into its own cache row,
        in chunks of ``chunk`` tokens (None: whole), exactly the calls a continuous-batching refill
        makes (:class:`~specpilot.engine.scheduler.Scheduler`), so a request's prompt K/V, features
        and first-token logits are bit-identical whatever batch, concurrency or arrival order it is
        served in (the step is row-invariant). Eager (``rows`` False, the CPU and non-Triton
        path): the prompts right-padded into one block through the eager forward (cuBLAS on CUDA:
        a row's bits may depend on the batch).

        Returns:
            last_logits [B, vocab] at each prompt's last token, features [B, Tmax, F] (None
            without capture; zero past a prompt's end on the Triton path), and lengths int64 [B].
            Sets ``length`` to the prompt lengths.
        """
        B = len(prompts)
        if B != self.batch:
            raise SpecpilotError(f"prefill got {B} prompts for a batch of {self.batch}")
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        if int(lengths.min()) == 0:
            raise SpecpilotError("empty prompt")
        T = int(lengths.max())
        if T > self.max_seq:
            raise SpecpilotError(f"prompt of {T} tokens exceeds the KV cache of {self.max_seq} slots")
        if chunk is not None and int(chunk) < 1:
            raise SpecpilotError(f"prefill chunk must be >= 1, got {chunk}")
        if rows is None:
            rows = self.can_prefill_rows
        if rows:
            return self._prefill_rows(prompts, lengths, T, chunk)
        tokens = torch.full((B, T), pad_id, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        self.length.zero_()
        self.model.state.reset()
        logits, feats = self.model(tokens, self.length, chain_ancestors(B, T, self.device), capture=self.capture,
                                   lengths=lengths, write=True)
        self.length.copy_(lengths)
        self._bound, self._pending = T, 0
        return logits[torch.arange(B, device=self.device), lengths - 1], feats, lengths

    def _prefill_rows(self, prompts: list[list[int]], lengths: torch.Tensor, T: int, chunk: int | None):
        """:meth:`prefill` through :meth:`prefill_row`, one prompt (and chunk) after the other."""
        if not self.can_prefill_rows:
            raise SpecpilotError(f"row prefill needs a Triton step; this target runs {self.backend.path}: {self.backend.reason}")
        self.model.state.reset()
        self.length.zero_()
        self._bound, self._pending = 0, 0
        last, feats = [], None
        for b, p in enumerate(prompts):
            C = int(chunk or len(p))
            for s0 in range(0, len(p), C):
                logits, f = self.prefill_row(b, p[s0:s0 + C], s0)
                if f is not None:
                    if feats is None:
                        feats = torch.zeros(self.batch, T, f.shape[-1], dtype=f.dtype, device=f.device)
                    feats[b, s0:s0 + f.shape[1]] = f[0]
            last.append(logits.clone())  # a view would keep the row's whole [T, vocab] workspace alive
        self._bound = T
        return torch.stack(last), feats, lengths

    @property
    def can_prefill_rows(self) -> bool:
        """True when :meth:`prefill_row` is available (a Triton step)."""
        return self.backend.can_prefill_rows

    @property
    def prefill_piece(self) -> int | None:
        """Tokens per :meth:`prefill_row` forward: :data:`~specpilot.models.target.PREFILL_PIECE`
        on a target with sliding-window layers, whether or not its ring wraps at this cache size,
        so every caller (the engine at any concurrency and KV-cache size, token forcing's teacher
        pass) prefills a prompt in the same pieces (fewer when a ring was sized smaller by hand);
        None (whole prompts) otherwise."""
        ring = self.model.state.ring
        return min(PREFILL_PIECE, ring.reserve) if ring is not None else None

    @property
    def max_block(self) -> int:
        """The widest block one :meth:`verify` may hold: the sliding-window ring's reserve (a wider
        block would evict live ring entries of its own rows), else the KV cache's size."""
        ring = self.model.state.ring
        return ring.reserve if ring is not None else self.max_seq

    @torch.inference_mode()
    def prefill_row(self, b: int, tokens: list[int], start: int, set_length: bool = True):
        """Prefill ``tokens`` into cache row ``b`` at positions start .. start+T-1 and commit them,
        leaving every other row untouched (continuous batching: a newcomer's prompt costs its own
        T rows, not T x batch). ``set_length`` False: the row's committed length is left as it is
        (a row :meth:`park_row`-ed at the prompt's length while its prefill runs on another stream).

        Returns the logits [vocab] at the last position and captured features [1, T, F] (or None). Needs
        :attr:`can_prefill_rows`; raises SpecpilotError otherwise or when the row has no room.
        """
        if not self.can_prefill_rows:
            raise SpecpilotError(f"row prefill needs a Triton step; this target runs {self.backend.path}: {self.backend.reason}")
        T = len(tokens)
        if start + T > self.max_seq:
            raise SpecpilotError(f"row {b}: prefill to {start + T} KV-cache slots but the cache holds {self.max_seq}")
        step = self.prefill_piece or T  # sliding-window targets: fixed pieces (PREFILL_PIECE)
        if T > step:
            out = [self.prefill_row(b, tokens[s0:s0 + step], start + s0, set_length) for s0 in range(0, T, step)]
            feats = [f for _, f in out]
            return out[-1][0], (torch.cat(feats, 1) if feats[0] is not None else None)
        tok = torch.tensor([tokens], dtype=torch.long).to(self.device)
        st = torch.full((1,), start, dtype=torch.long, device=self.device)
        logits, feats = self.backend.fast.forward(tok, st, self.capture, rows=slice(b, b + 1), last_only=True,
                                                 write=True)
        if set_length:
            self.length[b] = start + T
        self._bound = max(self._bound, start + T)
        return logits[0, 0], feats

    def park_row(self, b: int, length: int) -> None:
        """Set row ``b``'s committed length to ``length`` for a newcomer whose prompt of that many
        tokens is being prefilled into the row beside the running rows' steps
        (:meth:`~specpilot.engine.scheduler.Scheduler._launch_beside`): meanwhile every verify
        writes the row's cache at slots >= ``length`` only, never the prompt's. Dense targets only
        (a recurrent state or a sliding-window ring of the row would be shared with the prefill).

        Raises SpecpilotError for other targets or a length beyond the cache.
        """
        if not self.model.config.is_dense:
            raise SpecpilotError("parking a row for a prefill beside the decode steps needs a dense target")
        if not 0 <= length <= self.max_seq:
            raise SpecpilotError(f"row {b}: length {length} outside the KV cache of {self.max_seq} slots")
        self.length[b] = length
        self._bound = max(self._bound, length)

    @torch.inference_mode()
    def verify(self, block: torch.Tensor, parents: torch.Tensor | None = None, max_depth: int | None = None):
        """Run candidates [B, N] (chain, or a tree given parents [B, N]) at the committed lengths.

        ``max_depth``: a tree that changes every step (:attr:`~specpilot.drafters.proposal.Proposal.max_depth`):
        its ancestor inputs are built every step with no host synchronization.
        The cache holds their K/V afterwards, but ``length`` does not move: call :meth:`commit`.
        Returns logits [B, N, vocab] and captured features [B, N, F] (or None).
        """
        B, N = block.shape
        self._check_room(N)
        check_width(self.model.state, N)
        self._pending = N
        self.model.state.discard()
        if self.fused is not None:
            anc = depth = None
            if parents is not None:  # the tree shape is static within a generation: its mask once
                key = (parents.data_ptr(), tuple(parents.shape), False)
                if self._tree_key != key:
                    self._tree_key, self._tree = key, tree_ancestors(parents)
                anc, depth = self._tree
            return self.fused.forward(block, self.length, self.capture, anc, depth)
        if parents is None and self.steps is not None:
            out = self.steps.run(block, self.length, self.capture)
            if self._recurrent:  # a graph replay runs no Python: tell the fast path which tape commit() re-runs
                self.steps.fast.note_verify(B, N, len(self.capture))
            return out
        if parents is None:
            anc, depth = chain_ancestors(B, N, self.device), None
            return self.model(block, self.length, anc, depth, capture=self.capture, parents=parents)
        # a static tree shape reuses one parents tensor every step: its mask (or Triton inputs) is
        # built once. The key holds the tensor itself (identity, not its address: a dynamic tree's
        # new parents tensor may reuse a freed one's memory). A tree the Triton step cannot take
        # (wider or deeper than its tables) stops here: it never falls back to the eager forward,
        # whose arithmetic differs from the step's
        fast = self.tree_fast
        key = (parents, fast)
        if self._tree_key is None or self._tree_key[0] is not parents or self._tree_key[1] != fast:
            self._tree_key = None
            self._tree = tree_inputs(parents, max_depth, paths=self.backend.path == "triton-family") if fast \
                else tree_ancestors(parents, max_depth)
            self._tree_key = key
        if fast:  # the Triton step with the tree's inputs, replayed like a chain verify
            self._tree_pending = True
            out = self.steps.run(block, self.length, self.capture, tree=self._tree)
            if self._recurrent:  # which workspace commit() re-runs the accepted path from
                self.steps.fast.note_verify(B, N, len(self.capture))
            return out
        anc, depth = self._tree
        return self.model(block, self.length, anc, depth, capture=self.capture, parents=parents)

    def mix_refusal(self) -> str | None:
        """Why this runner cannot run a mixed prefill step (:meth:`verify_mixed`), naming the path
        that cannot; None when it can. Only the eager forward runs ragged rows: the Triton step's
        CUDA graphs are captured per uniform (rows, width) block and the fused CPU step takes one
        width per forward; targets with sliding-window or linear-attention layers keep per-row
        state a ragged segment would have to advance on its own."""
        if self.steps is not None or self.backend.path != "eager":
            return (f"the {self.backend.path} path (its steps are Triton kernels or CUDA graphs captured per "
                    f"uniform (rows, width) block) cannot run a mixed prefill step; it needs the eager path")
        if self.fused is not None:
            return "the fused CPU step (verify_path: fused) cannot run a mixed prefill step; it needs verify_path: plain"
        if not ragged_supported(self.model.config):
            return (f"a target with {sorted(set(self.model.config.layer_types) - {'full_attention'})} layers cannot run "
                    f"a mixed prefill step (full-attention targets only)")
        return None

    @torch.inference_mode()
    def verify_mixed(self, block: torch.Tensor, rows: list[int], pieces: list[tuple[int, list[int]]],
                     parents: torch.Tensor | None = None, max_depth: int | None = None):
        """One mixed step (:mod:`specpilot.models.ragged`): the candidates of ``rows`` (of block
        [B, N], a chain or a tree given parents [B, N], at the committed lengths, as :meth:`verify`)
        and each piece ``(b, tokens)``'s prompt chunk at row b's committed length, in one ragged
        forward. Rows in neither list are not run. Nothing is committed: :meth:`commit` the decode
        rows' counts, then :meth:`commit` the pieces' lengths.

        Returns:
            logits [B, N, vocab] and features [B, N, F] (or None) of the decode rows (zeros in the
            other rows), and per piece its logits [t, vocab] and features [t, F] (or None).
        Raises:
            SpecpilotError: :meth:`mix_refusal`; a row in both lists; a block or chunk beyond the cache.
        """
        why = self.mix_refusal()
        if why is not None:
            raise SpecpilotError(f"mixed_prefill: {why}")
        B, N = block.shape
        if set(rows) & {b for b, _ in pieces}:
            raise SpecpilotError(f"mixed step: rows {sorted(set(rows) & {b for b, _ in pieces})} both decode and prefill")
        if rows:
            self._check_room(N)
        self._pending = N
        self.model.state.discard()
        if parents is None:
            anc, depth = chain_ancestors(B, N, self.device), None
        else:
            anc, depth = tree_ancestors(parents, max_depth)
        starts = self.length.tolist()
        segs = [Segment(b, block[b], starts[b], anc[b], None if depth is None else depth[b]) for b in rows]
        for b, toks in pieces:
            t = len(toks)
            segs.append(Segment(b, torch.tensor(toks, dtype=torch.long, device=self.device), starts[b],
                                torch.ones(t, t, dtype=torch.bool, device=self.device).tril()))
        flat, feats_flat = forward_ragged(self.model, segs, self.capture)
        logits = flat.new_zeros(B, N, flat.shape[-1])
        feats = None if feats_flat is None else feats_flat.new_zeros(B, N, feats_flat.shape[-1])
        o = 0
        for b in rows:
            logits[b] = flat[o:o + N]
            if feats is not None:
                feats[b] = feats_flat[o:o + N]
            o += N
        out = []
        for _, toks in pieces:
            t = len(toks)
            out.append((flat[o:o + t], None if feats_flat is None else feats_flat[o:o + t]))
            o += t
        return logits, feats, out

    @property
    def tree_fast(self) -> bool:
        """True when tree verification runs in the Triton step (the backend's Triton path, dense or
        family: every tree up to depth 64, bit-equal to decoding its paths); else the backend's
        whole engine runs eager and trees with it."""
        return self.backend.tree_fast

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor):
        """Decode one token per row (tokens int64 [B]); commits it. Returns logits [B, vocab]."""
        if self.steps is not None and self._recurrent:  # the decode graph advances the GDN state
            self._check_room(1)
            self.model.state.discard()
            logits, _ = self.steps.run(tokens[:, None], self.length, self.capture, write=True)
        elif self.steps is not None:
            logits, _ = self.verify(tokens[:, None])
        elif self.fused is not None:  # a dense target: a decode step is a one-token verify
            self._check_room(1)
            self.model.state.discard()
            logits, _ = self.fused.forward(tokens[:, None], self.length, self.capture)
        else:
            self._check_room(1)
            self.model.state.discard()
            B = tokens.shape[0]
            logits, _ = self.model(tokens[:, None], self.length, chain_ancestors(B, 1, self.device),
                                   capture=self.capture, write=True)
        self.length += 1
        self._bound, self._pending = self._bound + 1, 0
        return logits[:, 0]

    @torch.inference_mode()
    def commit(self, counts: torch.Tensor, path_slots: torch.Tensor | None = None) -> None:
        """Keep ``counts[b]`` block entries of row b and roll back the rest.

        For a tree, ``path_slots`` int64 [B, P] lists the accepted nodes' block indices in order;
        their K/V are moved to contiguous slots so the cache stays chain-shaped, and a recurrent
        (GDN) state replays exactly that path from the committed state.
        """
        if path_slots is not None and self._tree_pending:  # a tree in the Triton step: on the device, no sync
            st = self.model.state
            if st.kv is not None:
                compact_path_(st.kv, self.length, counts, path_slots)
            if st.ring is not None:
                compact_ring_path_(st.ring, self.length, counts, path_slots)
            if self._recurrent:
                self.steps.fast.commit_recurrent(counts, path_slots)  # re-run the accepted path
        else:
            self.model.commit(self.length, counts, path_slots)
        self._tree_pending = False
        if self.steps is not None and self._recurrent and path_slots is None:
            self.steps.fast.commit_recurrent(counts)  # re-run the accepted tokens (fast path)
        before = self._bound
        if isinstance(counts, torch.Tensor) and counts.device.type == "cpu":
            self._bound += int(counts.max()) if counts.numel() else 0
        elif self._pending:
            self._bound += self._pending  # counts <= entries verified
        else:
            self._bound = int(self.length.max()) + int(counts.max())
        self._grew = self._bound - before
        self._pending = 0
        self.length += counts.to(self.device)

    def settle(self, grown: int) -> None:
        """The host learned that the last :meth:`commit` (of device counts) grew no row by more
        than ``grown`` entries: tighten the host bound of the lengths (no synchronization)."""
        if 0 <= grown <= self._grew:
            self._bound -= self._grew - grown
            self._grew = grown

    def rollback(self, length: torch.Tensor) -> None:
        """Set the committed length of every row (int64 [B]); later slots become invisible.

        A row set to 0 is emptied for a new request (its recurrent state zeroed,
        :meth:`TargetState.reset_rows`): how continuous batching refills a freed slot.

        Raises:
            SpecpilotError: a target with recurrent or sliding-window state cannot go below its
                committed length to anything but 0 (only an uncommitted verify can be dropped).
        """
        cfg = self.model.config
        length = length.to(self.device)
        if cfg.is_recurrent or "sliding_attention" in cfg.layer_types:
            if bool(((length != self.length) & (length != 0)).any()):
                raise SpecpilotError("a target with recurrent or sliding-window layers can only roll back an "
                                     "uncommitted verify (or empty a row), not committed tokens")
            emptied = (length == 0) & (self.length != 0)
            if bool(emptied.any()):
                self.model.state.reset_rows(emptied)
        self.model.state.discard()
        self._tree_pending = False
        if self.steps is not None and self._recurrent:
            self.steps.fast.discard()
        self.length.copy_(length)
        self._bound, self._pending = int(length.max()), 0
