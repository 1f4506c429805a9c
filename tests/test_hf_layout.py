"""The transformers backend's weights under Hugging Face's checkpoint names, family by family: what the checkpoint
engine sends to vLLM, what the trainer's start-up read fills, and what its saves write (``engines.model.hf.layout``,
``engines.model.layout.placements``, ``engines.model.io.hf_io.save_pretrained``).

The reference is transformers' own ``save_pretrained`` and ``from_pretrained``: MoE experts that transformers stacks
into one tensor must reach the checkpoint (and vLLM, whose loaders read checkpoint names) one matrix per expert.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engines.model.hf.backend import empty_hf_model, load_hf_model, materialize
from engines.model.io.hf_io import read_tensors, save_pretrained
from engines.model.layout import hub_state, placements
from engines.training.packing import pack
from tests.hf_families import FAMILIES, documents, hf_config, sharpen


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, directory written by transformers' ``save_pretrained``, the tensors in it)."""
    family = request.param
    d = tmp_path_factory.mktemp(f"layout_{family}")
    torch.manual_seed(0)
    sharpen(AutoModelForCausalLM.from_config(hf_config(family))).save_pretrained(d)
    return family, d, read_tensors(d)


def _logprobs(model):
    prompts, responses = documents()
    batch = pack(prompts, responses, 0, "sdpa")
    with torch.no_grad():
        lp, _ = model(batch.ids, batch.positions, batch.mask, select=batch.target_flat, targets=batch.targets)
    return lp


def test_the_trainers_checkpoint_names_are_the_ones_transformers_saves(saved):
    family, d, on_disk = saved
    model = load_hf_model(d)
    state = hub_state(model)  # what the checkpoint engine sends, by name
    assert set(state) == set(on_disk), family
    assert all(state[k].shape == v.shape and torch.equal(state[k], v) for k, v in on_disk.items()), family


def test_a_trainers_save_loads_with_transformers_bit_for_bit(saved, tmp_path):
    family, d, on_disk = saved
    save_pretrained(load_hf_model(d), None, tmp_path)
    ours = read_tensors(tmp_path)
    assert set(ours) == set(on_disk) and all(torch.equal(ours[k], v) for k, v in on_disk.items()), family
    want = AutoModelForCausalLM.from_pretrained(d).state_dict()
    got = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items()), family
    assert AutoConfig.from_pretrained(tmp_path).model_type == AutoConfig.from_pretrained(d).model_type


def test_an_empty_model_filled_by_placements_scores_as_transformers_loaded_it(saved):
    """The start-up read: an empty model (parameters on meta, rotary tables computed) given storage and filled
    from the checkpoint tensor by tensor through its placements."""
    family, d, on_disk = saved
    model = materialize(empty_hf_model(AutoConfig.from_pretrained(d)), "cpu")
    views = hub_state(model)
    assert set(placements(model)) == set(on_disk)
    with torch.no_grad():
        for name, t in on_disk.items():
            views[name].copy_(t)
    assert torch.equal(_logprobs(model), _logprobs(load_hf_model(d))), family
