"""The shared model definition equals transformers' Llama and round-trips through HF files."""

import json

import pytest
import torch
import transformers

from engines.model.io.hf_io import ModelDirError, load_pretrained, read_config, save_pretrained
from engines.model.native.attention import padded_causal_mask, positions_from_valid
from engines.model.native.causal_lm import CausalLM
from engines.model.text.tokenizer import TextTokenizer


def test_logits_match_transformers(tiny_model, tokenizer, tmp_path):
    save_pretrained(tiny_model, tokenizer, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = torch.randint(2, tokenizer.vocab_size, (3, 17))
    valid = torch.ones_like(ids, dtype=torch.bool)
    ours = tiny_model(ids, positions_from_valid(valid), padded_causal_mask(valid))
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_left_padding_does_not_change_logits(tiny_model):
    ids = torch.randint(2, 100, (1, 9))
    valid = torch.ones_like(ids, dtype=torch.bool)
    ref = tiny_model(ids, positions_from_valid(valid), padded_causal_mask(valid))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    pvalid = torch.cat([torch.zeros(1, 4, dtype=torch.bool), valid], dim=1)
    out = tiny_model(padded, positions_from_valid(pvalid), padded_causal_mask(pvalid))[:, 4:]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_save_load_roundtrip_is_bitwise(tiny_model, tokenizer, tmp_path):
    save_pretrained(tiny_model, tokenizer, tmp_path)
    loaded = load_pretrained(tmp_path)
    for (n, a), (_, b) in zip(tiny_model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    tok = TextTokenizer.load(tmp_path)
    text = "Question: Mia has 37 apples.\nAnswer: 37+25=62."
    assert tok.encode(text) == tokenizer.encode(text)
    assert tok.decode(tok.encode(text)) == text
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    assert hf_tok.eos_token_id == tokenizer.eos_id


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer.encode("12345")
    assert len(ids) == 5


def test_missing_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(ModelDirError, match="has no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelDirError, match="model_type 'gpt2' is not supported"):
        read_config(tmp_path)


def test_weights_that_do_not_match_config_are_rejected(tiny_model, tmp_path):
    save_pretrained(tiny_model, None, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match="missing tensors"):
        load_pretrained(tmp_path)


def test_tied_embeddings_roundtrip(tokenizer, tmp_path):
    from tests.conftest import tiny_config

    model = CausalLM(tiny_config(tokenizer.vocab_size, tie_word_embeddings=True))
    save_pretrained(model, None, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
