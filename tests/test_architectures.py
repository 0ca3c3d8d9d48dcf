"""The model's variants against transformers on tiny random checkpoints: Llama 3 rope scaling
with untied embeddings, Qwen2 (q/k/v bias, tied embeddings), Mistral (sliding window), Qwen2
with a window on some layers only, and MQA. Each is saved as a Hugging Face directory, loaded
by qserve, generated greedily through the paged engine, and checked position by position
against transformers' log-probabilities along qserve's own token path (so a near-tie cannot
turn one rounding difference into a different continuation)."""
import shutil

import pytest
import torch

from qserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256, initializer_range=0.15)


def configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama3-untied": LlamaConfig(**COMMON, num_key_value_heads=2, rope_theta=500000.0,
                                     tie_word_embeddings=False, rope_scaling={
                                         "rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}),
        "qwen2-bias": Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
        "mistral-window": MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=8),
        # layer 0 global, layer 1 windowed: the per-layer path, not the fused decode step
        "qwen2-window-layers": Qwen2Config(**COMMON, num_key_value_heads=2,
                                           use_sliding_window=True, sliding_window=8,
                                           max_window_layers=1),
        "llama-mqa": LlamaConfig(**COMMON, num_key_value_heads=1, tie_word_embeddings=True),
    }


@pytest.mark.parametrize("name", list(configs()))
def test_variant_matches_transformers(name, hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config = configs()[name]
    config.vocab_size = 49152  # so the default model's tokenizer files fit
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if name == "qwen2-bias":  # random biases, so that a dropped bias would show
        with torch.no_grad():
            for layer in ref.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    ref.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / f, tmp_path / f)

    llm = LLM(str(tmp_path), kv_cache_memory="64MiB", max_model_len=256, block_size=4)
    prompt = list(range(1000, 1021))  # 21 tokens: several blocks, longer than the window
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   logprobs=1))
    ids = out.outputs[0].token_ids
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + ids])).logits[0].float()
    ref_lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # (12, vocab)
    for i, (tok, lp) in enumerate(zip(ids, out.outputs[0].logprobs)):
        # fp32 all the way; differences come only from summation order (fused matmuls,
        # paged attention), orders of magnitude below 1e-3 on these small activations
        assert lp[tok] == pytest.approx(ref_lp[i, tok].item(), abs=1e-3), (name, i)
        assert tok == int(ref_lp[i].argmax()) or (
            ref_lp[i].max() - ref_lp[i, tok]).item() < 1e-4, (name, i)
