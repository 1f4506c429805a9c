"""`rl serve MODEL_DIR --adapter ADAPTER_DIR`: a base model plus a PEFT LoRA adapter, served over the OpenAI API,
answers as ``peft.PeftModel`` on the transformers model does (greedy tokens, log-probs), on the native engine and on
vLLM's LoRA; adapters the server cannot serve exactly are refused in one line."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engines.inference.server import ServedModel
from engines.model.io.hf_io import load_pretrained, save_pretrained
from engines.model.lora.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    LoraSpec,
    adapter_state,
    apply_lora,
    read_adapter,
    save_adapters,
)
from rl.cli import main as rl_main
from tests.conftest import sharp_model, tiny_config
from tests.test_server import running

SPEC = LoraSpec(rank=4, alpha=8.0)  # scaling 2: a merge that forgot it would not match peft
PROMPT = "Question: Mia has 3 apples."
STEPS = 8


def _config(tokenizer, hidden: int = 64):
    # head_dim 32: vLLM's CPU attention has no kernel for smaller heads
    return tiny_config(tokenizer.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=256, eos_token_id=tokenizer.eos_id,
                       pad_token_id=tokenizer.pad_id)


def _adapter(base_dir, out, spec=SPEC, seed=1):
    """An adapter of ``spec`` on ``base_dir`` with B drawn nonzero (as after training), saved in PEFT's format."""
    model = load_pretrained(base_dir)
    apply_lora(model, spec, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return save_adapters(spec, adapter_state(model), out, str(base_dir))


def _greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, one full forward per step (the reference, no cache)."""
    seq, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            lp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].float(), -1)
            seq.append(int(lp.argmax()))
            lps.append(lp[seq[-1]].item())
    return seq[len(prompt):], lps


@pytest.fixture(scope="module")
def made(tokenizer, tmp_path_factory):
    """(base dir, adapter dir, peft's greedy tokens and log-probs, the base's greedy tokens and log-probs,
    peft's log-probs of every token of prompt + its greedy tokens)."""
    root = tmp_path_factory.mktemp("serve_adapter")
    base = root / "base"
    save_pretrained(sharp_model(_config(tokenizer)).eval(), tokenizer, base)
    adapter = _adapter(base, root / "adapter")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, adapter).eval()
    prompt = tokenizer.encode(PROMPT)
    ref = _greedy(with_adapter, prompt, STEPS)
    with with_adapter.disable_adapter():
        plain = _greedy(with_adapter, prompt, STEPS)
    seq = prompt + ref[0]
    with torch.no_grad():
        lp = torch.log_softmax(with_adapter(input_ids=torch.tensor([seq])).logits[0].float(), -1)
    scored = [lp[i - 1, seq[i]].item() for i in range(1, len(seq))]
    return base, adapter, ref, plain, scored


def _check_served(served: ServedModel, tokenizer, ref, plain, scored) -> None:
    """Over HTTP: peft's greedy tokens (log-probs within 1e-4), not the base's; an echoed sequence scores as peft
    scores it."""
    with running(served) as (client, _):
        r = client.completions.create(model=served.name, prompt=PROMPT, max_tokens=STEPS, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True}).choices[0]
        assert r.text == tokenizer.decode(ref[0])
        assert r.logprobs.token_logprobs == pytest.approx(ref[1], abs=1e-4)
        # the adapter matters here: the base alone answers otherwise, so a server that dropped it fails above
        assert ref[0] != plain[0] or max(abs(a - b) for a, b in zip(ref[1], plain[1], strict=True)) > 1e-2
        seq = tokenizer.encode(PROMPT) + ref[0]
        echo = client.completions.create(model=served.name, prompt=seq, echo=True, logprobs=0, max_tokens=0)
        assert echo.choices[0].logprobs.token_logprobs[0] is None
        assert echo.choices[0].logprobs.token_logprobs[1:] == pytest.approx(scored, abs=1e-4)


def test_native_serves_base_plus_adapter_as_peft(made, tokenizer):
    base, adapter, ref, plain, scored = made
    served = ServedModel(base, max_num_seqs=4, kv_cache_bytes=16 << 20, device="cpu", adapter=adapter)
    assert served.engine.adapter_base_bytes == 0  # merged in place for good: no copy of the base kept
    _check_served(served, tokenizer, ref, plain, scored)


def test_vllm_serves_base_plus_adapter_through_its_lora(made, tokenizer):
    vllm_engine = pytest.importorskip("engines.inference.vllm_engine")
    if not vllm_engine.vllm_available():
        pytest.skip("vLLM is not installed here (make setup installs it)")
    base, adapter, ref, plain, scored = made
    served = ServedModel(base, max_num_seqs=4, kv_cache_bytes=32 << 20, engine="vllm", adapter=adapter)
    with pytest.raises(RuntimeError, match="serves a LoRA adapter; its weights take no updates"):
        served.engine.load_weights(iter(()))
    _check_served(served, tokenizer, ref, plain, scored)


def _bad(made, tmp_path, tokenizer, name: str):
    """A copy of the good adapter, broken as ``name`` says; returns its directory."""
    adapter = made[1]
    d = tmp_path / name
    d.mkdir()
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    tensors = load_file(str(adapter / ADAPTER_WEIGHTS))
    if name == "rank":  # the config says r=8, the factors are rank 4
        config["r"] = 8
    elif name == "dora":
        config["use_dora"] = True
    elif name == "ia3":
        config["peft_type"] = "IA3"
    elif name == "module":  # layer 5 of a 2-layer model
        tensors = {k.replace(".layers.1.", ".layers.5."): t for k, t in tensors.items()}
    elif name == "other_base":  # made for a model of hidden size 32
        small = tmp_path / "small"
        save_pretrained(sharp_model(_config(tokenizer, hidden=32)).eval(), tokenizer, small)
        return _adapter(small, d)
    if name != "missing":
        save_file(tensors, str(d / ADAPTER_WEIGHTS))
    (d / ADAPTER_CONFIG).write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("name, message", [
    ("rank", r"mlp\.down_proj has lora_A \(4, 128\) and lora_B \(64, 4\), not \[r, in\] and \[out, r\] with the "
             r"config's r = 8"),
    ("dora", r"unsupported adapter option use_dora=true \(DoRA's magnitude vectors\)"),
    ("ia3", r"unsupported adapter option peft_type 'IA3' \(only LORA adapters are supported\)"),
    ("module", r"has no linear weight model\.layers\.5\.mlp\.down_proj\.weight"),
    ("other_base", r"model\.layers\.0\.mlp\.down_proj is \[out, in\] = \[32, 64\] in the adapter but \[64, 128\]"),
    ("missing", r"adapter_model\.safetensors is missing"),
])
def test_bad_adapters_are_refused_in_one_line(made, tmp_path, tokenizer, capsys, name, message):
    bad = _bad(made, tmp_path, tokenizer, name)
    with pytest.raises(ValueError, match=message):
        ServedModel(made[0], device="cpu", adapter=bad)
    assert rl_main(["serve", str(made[0]), "--device", "cpu", "--adapter", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("error: rl serve: LoRA adapter") or "rl serve: LoRA adapter" in err


def test_a_lora_runs_own_adapter_is_not_merged_twice(made, tmp_path, tokenizer, capsys):
    """final/ of a LoRA run is the merged model with its adapter in adapter/: serving it with that adapter again
    would add B·A twice, so it is refused (final/ alone is served as any model directory)."""
    final = tmp_path / "final"
    save_pretrained(sharp_model(_config(tokenizer)).eval(), tokenizer, final)
    _adapter(made[0], final / ADAPTER_DIR)
    assert rl_main(["serve", str(final), "--device", "cpu", "--adapter", str(final / ADAPTER_DIR)]) == 2
    err = capsys.readouterr().err
    assert "already merged" in err and len(err.strip().splitlines()) == 1


def test_read_adapter_gives_the_spec_the_base_and_our_names(made):
    a = read_adapter(made[1])
    assert a.spec == SPEC and a.base_model == str(made[0])
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in a.tensors and len(a.modules) == 2 * 7


def test_serve_help_names_the_adapter_flag(capsys):
    with pytest.raises(SystemExit) as e:
        rl_main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--adapter ADAPTER_DIR" in out and "PEFT LoRA adapter" in out
