"""bench/memory.py, the memory model: its parameter counts against the models transformers
builds (on the meta device: nothing allocated), and its estimates against the peaks measured on
this machine (bench/results), within the 20% it claims."""
import os
import sys

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import memory  # noqa: E402

CONFIGS = {  # the HF config of each built-in shape
    "gpt2": ("GPT2Config", dict(n_layer=12, n_embd=768, n_head=12)),
    "gpt2-large": ("GPT2Config", dict(n_layer=36, n_embd=1280, n_head=20)),
    "qwen2.5-1.5b": ("Qwen2Config", dict(num_hidden_layers=28, hidden_size=1536, num_attention_heads=12,
                                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                         tie_word_embeddings=True)),
    "llama-3-8b": ("LlamaConfig", dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                       tie_word_embeddings=False)),
}


@pytest.mark.parametrize("shape", memory.SHAPES)
def test_parameter_counts_match_the_models_transformers_builds(shape):
    import transformers
    from transformers import AutoModelForCausalLM

    name, kw = CONFIGS[shape]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(getattr(transformers, name)(**kw))
    want = sum(p.numel() for p in model.parameters())
    assert memory.n_params(memory.SHAPES[shape])[0] == pytest.approx(want, rel=2e-3)  # biases are left out


def test_estimates_are_within_20_percent_of_the_measured_peaks(capsys):
    assert memory.validate() <= 0.2, capsys.readouterr().out
