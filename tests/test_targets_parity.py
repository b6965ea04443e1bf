"""Targets built by layer type vs transformers 5.17's own implementations (fp32, CPU, seconds).

Qwen3_5ForCausalLM (Gated DeltaNet + gated partial-RoPE attention) and MuseGlimmerTextModel plus
the softcapped head (sliding-window RoPE + global NoPE layers), on tiny random configs with
initializer_range 0.3 (the default 0.02 hides state bugs): full forward, prefill + decode, prefill
+ k-token verify chunks that cross a 64-token chunk boundary, greedy 64 tokens. Negative
controls: a stale recurrent state and a ring that evicts a live entry must fail the same check.
The vision-language checkpoint layouts (``model.language_model.*``, vision and MTP weights) load.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from specpilot.engine.loop import generate_ar  # noqa: E402
from specpilot.engine.runner import TargetRunner  # noqa: E402
from specpilot.models.layers import chain_ancestors  # noqa: E402
from specpilot.models.loading import load_target  # noqa: E402
from specpilot.models.state import GDNState  # noqa: E402

TOL = 1e-4
INIT = 0.3


def max_rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _randomize_vectors(model, std=INIT):
    """Norm weights, A_log, dt_bias away from their trivial inits, so (1 + w) and decay bugs show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(0.0, std)


def qwen35_hf(seed=0):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            linear_conv_kernel_dim=4, initializer_range=INIT, max_position_embeddings=512,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.25})
    hf = Qwen3_5ForCausalLM(cfg).eval()
    _randomize_vectors(hf)
    return hf


class MuseHF(torch.nn.Module):
    """transformers' MuseGlimmerTextModel + lm_head + the softcap of MuseGlimmerForConditionalGeneration."""

    def __init__(self, text_model, lm_head, cfg):
        super().__init__()
        self.model, self.lm_head, self.cfg = text_model, lm_head, cfg

    def forward(self, ids, past_key_values=None, use_cache=False):
        out = self.model(input_ids=ids, past_key_values=past_key_values, use_cache=use_cache)
        T = self.cfg.final_logit_softcapping
        logits = torch.tanh(self.lm_head(out.last_hidden_state) * self.cfg.output_multiplier / T) * T
        return logits, out.past_key_values


def muse_text_config(**kw):
    from transformers.models.muse_glimmer.configuration_muse_glimmer import MuseGlimmerTextConfig

    d = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, initializer_range=INIT,
             max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             qk_scale_factor=3.87, final_logit_softcapping=20.0, output_multiplier=0.196)
    d.update(kw)
    return MuseGlimmerTextConfig(**d)


def muse_hf_vl(seed=0):
    """A tiny MuseGlimmerForConditionalGeneration (the released checkpoint layout)."""
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, patch_size=4,
                  pos_emb_height=4, pos_emb_width=4, max_position_embeddings=16)
    cfg = MuseGlimmerConfig(text_config=muse_text_config().to_dict(), vision_config=vision, out_hidden_size=32,
                            projector_hidden_size=32)
    hf = MuseGlimmerForConditionalGeneration(cfg).eval()
    _randomize_vectors(hf)
    return hf


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    hf = qwen35_hf()
    d = tmp_path_factory.mktemp("qwen35")
    hf.save_pretrained(d)
    return hf, load_target(d)


@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    vl = muse_hf_vl()
    d = tmp_path_factory.mktemp("muse_vl")
    vl.save_pretrained(d)
    ref = MuseHF(vl.model.language_model, vl.lm_head, vl.config.text_config).eval()
    return ref, load_target(d)


def _ref_logits(ref, ids):
    with torch.no_grad():
        out = ref(ids)
        return out.logits if hasattr(out, "logits") else out[0]


def _models(request, name):
    return request.getfixturevalue(name)


TARGETS = ["qwen35", "muse"]


@pytest.mark.parametrize("name", TARGETS)
def test_full_forward(request, name):
    ref, ours = _models(request, name)
    ids = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))
    want = _ref_logits(ref, ids)
    ours.setup_cache(2, 160)
    with torch.no_grad():
        got, _ = ours(ids, torch.zeros(2, dtype=torch.long), chain_ancestors(2, 100, "cpu"), write=True)
        causal, _ = ours.forward_causal(ids)
    assert max_rel(got, want) < TOL
    assert max_rel(causal, want) < TOL


def _stream_logits(ours, ids, prompt_len, chunks, batch_rows=None):
    """Prefill ``prompt_len`` tokens, then verify chunks of the rest (committing all), collecting logits."""
    B, T = ids.shape
    r = TargetRunner(ours, B, T + 8)
    last, _, _ = r.prefill([row[:prompt_len] for row in ids.tolist()])
    pieces, pos = [], prompt_len
    for c in chunks:
        block = ids[:, pos:pos + c]
        logits, _ = r.verify(block)
        r.commit(torch.full((B,), c, dtype=torch.long))
        pieces.append(logits)
        pos += c
    return torch.cat(pieces, 1), r


@pytest.mark.parametrize("name", TARGETS)
def test_prefill_then_decode(request, name):
    ref, ours = _models(request, name)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(2))
    want = _ref_logits(ref, ids)
    r = TargetRunner(ours, 1, 96)
    r.prefill([ids[0, :60].tolist()])
    got = torch.stack([r.decode(ids[:, t]) for t in range(60, 90)], 1)
    assert max_rel(got, want[:, 60:90]) < TOL


@pytest.mark.parametrize("name", TARGETS)
@pytest.mark.parametrize("k", [5, 16])
def test_prefill_then_verify_chunks_cross_chunk_boundary(request, name, k):
    ref, ours = _models(request, name)
    ids = torch.randint(0, 256, (2, 140), generator=torch.Generator().manual_seed(3 + k))
    want = _ref_logits(ref, ids)
    n = (140 - 50) // k
    got, _ = _stream_logits(ours, ids, 50, [k] * n)  # 50 -> 50 + n k: crosses 64 and 128
    assert max_rel(got, want[:, 50:50 + n * k]) < TOL


@pytest.mark.parametrize("name", TARGETS)
def test_greedy_64_identical(request, name):
    ref, ours = _models(request, name)
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    ids = prompt
    with torch.no_grad():  # reference greedy by full re-forward (no cache: nothing to trust)
        for _ in range(64):
            ids = torch.cat([ids, _ref_logits(ref, ids)[:, -1:].argmax(-1)], 1)
    rows = generate_ar(TargetRunner(ours, 1, 90), [prompt[0].tolist()], 64)
    assert rows[0].output_ids == ids[0, 20:].tolist()


def _verify_reject_check(ours, ref, ids, prompt_len, k, accept):
    """Prefill, then repeatedly verify k junk-suffixed blocks and commit ``accept`` true tokens;
    return max rel error of the committed logits against the reference."""
    want = _ref_logits(ref, ids)
    r = TargetRunner(ours, 1, ids.shape[1] + k + 2)
    r.prefill([ids[0, :prompt_len].tolist()])
    pos, errs = prompt_len, []
    g = torch.Generator().manual_seed(9)
    while pos + k <= ids.shape[1]:
        block = torch.cat([ids[:, pos:pos + accept], torch.randint(0, 256, (1, k - accept), generator=g)], 1)
        logits, _ = r.verify(block)
        r.commit(torch.tensor([accept]))
        errs.append(max_rel(logits[:, :accept], want[:, pos:pos + accept]))
        pos += accept
    return max(errs)


def test_rejected_drafts_leave_no_trace_qwen35(qwen35):
    ref, ours = qwen35
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(5))
    assert _verify_reject_check(ours, ref, ids, 30, 6, 2) < TOL


def test_negative_control_stale_recurrent_state(qwen35, monkeypatch):
    """A commit that keeps the state after the whole block (rejected drafts baked in, like
    transformers' crop()) must fail the same check."""
    ref, ours = qwen35

    def stale_commit(self, counts, path):
        for slot, (pre, k, v, g, beta) in self.tape.items():
            from specpilot.models.gdn import step

            kk = k.repeat_interleave(self.hv // self.h, dim=2)
            S = self.rec[:, slot]
            for t in range(k.shape[1]):
                S = step(S, kk[:, t], v[:, t], g[:, t], beta[:, t])
            self.rec[:, slot] = S
        self.tape.clear()

    monkeypatch.setattr(GDNState, "commit", stale_commit)
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(5))
    assert _verify_reject_check(ours, ref, ids, 30, 6, 2) > 100 * TOL


def test_rejected_drafts_leave_no_trace_muse(muse):
    ref, ours = muse
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(6))
    assert _verify_reject_check(ours, ref, ids, 30, 6, 2) < TOL


def test_negative_control_ring_evicts_live_entry(muse):
    """A ring reserving no room for the verify block (R = W) lets rejected drafts overwrite live
    window entries: the same check must fail."""
    ref, ours = muse
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(6))
    try:
        ours.setup_cache(1, ids.shape[1] + 8, verify_width=0)
        r = ours.state.ring
        assert r.R == ours.config.sliding_window
        want = _ref_logits(ref, ids)
        start = torch.zeros(1, dtype=torch.long)
        with torch.no_grad():
            ours(ids[:, :30], start, chain_ancestors(1, 30, "cpu"), write=True)
            pos, errs = 30, []
            g = torch.Generator().manual_seed(9)
            while pos + 6 <= 100:
                block = torch.cat([ids[:, pos:pos + 2], torch.randint(0, 256, (1, 4), generator=g)], 1)
                logits, _ = ours(block, torch.tensor([pos]), chain_ancestors(1, 6, "cpu"))
                errs.append(max_rel(logits[:, :2], want[:, pos:pos + 2]))
                pos += 2
        assert max(errs) > 100 * TOL
    finally:
        ours.setup_cache(1, 8)  # back to a sane ring for other tests


def test_qwen35_vl_layout_loads(tmp_path):
    """Qwen3_5ForConditionalGeneration layout: text weights under model.language_model, vision and
    MTP weights dropped; logits equal the text model's."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    text = qwen35_hf().config.to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    vl = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    _randomize_vectors(vl)
    vl.save_pretrained(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    state = load_file(str(f))
    assert any(k.startswith("model.language_model.") for k in state) and any("visual" in k for k in state)
    state["mtp.fc.weight"] = torch.zeros(4, 4)  # a released checkpoint's MTP head
    save_file(state, str(f), metadata={"format": "pt"})
    ours = load_target(tmp_path)
    assert ours.config.family == "qwen3_5" and ours.config.layer_types.count("linear_attention") == 3
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        want = vl(input_ids=ids).logits
        got, _ = ours.forward_causal(ids)
    assert max_rel(got, want) < TOL


def test_unsupported_layer_type_is_one_clear_error(tmp_path):
    import json

    from specpilot.errors import SpecpilotError
    from specpilot.models.config import TargetConfig

    cfg = TargetConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4).to_hf_dict()
    cfg["layer_types"] = ["full_attention", "chunked_attention"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecpilotError, match="unsupported layer type 'chunked_attention'"):
        load_target(tmp_path)


@pytest.mark.parametrize("shape", ["tiny-hybrid", "tiny-muse"])
def test_random_checkpoint_of_new_shapes_round_trips(tmp_path, shape):
    """``specpilot random-checkpoint`` writes the family's text layout; our loader reads back the
    same tensors; the hybrid one also loads in transformers' Qwen3_5ForCausalLM with equal logits."""
    from specpilot.cli import main
    from specpilot.models.random_checkpoint import build_target, target_config

    out = tmp_path / "t"
    assert main(["random-checkpoint", "--shape", shape, "--out", str(out), "--dtype", "fp32"]) == 0
    ours = load_target(out)
    ref = build_target(shape, dtype=torch.float32)
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    assert ours.config.layer_types == target_config(shape).layer_types
    ids = torch.randint(0, 1024, (1, 40))
    with torch.no_grad():
        got, _ = ours.forward_causal(ids)
    assert torch.isfinite(got).all() and got.std() > 0
    if shape == "tiny-hybrid":
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(hf).__name__ == "Qwen3_5ForCausalLM"
        with torch.no_grad():
            assert max_rel(got, hf(ids).logits) < TOL
    else:
        assert ours.config.final_logit_softcapping == 20.0 and got.abs().max() <= 20.0


def test_study_shapes_have_the_published_structure():
    from specpilot.models.random_checkpoint import target_config
    from specpilot.models.target import Transformer

    q = target_config("qwen3.8-27b")
    assert q.layer_types.count("linear_attention") == 48 and q.layer_types.count("full_attention") == 16
    m = target_config("muse-glimmer-30b")
    assert m.layer_types.count("sliding_attention") == 39 and sum(not r for r in m.layer_rope) == 13
    with torch.device("meta"):
        nq = sum(p.numel() for p in Transformer(q).parameters())
        nm = sum(p.numel() for p in Transformer(m).parameters())
    assert 26e9 < nq < 28e9, nq  # Qwen3.8-27B class
    assert 27e9 < nm < 28.5e9, nm  # Muse-Glimmer-30B text model: 27.8 B (+ the 1.8 B vision encoder = 29.6 B)


@pytest.mark.parametrize("shape", ["tiny-hybrid", "tiny-muse"])
def test_lazy_random_checkpoint_draws_the_same_tensors_on_load(tmp_path, shape):
    """``random-checkpoint --lazy`` writes config.json only (no weights on disk); loading it draws
    the shape's seeded tensors on the load device: the same as a built target of that seed, the
    same in every process, and another seed gives others."""
    from specpilot.cli import main
    from specpilot.models.loading import load_drafter
    from specpilot.models.random_checkpoint import build_drafter, build_target

    out = tmp_path / "t"
    assert main(["random-checkpoint", "--shape", shape, "--out", str(out), "--dtype", "fp32", "--lazy", "--seed", "3"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    ours, ref = load_target(out), build_target(shape, dtype=torch.float32, seed=3)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in ref.state_dict().items())
    other = build_target(shape, dtype=torch.float32, seed=4)
    assert not torch.equal(other.lm_head.weight, ours.lm_head.weight)
    d, dref = load_drafter(tmp_path / "t-drafter"), build_drafter(shape, dtype=torch.float32, seed=3)
    assert all(torch.equal(d.state_dict()[k], v) for k, v in dref.state_dict().items())
