"""The transfer suite (benchmarks.transfer) in its reduced form: two (model, task) pairs of other families than the
embedded model's, each with its family's tokenizer conventions, run with the schema's defaults for a few
iterations. What the full suite measures at scale, here in small: the defaults do not collapse a model they were
not tuned on (held-out accuracy does not fall, no rollback was needed). The pair of a family the native code lacks
(``gemma3-arith``: transformers backend, vLLM rollouts) is checked here in its warm start only: a vLLM start-up
alone costs more than this file may add."""

from __future__ import annotations

import pytest

from benchmarks.transfer import PAIRS, pair_config
from engines.model.io.hf_io import read_config
from engines.model.text.family_tokens import STYLES
from engines.model.text.tokenizer import TextTokenizer
from rl.config import parse_config
from rl.loop.controller import train
from rl.rollout.data import task_maker
from rl.setup.warmstart import prepare_model

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1}


def _reduced(name: str) -> dict:
    raw = pair_config(name, 3, [])
    raw.pop("extra")
    arch = {**raw["warmstart"]["architecture"], **SMALL}
    if PAIRS[name]["family"] == "mixtral":
        arch["intermediate_size"] = 64
    raw["warmstart"].update(steps=60, num_examples=2000, batch_size=32, vocab_size=400, architecture=arch)
    raw["env"].update(num_train=500, num_eval=40)
    raw["run"].update(eval_every=3, save_every=3, eval_samples=0)
    # a smaller batch than the defaults' 64 x 8 (the budget), everything else as the schema has it
    raw["rollout"] = {"prompts_per_iteration": 8, "samples_per_prompt": 8, "max_batch": 64}
    raw["checkpoint_engine"] = {"bucket_mb": 1}
    return raw


@pytest.mark.parametrize("name", ["qwen2-arith", pytest.param("mixtral-chain3", marks=pytest.mark.slow)])
def test_transfer_pair_with_the_defaults_does_not_collapse(name, ray_cluster, tmp_path):
    cfg = parse_config(_reduced(name))
    model_dir = prepare_model(cfg)
    style = STYLES[PAIRS[name]["tokenizer"]]
    tok = TextTokenizer.load(model_dir)
    # the family's conventions: its end of turn is the EOS the engines stop on, its template renders prompts
    assert tok.hf.convert_ids_to_tokens(tok.eos_id) == style.eos
    assert read_config(model_dir).model_type == PAIRS[name]["family"]
    assert tok.hf.chat_template == style.chat_template
    summary = train(cfg, tmp_path / "run")
    assert summary["iterations"] == 3 and summary["rollbacks"] == 0
    assert summary["final_accuracy"] >= summary["initial_accuracy"] - 0.05, summary


def test_a_non_native_warm_start_is_a_transformers_checkpoint_of_its_family_that_learned(tmp_path, monkeypatch):
    """benchmarks.hf_warmstart: what a run of ``gemma3-arith`` starts from is a Gemma 3 checkpoint that transformers
    loads, in Gemma's conventions, whose SFT made the reference solutions likelier than at its initialisation
    (scored by transformers' own forward, apart from the project's trainer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.hf_warmstart import STYLES, hf_warmstart

    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))
    cfg = parse_config({"model": {"path": None, "chat_template": True},
                        "env": {"name": "arithmetic", "num_train": 100, "num_eval": 10},
                        "warmstart": {"num_examples": 400, "batch_size": 16, "vocab_size": 300, "seed": 3}})
    model_dir = hf_warmstart(cfg, "gemma3_text", "gemma", 15, log=lambda _: None, threads=1)
    assert hf_warmstart(cfg, "gemma3_text", "gemma", 15, log=None) == model_dir  # cached: not built again
    assert AutoConfig.from_pretrained(model_dir).model_type == "gemma3_text"
    tok = TextTokenizer.load(model_dir, chat_prompts=True)
    assert tok.hf.convert_ids_to_tokens(tok.eos_id) == "<end_of_turn>" == STYLES["gemma"].eos
    rendered = tok.hf.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False,
                                          add_generation_prompt=True)
    assert rendered == "<bos><start_of_turn>user\n1+1?<end_of_turn>\n<start_of_turn>model\n"

    maker, kwargs, _ = task_maker(cfg.env_entries[0])
    tasks = maker.generate_tasks(8, 12345, **kwargs)  # other tasks than the warm start's (its seed is SFT_SEED)

    def nll(model) -> float:
        total, count = 0.0, 0
        for t in tasks:
            p, r = tok.prompt_ids(t), [*tok.encode(t.meta["solution"]), tok.eos_id]
            with torch.no_grad():
                logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1]
            total -= float(torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(r)[:, None]).sum())
            count += len(r)
        return total / count

    trained = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).eval()
    after, before = nll(trained), nll(untrained)
    print(f"response NLL per token: {before:.3f} untrained, {after:.3f} after the warm start")
    assert after < 0.5 * before, (after, before)
