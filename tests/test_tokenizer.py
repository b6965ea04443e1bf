"""The tiny deployment's byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from specpilot.errors import SpecpilotError
from specpilot.tiny.tokenizer import build_tokenizer

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "The answer is 72.\n#### 72",
    "for i in range(10):\n\tprint(i)\n",
] * 50 + [f"number {i} squared is {i * i}" for i in range(300)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(CORPUS, 400, out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir)


def test_special_tokens(tok):
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
    assert (tok.pad_token_id, tok.eos_token_id, tok.mask_token_id) == (0, 2, 3)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok("x<|MASK|><|im_end|>", add_special_tokens=False)["input_ids"][1:] == [3, 2]
    assert len(tok) == 400


@pytest.mark.parametrize("text", [
    "def add(a, b):\n    return a + b\n",
    "  leading spaces, tabs\t\tand\r\nCRLF  ",
    "unseen: héllo wörld ✓ 😀 \\boxed{42} $\\frac{1}{2}$",
    "",
])
def test_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert all(i >= 4 for i in ids)  # plain text never yields special ids


def test_merges_compress_training_text(tok):
    text = "Natalia sold clips to 48 of her friends"
    assert len(tok(text)["input_ids"]) < len(text.encode()) / 2


def test_chat_template_exact(tok):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi\nthere"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs[1:], add_generation_prompt=False, tokenize=False, enable_thinking=False) == (
        "<|im_start|>user\nHi\nthere<|im_end|>\n"
    )


def test_deterministic(tok_dir, tmp_path):
    build_tokenizer(CORPUS, 400, tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("texts,vocab,match", [([], 400, "non-empty"), (["a", 3], 400, "strings"), (["a"], 259, "259")])
def test_bad_input(tmp_path, texts, vocab, match):
    with pytest.raises(SpecpilotError, match=match):
        build_tokenizer(texts, vocab, tmp_path)
