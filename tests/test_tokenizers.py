"""Real-format tokenizers: Qwen (ChatML) and Llama 3 layouts built locally, read through
``TextTokenizer`` and compared with what ``transformers.AutoTokenizer`` itself produces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engines.model.text.tokenizer import ChatTemplateError, TextTokenizer
from envs import Task
from envs.tasks import TaskFileError, load_tasks, save_tasks
from rl.rollout.ptx import PtxSample, sample_ids

CORPUS = ["You are a helpful assistant. What is 12 + 30? The answer is 42.", "system user assistant tool hello world"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 12 + 30?"}]


def _bpe(special: list[str], bos: str | None = None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(
        vocab_size=320, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if bos is not None:  # Llama 3 adds BOS in its post-processor: encoding must not add it twice
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def _save(tok: Tokenizer, d: Path, tokenizer_class: str, template: str | None, **special) -> None:
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class=tokenizer_class, added_tokens_decoder={
        str(tok.token_to_id(s)): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                  "normalized": False, "single_word": False}
        for s in tok.get_vocab() if s.startswith("<|")})
    if template:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture
def qwen_dir(tmp_path):
    """Qwen2.5 layout: ChatML template, eos <|im_end|>, pad <|endoftext|>, generation_config adding <|endoftext|>."""
    tok = _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    _save(tok, tmp_path, "Qwen2Tokenizer", CHATML, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "pad_token_id": 0}))
    return tmp_path


@pytest.fixture
def llama_dir(tmp_path):
    """Llama 3.1 layout: BOS from the post-processor, eos <|eot_id|>, no pad token, eos lists in both configs."""
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
               "<|eot_id|>"]
    tok = _bpe(special, bos="<|begin_of_text|>")
    _save(tok, tmp_path, "PreTrainedTokenizerFast", LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 4, 5]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [1, 4, 5], "bos_token_id": 0}))
    return tmp_path


def _transformers_ids(d: Path, messages, **kw) -> list[int]:
    out = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_qwen_layout_ids_and_template_match_transformers(qwen_dir):
    tok = TextTokenizer.load(qwen_dir)
    hf = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    assert type(tok.hf) is type(hf) and type(hf).__name__ == "Qwen2Tokenizer"
    assert tok.eos_ids == [hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")]
    assert tok.pad_id == hf.convert_tokens_to_ids("<|endoftext|>")
    ids = tok.apply_chat_template(MESSAGES)
    assert ids == _transformers_ids(qwen_dir, MESSAGES, add_generation_prompt=True)
    assert hf.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.encode("What is 12 + 30?") == hf.encode("What is 12 + 30?", add_special_tokens=False)


def test_llama3_layout_eos_list_pad_fallback_and_single_bos(llama_dir):
    tok = TextTokenizer.load(llama_dir)
    hf = transformers.AutoTokenizer.from_pretrained(llama_dir)
    eot, end, eom = (hf.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"))
    assert tok.eos_ids == [eot, end, eom]  # the tokenizer's own first, then generation_config's
    assert hf.pad_token_id is None and tok.pad_id == eot  # no pad token: the first EOS stands in
    ids = tok.apply_chat_template(MESSAGES)
    assert ids == _transformers_ids(llama_dir, MESSAGES, add_generation_prompt=True)
    assert ids.count(hf.convert_tokens_to_ids("<|begin_of_text|>")) == 1
    assert tok.decode([*tok.encode("The answer is 42."), eot, end]) == "The answer is 42."


def test_tasks_with_messages_render_through_the_template_and_roundtrip(qwen_dir, tmp_path):
    tok = TextTokenizer.load(qwen_dir)
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"messages": MESSAGES, "answer": "42"}) + "\n"
                    + json.dumps({"prompt": "What is 12 + 30?", "answer": 42}) + "\n")
    chat, plain = load_tasks(path)
    assert chat.prompt == "What is 12 + 30?" and chat.messages == MESSAGES and plain.messages is None
    assert tok.prompt_ids(chat) == _transformers_ids(qwen_dir, MESSAGES, add_generation_prompt=True)
    assert tok.prompt_ids(plain) == tok.encode("What is 12 + 30?")
    as_chat = TextTokenizer.load(qwen_dir, chat_prompts=True)  # model.chat_template: plain prompts as a user turn
    assert as_chat.prompt_ids(plain) == _transformers_ids(qwen_dir, [{"role": "user", "content": "What is 12 + 30?"}],
                                                          add_generation_prompt=True)
    for suffix in (".jsonl", ".parquet"):
        save_tasks([chat, plain], tmp_path / f"again{suffix}")
        assert [t.messages for t in load_tasks(tmp_path / f"again{suffix}")] == [MESSAGES, None]


def test_bad_messages_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user"}], "answer": "1"}) + "\n")
    with pytest.raises(TaskFileError, match=r"bad.jsonl:1: messages\[0\] must be an object"):
        load_tasks(path)
    path.write_text(json.dumps({"answer": "1"}) + "\n")
    with pytest.raises(TaskFileError, match=r"missing field 'prompt' \(or 'messages'\)"):
        load_tasks(path)


def test_messages_without_a_chat_template_is_a_clear_error(tmp_path):
    tok = _bpe(["<|endoftext|>"])
    _save(tok, tmp_path, "PreTrainedTokenizerFast", None, eos_token="<|endoftext|>")
    tok = TextTokenizer.load(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match=f"{tmp_path} has no chat_template"):
        tok.prompt_ids(Task("t", "hi", "", messages=[{"role": "user", "content": "hi"}]))


def test_ptx_conversation_ends_at_the_templates_end_of_turn(qwen_dir):
    tok = TextTokenizer.load(qwen_dir)
    reply = {"role": "assistant", "content": "The answer is 42."}
    prompt, response = sample_ids(PtxSample("", "", (*MESSAGES, reply)), tok)
    assert prompt == tok.apply_chat_template(MESSAGES)
    assert prompt + response == _transformers_ids(qwen_dir, [*MESSAGES, reply])[:len(prompt) + len(response)]
    assert response[-1] == tok.eos_id and tok.decode(response) == "The answer is 42."


def test_no_eos_anywhere_is_refused(tmp_path):
    _save(_bpe(["<|x|>"]), tmp_path, "PreTrainedTokenizerFast", None)
    with pytest.raises(ValueError, match="no EOS token"):
        TextTokenizer.load(tmp_path)


def test_trained_tokenizers_take_a_familys_conventions():
    """warmstart.tokenizer: the special tokens, EOS (the family's end of turn) and chat template of a family, so a
    model built here behaves as that family's do: ChatML's <|im_end|> ends Qwen turns, Llama 3's <|eot_id|>,
    Mistral's </s> (which also pads: the family has no pad token)."""
    from engines.model.text.family_tokens import STYLES
    from engines.model.text.tokenizer import train_tokenizer

    corpus = ["Question: 12 + 30 = 42. Answer: 42"] * 20
    chat = [{"role": "user", "content": "hi"}]
    want = {"chatml": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
            "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "mistral": "<s>[INST] hi [/INST]"}
    for style, text in want.items():
        tok = train_tokenizer(corpus, 300, style)
        assert tok.hf.convert_ids_to_tokens(tok.eos_id) == STYLES[style].eos
        assert tok.hf.convert_ids_to_tokens(tok.pad_id) == (STYLES[style].pad or STYLES[style].eos)
        assert tok.hf.decode(tok.apply_chat_template(chat)) == text
        assert all(len(tok.encode(s)) == 1 for s in STYLES[style].specials)  # each special is one token
    k2 = train_tokenizer(corpus, 300)
    assert (k2.pad_id, k2.eos_id) == (0, 1)  # the embedded model's ids, unchanged
    with pytest.raises(ValueError, match="tokenizer style 'gpt'"):
        train_tokenizer(corpus, 300, "gpt")
