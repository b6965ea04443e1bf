"""Parity with z-lab's reference package ``dflash`` 0.1.0 (``dflash.model`` only; CPU, fp32).

Random tiny drafters (and a tiny Qwen3 target) are saved in the reference's format
(``save_pretrained``); our loaders read the same files and must give the same draft logits
(max |ours - ref| / max |ref| < 1e-4) and the same greedy drafts over several contexts; a
checkpoint we save must load in the reference and give the same logits there. DFlash2's
``base_kernel`` is ``torch.empty`` in the reference: the tests fill it (random, non-identity) so
the convolution path is really exercised, and scale the selector codebooks so the selector walk
differs from the plain argmax.
"""

from __future__ import annotations

import pytest
import torch

ref = pytest.importorskip("dflash.model", reason="the reference package dflash==0.1.0 is a test extra")

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from specpilot.models.loading import load_drafter, load_target, save_drafter  # noqa: E402

V, H, MASK = 96, 64, 95
BLOCK = 6


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random tiny HF Qwen3 target saved in the HF layout, its features over a random sequence."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("target")
    hf.save_pretrained(d)
    ids = torch.randint(0, V - 1, (1, 40))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    return hf, d, ids, hs


def _drafter_config(kind: str, layer_types, **extra):
    dflash = {"block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": [0, 2]}
    if kind == "dflash2":
        dflash.update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5,
                      output_multiplier=0.7, final_logit_softcapping=6.0)
    return Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=80, num_hidden_layers=len(layer_types),
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       num_target_layers=4, layer_types=layer_types, dflash_config=dflash,
                       architectures=["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"], **extra)


def _randomize_(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "base_kernel" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)  # non-identity taps
            elif "codebook" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _ref_draft(model, hf, feats, ids, s):
    """Reference draft logits [1, B-1, V] and greedy drafts [1, B-1] for context length s."""
    block = torch.full((1, BLOCK), MASK)
    block[0, 0] = ids[0, s]
    noise = hf.model.embed_tokens(block)
    h = model(target_hidden=feats[:, :s], noise_embedding=noise, position_ids=torch.arange(s + BLOCK)[None])[:, 1:]
    logits = model.compute_logits(h, hf.lm_head)
    if isinstance(model, ref.DFlash2DraftModel):
        drafts = model.propose(h, block[:, 0], hf.lm_head, 0.0)[0]
    else:
        drafts = logits.argmax(-1)
    return logits, drafts


def _our_draft(net, tgt, feats, ids, s):
    """Our draft logits and drafts for context length s, the context added in two chunks."""
    net.setup_cache(1, 64)
    zero = torch.zeros(1, dtype=torch.long)
    net.add_context(feats[:, : s // 2], zero)
    net.add_context(feats[:, s // 2 : s], zero + s // 2)
    anchor, start = ids[:, s], zero + s
    block = torch.full((1, BLOCK), MASK)
    block[0, 0] = ids[0, s]
    logits = net.logits(net.block_hidden(block, start, tgt.model.embed_tokens)[:, 1:], tgt.lm_head)
    drafts, _ = net.draft(anchor, start, tgt.model.embed_tokens, tgt.lm_head, BLOCK)
    return logits, drafts


CASES = {
    # v1, full attention, non-causal block (the released DFlash drafters)
    "dflash": ("dflash", ["full_attention", "full_attention"], {}),
    # v1 with a sliding layer and is_causal unset: the reference makes that layer causal
    "dflash-sliding": ("dflash", ["sliding_attention", "full_attention"], dict(use_sliding_window=True,
                                                                               sliding_window=7)),
    # DFlash2 as released: all layers sliding, is_causal false (window 7 < context, so it matters)
    "dflash2": ("dflash2", ["sliding_attention", "sliding_attention"], dict(use_sliding_window=True,
                                                                            sliding_window=7, is_causal=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_checkpoint_loads_and_drafts_the_same(case, target, tmp_path):
    kind, layer_types, extra = CASES[case]
    hf, tdir, ids, hs = target
    cls = ref.DFlash2DraftModel if kind == "dflash2" else ref.DFlashDraftModel
    model = _randomize_(cls(_drafter_config(kind, layer_types, **extra)).eval(), 1)
    model.save_pretrained(tmp_path)
    net = load_drafter(tmp_path)
    assert net.kind == kind
    tgt = load_target(tdir)
    feats = ref.extract_context_feature(hs, model.target_layer_ids)
    walk_differs = False
    with torch.no_grad():
        for s in (3, 9, 17, 30):
            rl, rd = _ref_draft(model, hf, feats, ids, s)
            ol, od = _our_draft(net, tgt, feats, ids, s)
            assert _rel(ol, rl) < 1e-4, (case, s)
            assert od.tolist() == rd.tolist(), (case, s)
            walk_differs |= od.tolist() != rl.argmax(-1).tolist()
    if kind == "dflash2":
        assert walk_differs, "the selector walk never left the argmax: the test would not see a selector bug"


def test_our_checkpoint_loads_in_the_reference(target, tmp_path):
    from specpilot.models.dflash2 import DFlash2Drafter
    from specpilot.models.loading import drafter_config

    hf, tdir, ids, hs = target
    kind, layer_types, extra = CASES["dflash2"]
    d = _drafter_config(kind, layer_types, **extra).to_dict()
    net = _randomize_(DFlash2Drafter(drafter_config(d)).eval(), 2)
    save_drafter(net, tmp_path)
    model = ref.DFlash2DraftModel.from_pretrained(tmp_path).eval()
    assert isinstance(model, ref.DFlash2DraftModel)
    tgt = load_target(tdir)
    feats = ref.extract_context_feature(hs, model.target_layer_ids)
    with torch.no_grad():
        for s in (5, 21):
            rl, rd = _ref_draft(model, hf, feats, ids, s)
            ol, od = _our_draft(net, tgt, feats, ids, s)
            assert _rel(ol, rl) < 1e-4 and od.tolist() == rd.tolist()


def test_reference_generate_matches_our_engine(target, tmp_path):
    """``dflash_generate`` (batch 1, greedy) and our engine give the same tokens with the same drafter."""
    from specpilot.engine.proposers import make_proposer
    from specpilot.engine.loop import generate
    from specpilot.engine.runner import TargetRunner

    hf, tdir, ids, hs = target
    kind, layer_types, extra = CASES["dflash2"]
    model = _randomize_(ref.DFlash2DraftModel(_drafter_config(kind, layer_types, **extra)).eval(), 3)
    model.save_pretrained(tmp_path)
    prompt = ids[:, :12]
    out = ref.dflash_generate(model, hf, prompt, 24, None)  # return_stats needs CUDA
    tgt = load_target(tdir)
    prop = make_proposer(load_drafter(tmp_path))
    row = generate(TargetRunner(tgt, 1, 64, prop.capture), prop, [prompt[0].tolist()], 24)[0]
    assert row.output_ids == out[0, 12:].tolist()
