"""Verification: one module for what a verify step decides, chain or tree.

A verify step runs every candidate of a :class:`~specpilot.drafters.proposal.Proposal` (the verify
input: tokens [B, N], parents [B, N] or None for a chain, valid nodes per row) through the target in
one forward at the rows' committed lengths (node i at position length + depth(i), attending to the
prefix and its ancestors), then decides acceptance at temperature 0: the accepted path is the
longest root path whose every token equals the target's argmax at its parent, and the bonus token
is the target's argmax after it (:class:`VerifyOutput`). A chain is the tree special case
``parents = [-1, 0, 1, ...]``: :func:`accept_greedy` decides it on the device in one comparison,
:func:`accept_tree` walks any tree on the host (:func:`accept_tree_device`, what the engine runs, decides
the same on the device with one host read). So each step commits accepted + 1 tokens, every one
the target's own choice: outputs equal greedy AR decoding token for token (token forcing checks it).

Also here: :class:`Step` / :func:`step` / :func:`advance` (propose, verify, decide; then commit and
tell the proposer), the tree encodings the Triton step reads (:func:`tree_bits`,
:func:`tree_paths`, :func:`tree_inputs`) and the on-device compaction of an accepted tree path
(:func:`compact_path_`, :func:`compact_ring_path_`). Sources: SGLang ``speculative/eagle_utils.py`` (verify_tree_greedy) and
DFlash ``dflash_generate`` (linear verification); DDTree / JetSpec for the ancestor-masked tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..drafters.proposal import Proposal
from ..errors import SpecpilotError
from ..fastpath.tables import TREE_BIT_NODES, TREE_FAST_NODES
from ..models.layers import tree_ancestors
from ..tuning.timing import PhaseTimer


def accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear verification at temperature 0 (DFlash ``dflash_generate``; SGLang "linear block").

    Draft i is accepted while it equals the target's argmax at block slot i - 1 (slot 0 is the
    anchor). Args: drafts int64 [B, k]; logits [B, k + 1, vocab] of the verified block.
    Returns: accepted count int64 [B] in 0..k and the bonus token int64 [B] (target argmax after
    the accepted prefix).
    """
    posterior = logits.argmax(-1)
    acc = (drafts == posterior[:, :-1]).long().cumprod(1).sum(1)
    bonus = posterior.gather(1, acc[:, None])[:, 0]
    return acc, bonus


# Verification rules by name (engine config key ``accept``). Only lossless rules belong here; tests
# register deliberately broken ones to prove the token-forcing gate rejects them.
ACCEPT_RULES: dict[str, Callable] = {"greedy": accept_greedy}


def accept_tree(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
                lengths: torch.Tensor | None = None) -> tuple[list[list[int]], list[int]]:
    """Greedy tree verification (SGLang ``verify_tree_greedy``; DDTree/JetSpec at temperature 0).

    From the root (block index 0, the anchor), repeatedly step to the child whose token equals
    the target's argmax at the current node; stop when no child matches. The bonus token is the
    target's argmax at the last node, so every committed token is the target's own choice.

    Args:
        tokens int64 [B, N], parents int64 [B, N] (-1 for the root), logits [B, N, vocab];
        lengths int64 [B] valid nodes per row (None = all): padding nodes are never accepted.
    Returns:
        per row the accepted path of block indices (root first) and the bonus token.
    """
    post = logits.argmax(-1).tolist()
    toks, pars = tokens.tolist(), parents.tolist()
    lens = lengths.tolist() if lengths is not None else [tokens.shape[1]] * len(toks)
    paths, bonus = [], []
    for b in range(len(toks)):
        children: dict[int, list[int]] = {}
        for i, p in enumerate(pars[b][: lens[b]]):
            if p >= 0:
                children.setdefault(p, []).append(i)
        node, path = 0, [0]
        while True:
            nxt = next((c for c in children.get(node, []) if toks[b][c] == post[b][node]), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        paths.append(path)
        bonus.append(post[b][node])
    return paths, bonus


_TREE_CACHE: list = [None, None]  # [the parents tensor of a static tree, its (ancestors, depth)]


def _ancestors(parents: torch.Tensor, max_depth: int | None):
    """(ancestors bool [B, N, N], depth int64 [B, N]) of a tree, once per parents tensor (keyed by
    the tensor itself, as the runner keys its tree inputs): a static tree reuses its tensor every
    step; a tree that changes every step (``max_depth`` given: no host read) gets a new one, whose
    ancestors :func:`tree_inputs` builds for the verify and the acceptance reads here again
    (issue 54: built once per step, not twice). Not to be modified."""
    if _TREE_CACHE[0] is not parents:
        _TREE_CACHE[0], _TREE_CACHE[1] = parents, tree_ancestors(parents, max_depth)
    return _TREE_CACHE[1]


def accept_tree_device(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
                       lengths: torch.Tensor | None = None, max_depth: int | None = None
                       ) -> tuple[list[list[int]], list[int], list[list[int]], torch.Tensor]:
    """Greedy tree verification computed on the device, one host read: the same decision as
    :func:`accept_tree` without its walk over host lists.

    A node is accepted when it and every ancestor carry the target's argmax at their parent (the
    root always); the accepted path ends at the deepest accepted node (the lowest index among equally
    deep ones: only siblings with equal tokens tie, and their paths carry the same tokens), the
    bonus is the target's argmax there. Args as :func:`accept_tree`; ``max_depth``: a bound of the
    tree's depth (:attr:`~specpilot.drafters.proposal.Proposal.max_depth`).
    Returns:
        per row the accepted path of block indices (root first), the bonus token, the tokens the
        step would commit (accepted drafts + bonus), and the paths as block indices int64
        [B, longest path] on the device (shorter rows padded with 0), what the runner's commit compacts.
    """
    B, N = tokens.shape
    dev = tokens.device
    post = logits.argmax(-1)
    anc, depth = _ancestors(parents, max_depth)
    idx = torch.arange(N, device=dev)
    ok = tokens == post.gather(1, parents.clamp(min=0))
    ok[:, 0] = True
    if lengths is not None:
        ok &= idx[None, :] < lengths[:, None]
    accepted = ~(anc & ~ok[:, None, :]).any(-1)
    best = torch.where(accepted, depth * N + (N - 1 - idx), -1).argmax(1)
    row = anc[torch.arange(B, device=dev), best]  # the path: best and its ancestors
    slots = torch.zeros(B, N + 1, dtype=torch.long, device=dev)
    slots.scatter_(1, torch.where(row, depth, N), idx.expand(B, N))
    slots = slots[:, :N]
    host = torch.cat([depth.gather(1, best[:, None]), post.gather(1, best[:, None]), slots,
                      tokens.gather(1, slots)], 1).tolist()  # the one host read
    paths = [h[2:3 + h[0]] for h in host]
    proposed = [h[N + 3:N + 3 + h[0]] + [h[1]] for h in host]  # accepted drafts + bonus
    return paths, [h[1] for h in host], proposed, slots[:, :max(len(p) for p in paths)]


def chain_drafts(prop: Proposal) -> torch.Tensor:
    """The drafts int64 [B, k] of a chain proposal as the acceptance rule sees them: padding
    nodes (index >= ``lengths[b]``) set to -1, which never matches an argmax (token ids are >= 0)."""
    drafts = prop.tokens[:, 1:]
    if prop.lengths is not None:
        pad = torch.arange(drafts.shape[1], device=drafts.device)[None, :] >= (prop.lengths[:, None] - 1)
        drafts = drafts.masked_fill(pad, -1)
    return drafts


@dataclass
class VerifyOutput:
    """The acceptance decision of one verify step.

    Attributes:
        paths: per row the accepted block indices (root first; the root is the anchor).
        bonus: per row the target's argmax after the accepted path.
        proposed: per row the tokens the step would commit (accepted drafts + bonus).
        slots: the paths already on the device (int64 [B, longest path], a tree decided there), or None.
    """

    paths: list[list[int]]
    bonus: list[int]
    proposed: list[list[int]]
    slots: torch.Tensor | None = None

    @property
    def accepted(self) -> list[int]:
        """Accepted drafts per row (the bonus not counted)."""
        return [len(p) - 1 for p in self.paths]

    def path_slots(self, device) -> torch.Tensor:
        """The accepted paths as block indices int64 [B, longest path] (shorter rows padded with 0):
        what the runner's commit compacts for a tree."""
        if self.slots is not None and self.slots.device.type == torch.device(device).type:
            return self.slots
        width = max(len(p) for p in self.paths)
        return torch.tensor([p + [0] * (width - len(p)) for p in self.paths], dtype=torch.long, device=device)


HOST_TREE_NODES = 256  # a tree that changes every step is decided on the host up to this many nodes (batch x width)
_CHILDREN: list = [None, None]  # [the parents tensor of a static tree, its children per row and node]


def _children(parents: torch.Tensor) -> list[list[list[int]]]:
    """Per row and node the children's block indices (ascending) of a static tree, once per
    parents tensor (keyed by the tensor itself, as the runner keys its tree inputs)."""
    if _CHILDREN[0] is not parents:
        kids = []
        for row in parents.tolist():
            k: list[list[int]] = [[] for _ in row]
            for i, p in enumerate(row):
                if p >= 0:
                    k[p].append(i)
            kids.append(k)
        _CHILDREN[0], _CHILDREN[1] = parents, kids
    return _CHILDREN[1]


def accept_tree_host(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
                       lengths: torch.Tensor | None = None) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """:func:`accept_tree_device`'s decision on the host from the argmax and the tokens (two small
    reads) and the tree's children lists (built once per parents tensor: once for a static tree,
    every step for one that changes): a search through the accepted nodes only (a node is accepted when its parent is and its
    token is the target's argmax at the parent), ending at the deepest, the lowest index among
    equally deep ones, as the device version does. Returns (paths, bonus, proposed)."""
    post, toks = logits.argmax(-1).tolist(), tokens.tolist()
    kids = _children(parents)
    N = tokens.shape[1]
    lens = lengths.tolist() if lengths is not None else [N] * len(toks)
    paths, bonus, proposed = [], [], []
    for b, (pb, tb, kb) in enumerate(zip(post, toks, kids)):
        best, stack = (0, 0, [0]), [(0, [0])]
        while stack:
            node, path = stack.pop()
            for c in kb[node]:
                if c < lens[b] and tb[c] == pb[node]:
                    cp = path + [c]
                    if len(cp) - 1 > best[0] or (len(cp) - 1 == best[0] and c < best[1]):
                        best = (len(cp) - 1, c, cp)
                    stack.append((c, cp))
        path = best[2]
        paths.append(path)
        bonus.append(pb[path[-1]])
        proposed.append([tb[i] for i in path[1:]] + [bonus[-1]])
    return paths, bonus, proposed


def _accept_chain_host(prop: Proposal, logits: torch.Tensor) -> VerifyOutput:
    """:func:`accept_greedy`'s decision on the host from the argmax and the tokens (two small reads,
    no device work beyond the argmax): draft i is accepted while every draft up to it equals the
    argmax at its slot - 1 and lies inside the row's valid nodes."""
    post, toks = logits.argmax(-1).tolist(), prop.tokens.tolist()
    N = len(toks[0])
    lens = prop.lengths.tolist() if prop.lengths is not None else [N] * len(toks)
    paths, bonus, proposed = [], [], []
    for pb, tb, n in zip(post, toks, lens):
        a = 0
        while a + 1 < n and tb[a + 1] == pb[a]:
            a += 1
        paths.append(list(range(a + 1)))
        bonus.append(pb[a])
        proposed.append(tb[1:a + 1] + [pb[a]])
    return VerifyOutput(paths, bonus, proposed)


def decide(prop: Proposal, logits: torch.Tensor, accept: Callable = accept_greedy) -> VerifyOutput:
    """The acceptance of ``prop`` given the verified block's logits [B, N, vocab]: a chain under the
    rule ``accept`` (drafts [B, k], logits [B, k+1, V]) -> (accepted [B], bonus [B]), one host
    synchronization (the greedy rule on the host from the argmax: the same decision with fewer
    launches); a static tree, or one that changes every step of at most :data:`HOST_TREE_NODES`
    nodes over the batch, by :func:`accept_tree_host`, a larger changing tree by
    :func:`accept_tree_device` (one host read too; its children lists would cost more host time
    than its launches)."""
    if not prop.is_chain:
        if prop.max_depth is None or prop.tokens.numel() <= HOST_TREE_NODES:
            return VerifyOutput(*accept_tree_host(prop.tokens, prop.parents, logits, prop.lengths))
        return VerifyOutput(*accept_tree_device(prop.tokens, prop.parents, logits, prop.lengths, prop.max_depth))
    if accept is accept_greedy:
        return _accept_chain_host(prop, logits)
    acc, bonus = accept(chain_drafts(prop), logits)
    host = torch.cat([acc[:, None], bonus[:, None]], 1).tolist()  # the one host synchronization of a step
    paths, bonus_l = [list(range(a + 1)) for a, _ in host], [b for _, b in host]
    toks = prop.tokens.tolist()
    proposed = [[toks[b][i] for i in paths[b][1:]] + [bonus_l[b]] for b in range(len(paths))]
    return VerifyOutput(paths, bonus_l, proposed)


@dataclass
class Step:
    """One draft + verify step before commit (see :func:`step`).

    Attributes:
        proposal: what the drafter proposed (the verify input); output: the acceptance decision
        (:class:`VerifyOutput`); feats: captured target features [B, N, F] of the verified block
        (or None); t_draft, t_verify, t_end: clock readings [s] at the draft start, verify start
        and after the acceptance decision (the first two are 0.0 without ``profile``).
    """

    proposal: Proposal
    output: "VerifyOutput"
    feats: torch.Tensor | None
    t_draft: float
    t_verify: float
    t_end: float

    @property
    def paths(self) -> list[list[int]]:
        """Per row the accepted block indices, root first."""
        return self.output.paths

    @property
    def bonus(self) -> list[int]:
        """Per row the target's token after the accepted path."""
        return self.output.bonus

    @property
    def proposed(self) -> list[list[int]]:
        """Per row the tokens the step would commit (accepted drafts + bonus), before budgets/EOS."""
        return self.output.proposed


def step(runner, drafter, last: torch.Tensor, accept: Callable = accept_greedy, profile: bool = True) -> Step:
    """Propose after ``last`` int64 [B], verify every row's candidates in one target forward and
    decide acceptance; nothing is committed yet (call :func:`advance`).

    Shared by :func:`specpilot.engine.loop.generate` (static batches) and :mod:`specpilot.engine.scheduler`
    (continuous batching). Raises SpecpilotError when the drafter proposes the wrong row count.
    """
    B = runner.batch
    timer = PhaseTimer(runner.device, profile)  # no host synchronization between draft and verify
    timer.mark()
    prop = drafter.propose(last, runner.length)
    if prop.tokens.shape[0] != B:
        raise SpecpilotError(f"drafter proposed {prop.tokens.shape[0]} rows for a batch of {B}")
    timer.mark()
    logits, feats = runner.verify(prop.tokens, prop.parents, prop.max_depth)
    out = decide(prop, logits, accept)
    ta, tb, tc = timer.finish()
    return Step(prop, out, feats, ta, tb, tc)


def advance(runner, drafter, st: Step, counts: list[int], committed: list[list[int]]) -> torch.Tensor:
    """Commit ``counts[b]`` entries of row b's accepted path (0 = row does not advance) and tell
    the drafter; tree paths are compacted in the cache. Returns the next anchors int64 [B]
    (the bonus tokens; a row that did not advance gets its bonus too, which its owner ignores)."""
    dev, B, out = runner.device, len(counts), st.output
    flat = counts + out.bonus
    W = 0
    if not st.proposal.is_chain and out.slots is None:  # a tree decided on the host: its paths in the same copy
        W = max(len(p) for p in out.paths)
        flat += [i for p in out.paths for i in p + [0] * (W - len(p))]
    both = torch.tensor(flat, dtype=torch.long, device=dev)  # one copy to the device
    counts_t = both[:B]
    feats = st.feats
    path_slots = path_feats = None
    if not st.proposal.is_chain:
        path_slots = both[2 * B:].view(B, W) if W else out.path_slots(dev)
        if feats is not None:
            path_feats = feats.gather(1, path_slots[:, :, None].expand(-1, -1, feats.shape[-1]))
    else:
        path_feats = feats
    drafter.observe(path_feats, runner.length, counts_t, committed)
    runner.commit(counts_t, path_slots=path_slots)
    return both[B:2 * B]


PATH_DEPTH = 64  # ancestors per node the path table holds: trees at most this deep


def tree_paths(ancestors: torch.Tensor) -> torch.Tensor:
    """Per node its ancestors in the order of depth: int32 [B, T, 64] whose entry [b, t, d] is the
    block index of t's ancestor at depth d (d < depth of t; 0 past it), from an ancestor mask
    bool [B, T, T] (t itself included; parents before children, so an ancestor's index grows with
    its depth). Any number of nodes; a node deeper than :data:`PATH_DEPTH` keeps only its first
    64 ancestors (no host read here: callers bound the depth, a block's drafts)."""
    B, T, _ = ancestors.shape
    eye = torch.eye(T, dtype=torch.bool, device=ancestors.device)
    anc = ancestors.bool() & ~eye
    rank = torch.where(anc, (anc.long().cumsum(-1) - 1).clamp(max=PATH_DEPTH), PATH_DEPTH)
    out = torch.zeros(B, T, 65, dtype=torch.int64, device=ancestors.device)
    idx = torch.arange(T, device=ancestors.device).expand(B, T, T)
    out.scatter_(2, rank, idx)
    return out[..., :64].to(torch.int32).contiguous()


def tree_bits(ancestors: torch.Tensor) -> torch.Tensor:
    """Pack an ancestor mask bool [B, T, T] (T <= 64) into int64 [B, T]: bit j of row t set when
    block node j is t or an ancestor of t (the tree form of :func:`attention`). Raises ValueError
    for T > 64."""
    B, T, _ = ancestors.shape
    if T > 64:
        raise ValueError(f"tree blocks of at most 64 nodes fit the ancestor bit mask, got {T}")
    w = torch.ones(T, dtype=torch.int64, device=ancestors.device) << torch.arange(T, device=ancestors.device)
    if T == 64:
        w[63] = -(1 << 63)  # the sign bit
    return (ancestors.to(torch.int64) * w).sum(-1)


def tree_inputs(parents: torch.Tensor, max_depth: int | None = None, paths: bool = False) -> tuple[torch.Tensor, ...]:
    """(ancestor bits int64 [B, T], depth int32 [B, T], ancestors by depth int32 [B, T, 64]) of a
    token tree for the Triton steps (:meth:`~specpilot.fastpath.dense.FastTarget.forward`,
    :meth:`~specpilot.fastpath.family.FastFamilyTarget.forward`; the attention reads each node's
    ancestors in the order of their positions: :func:`tree_paths`). A tree of at most 64 nodes
    whose nodes have their ancestors at the slots of their depths (chains, spine + side-leaf
    trees) gets the first two only unless ``paths`` (the family step reads every tree by its
    paths): its ancestor bits sum the keys in the decode's tiles already, at the chain verify's
    cost (one program per row tile, not per node).

    ``parents`` int64 [B, T]: block index of each node's parent (< its own index), -1 for the root
    (:func:`specpilot.models.layers.tree_ancestors`). ``max_depth``: a bound of the depth (a tree
    that changes every step, e.g. a lattice tree): built with no host synchronization, always in
    the path form. In the path form the bits are not built (a zero placeholder: the path form
    never reads them). On CUDA such a tree's inputs come from one Triton launch
    (:func:`specpilot.kernels.tree.tree_walk`), not ~25 eager ones.

    Raises:
        SpecpilotError: T > :data:`~specpilot.fastpath.tables.TREE_FAST_NODES`, or a tree deeper
            than the path table (:data:`PATH_DEPTH` levels below the root: the engine's
            tree_depth / block_size). The engine stops there: a tree never falls back to the
            eager forward, whose arithmetic differs from the step's.
    """
    T = parents.shape[1]
    if T > TREE_FAST_NODES:
        raise SpecpilotError(f"a token tree of {T} nodes: the Triton step verifies trees of at most "
                             f"{TREE_FAST_NODES} nodes (engine config tree_nodes / tree_lattice / tree_branch)")
    if max_depth is not None and max_depth > PATH_DEPTH:
        raise SpecpilotError(f"a token tree of depth up to {max_depth}: the Triton step verifies trees of at most "
                             f"{PATH_DEPTH} levels below the root (engine config block_size)")
    if max_depth is not None and parents.is_cuda:
        from ..kernels.tree import tree_walk  # Triton: only where the Triton step runs

        # one launch instead of ~25 (issue 63; the same values: tests/test_tree_attention_split.py,
        # under the interpreter, where the torch build below is faster); the acceptance reads the
        # same ancestors (_ancestors)
        anc, depth64, depth, paths_t = tree_walk(parents, max_depth)
        _TREE_CACHE[0], _TREE_CACHE[1] = parents, (anc, depth64)
        return torch.zeros(parents.shape, dtype=torch.int64, device=parents.device), depth, paths_t
    anc, depth = _ancestors(parents, max_depth)
    if T > PATH_DEPTH and max_depth is None and int(depth.max()) > PATH_DEPTH:
        raise SpecpilotError(f"a token tree of depth {int(depth.max())}: the Triton step verifies trees of at most "
                             f"{PATH_DEPTH} levels below the root (engine config tree_depth / block_size)")
    depth = depth.to(torch.int32).contiguous()
    paths_t = tree_paths(anc)
    if paths or T > TREE_BIT_NODES or max_depth is not None:  # the path form reads no bits: a placeholder
        return torch.zeros(parents.shape, dtype=torch.int64, device=parents.device), depth, paths_t
    bits = tree_bits(anc)
    # a tree whose every node has its ancestor of depth d at block slot d (a chain, the spine +
    # side-leaf trees) sums its keys in the decode's tiles already: the ancestor bits serve it
    on_slots = torch.arange(64, device=parents.device, dtype=torch.int32)[None, None, :] < depth[..., None]
    if bool((paths_t == torch.arange(64, device=parents.device, dtype=torch.int32)).logical_or(~on_slots).all()):
        return bits, depth
    return bits, depth, paths_t


@torch.no_grad()
def compact_path_(cache, length: torch.Tensor, counts: torch.Tensor, path_slots: torch.Tensor) -> None:
    """Move each row's accepted tree path to contiguous slots, on the device (no host sync).

    Row b keeps ``counts[b]`` nodes; node ``path_slots[b, j]`` (block index, increasing along the
    path) moves from slot ``length[b] + path_slots[b, j]`` to ``length[b] + j`` in every layer's
    K and V of ``cache`` (a :class:`~specpilot.models.qwen3.KVCache`). Entries j >= counts[b] are
    left as they are. Same result as the eager path's host-side ``cache.move`` compaction; gathers all
    sources before writing, so overlapping moves are safe. Graph-capturable (fixed shapes).
    """
    B, P = path_slots.shape
    dev = cache.k.device
    j = torch.arange(P, device=dev)[None, :]
    base = length.to(dev)[:, None]
    # rows past counts copy their own slot onto itself
    src = base + torch.where(j < counts.to(dev)[:, None], path_slots.to(dev), j)
    dst = base + j
    Bc, L, H, _, D = cache.k.shape  # (B, L, H, S, D): one gather and one scatter along S per buffer
    shape = (Bc, L, H, P, D)
    si, di = (x[:, None, None, :, None].expand(shape) for x in (src, dst))
    for buf in (cache.k, cache.v):
        buf.scatter_(3, di, buf.gather(3, si))


@torch.no_grad()
def compact_ring_path_(ring, length: torch.Tensor, counts: torch.Tensor, path_slots: torch.Tensor) -> None:
    """:func:`compact_path_` for a sliding-window ring (:class:`~specpilot.models.state.RingKV`):
    position p sits in slot p mod R, so node ``path_slots[b, j]`` moves from slot
    ``(length[b] + path_slots[b, j]) mod R`` to ``(length[b] + j) mod R``. On the device, no host
    sync; gathers all sources before writing."""
    B, P = path_slots.shape
    dev = ring.k.device
    j = torch.arange(P, device=dev)[None, :]
    base = length.to(dev)[:, None]
    dst = (base + j) % ring.R
    src = torch.where(j < counts.to(dev)[:, None], (base + path_slots.to(dev)) % ring.R, dst)
    rows = torch.arange(B, device=dev)[:, None].expand(B, P)
    for buf in (ring.k, ring.v):  # (B, L, H, R + 1, D)
        vals = buf[rows, :, :, src]
        buf[rows, :, :, dst] = vals


