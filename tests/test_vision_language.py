"""Vision-language checkpoints run as their language model, text in and text out: Gemma 3
4B/12B/27B (Gemma3ForConditionalGeneration), Mistral Small 3.x and Ministral 3
(Mistral3ForConditionalGeneration), LLaVA, Qwen2-VL, Qwen2.5-VL and Qwen3-VL keep the language
model's config as text_config (or flat beside vision_config) and its tensors under a prefix,
beside a vision tower qserve does not read. Qwen's multimodal rope gives a text token one
position on all three of its axes, so on text it is the plain rope of Qwen2 / Qwen3.

Tiny random checkpoints that transformers itself writes (with a vision tower), greedy through
the paged engine against transformers' own model of the whole checkpoint fed text alone, token
for token and logprob for logprob (fp32 on both sides); both tensor layouts transformers has
saved; a hub-style Gemma 3 config that lists only what differs from the defaults, read as
transformers reads it; the memory plan and `qserve quantize` see the language model alone.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import test_families as families
from qserve import LLM, SamplingParams
from test_families import COMMON, NEW_TOKENS, prompt, tokenizer_model  # noqa: F401


def configs() -> dict[str, object]:
    """name -> transformers config of a vision-language model with a tiny vision tower."""
    from transformers import (CLIPVisionConfig, Gemma3Config, Gemma3TextConfig, LlamaConfig,
                              LlavaConfig, Ministral3Config, Mistral3Config, MistralConfig,
                              PixtralVisionConfig, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig,
                              SiglipVisionConfig)

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    qwen_tokens = dict(image_token_id=317, video_token_id=318, vision_start_token_id=319,
                       vision_end_token_id=316)
    return {
        # seven layers: sliding, a global sixth, sliding again; the global rope scaled
        "gemma3": Gemma3Config(
            text_config=Gemma3TextConfig(
                **COMMON, vocab_size=320, num_hidden_layers=7, head_dim=32, sliding_window=8,
                query_pre_attn_scalar=32, rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
            vision_config=SiglipVisionConfig(**vision), mm_tokens_per_image=4,
            image_token_index=317, boi_token_index=318, eoi_token_index=319),
        "mistral3": Mistral3Config(
            text_config=MistralConfig(**COMMON, vocab_size=320, num_hidden_layers=2,
                                      head_dim=16, sliding_window=None,
                                      tie_word_embeddings=False),
            vision_config=PixtralVisionConfig(**vision, head_dim=16), image_token_index=319,
            spatial_merge_size=1, tie_word_embeddings=False),  # its own lm_head
        # Ministral 3 ships this way: a Mistral3 wrapper around its own language model
        "ministral3": Mistral3Config(
            text_config=Ministral3Config(**COMMON, vocab_size=320, num_hidden_layers=2,
                                         head_dim=16, rope_parameters={
                                             "rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 8,
                                             "rope_theta": 10000.0, "mscale": 1.0,
                                             "mscale_all_dim": 1.0,
                                             "llama_4_scaling_beta": 0.1}),
            vision_config=PixtralVisionConfig(**vision, head_dim=16), image_token_index=319,
            spatial_merge_size=1, tie_word_embeddings=False),
        "llava": LlavaConfig(
            text_config=LlamaConfig(**COMMON, vocab_size=320, num_hidden_layers=2),
            vision_config=CLIPVisionConfig(**vision), image_token_index=319),
        # M-RoPE: 8 frequencies a head in time / height / width sections (interleaved in
        # Qwen3-VL), which text tokens see as one position
        "qwen2_vl": Qwen2VLConfig(
            text_config=dict(COMMON, vocab_size=320, num_hidden_layers=2, rope_parameters={
                "rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
            vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2),
            **qwen_tokens),
        "qwen2_5_vl": Qwen2_5_VLConfig(
            text_config=dict(COMMON, vocab_size=320, num_hidden_layers=2, rope_parameters={
                "rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=64, fullatt_block_indexes=[0]),
            tie_word_embeddings=True, **qwen_tokens),  # as the 3B's
        "qwen3_vl": Qwen3VLConfig(
            text_config=dict(COMMON, vocab_size=320, num_hidden_layers=2, head_dim=32,
                             rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6],
                                              "mrope_interleaved": True, "rope_theta": 5e5}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=64, deepstack_visual_indexes=[0]),
            **qwen_tokens),
    }


@pytest.fixture(scope="module")
def checkpoints(tokenizer_model, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """name -> the directory transformers saved (families.write_checkpoint)."""
    root = tmp_path_factory.mktemp("vision-language")
    return {name: families.write_checkpoint(config, root / name, tokenizer_model,
                                            auto="AutoModelForImageTextToText")
            for name, config in configs().items()}


@pytest.fixture(scope="module")
def ggufs(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """name -> the fp32 GGUF llama.cpp's convert_hf_to_gguf.py makes of the checkpoint: its
    language model (the vision half would go to a separate --mmproj file)."""
    root = tmp_path_factory.mktemp("vision-language-gguf")
    families.convert_to_gguf([(path, root / f"{name}.gguf") for name, path in checkpoints.items()])
    return {name: root / f"{name}.gguf" for name in checkpoints}


def stored_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


def check(model: Path, reference: Path) -> None:
    """Greedy through the paged engine equals transformers' whole model of `reference` fed
    the same token ids, token for token and logprob for logprob."""
    families.check(model, reference, auto="AutoModelForImageTextToText")


@pytest.mark.parametrize("name", list(configs()))
def test_greedy_equals_transformers(name, checkpoints):
    names = stored_names(checkpoints[name])
    assert any(n.startswith(("vision_tower.", "visual.", "model.visual.")) for n in names)
    check(checkpoints[name], checkpoints[name])


@pytest.mark.parametrize("name", list(configs()))
def test_gguf_of_the_language_model_greedy_equals_transformers(name, checkpoints, ggufs):
    """llama.cpp names Qwen2-VL's and Qwen3-VL's language models qwen2vl and qwen3vl (their
    rope's sections in `rope.dimension_sections`); the others as their text family."""
    check(ggufs[name], checkpoints[name])


def relaid(src: Path, out: Path) -> Path:
    """`src` with its tensors under the names transformers 4.52-4.57 saved:
    model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*, lm_head.*."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        else:
            name = "model." + name
        renamed[name] = t
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name", ["gemma3", "mistral3"])  # tied and untied output
def test_the_other_tensor_layout_reads_the_same(name, checkpoints, tmp_path):
    out = relaid(checkpoints[name], tmp_path / name)
    assert "model.language_model.embed_tokens.weight" in stored_names(out)
    assert ("lm_head.weight" in stored_names(out)) == (name == "mistral3")
    check(out, checkpoints[name])


def test_the_weights_say_whether_the_output_is_tied(checkpoints, tmp_path):
    """A wrapper's config may say tie_word_embeddings at either level, and transformers'
    wrappers and versions default it differently (Mistral3Config: true, LlavaConfig: false);
    an lm_head.weight in the files is what the model was trained with."""
    import shutil

    from qserve.loader import load_arch

    path = tmp_path / "mistral3"
    shutil.copytree(checkpoints["mistral3"], path)
    assert "language_model.lm_head.weight" in stored_names(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    assert not load_arch(path).tie_word_embeddings
    check(path, checkpoints["mistral3"])
    assert load_arch(checkpoints["gemma3"]).tie_word_embeddings  # no lm_head stored


# --- a config as the hub keeps it -----------------------------------------------------------

# google/gemma-3-4b-it's config.json as transformers 4.50 wrote it: text_config holds only
# what differs from Gemma3TextConfig's defaults
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_flat_qwen2_5_vl_config_as_the_hub_keeps_it(checkpoints, tmp_path):
    """Qwen2.5-VL's hub config.json is flat: the language model's fields beside
    vision_config, and its rope as {"type": "mrope", "mrope_section": ...}."""
    import shutil

    path = tmp_path / "qwen2_5_vl"
    shutil.copytree(checkpoints["qwen2_5_vl"], path)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("model_type", "layer_types", "dtype"):
        text.pop(key)
    flat = cfg | text | {"rope_theta": rope["rope_theta"], "sliding_window": 32768,
                         "use_sliding_window": False, "max_window_layers": 28,
                         "rope_scaling": {"type": "mrope",
                                          "mrope_section": rope["mrope_section"]}}
    (path / "config.json").write_text(json.dumps(flat))
    check(path, checkpoints["qwen2_5_vl"])


def test_sparse_hub_config_reads_as_transformers_reads_it(tmp_path):
    from transformers import AutoConfig

    from qserve.loader import load_arch

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B))
    arch = load_arch(tmp_path)
    text = AutoConfig.from_pretrained(tmp_path).get_text_config()
    rope = text.rope_parameters
    assert arch.architecture == "gemma3_text"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers,
            arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.max_position_embeddings) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers,
        text.num_attention_heads, text.num_key_value_heads, text.head_dim,
        text.max_position_embeddings)
    assert (arch.rms_norm_eps, arch.query_pre_attn_scalar, arch.sliding_window,
            arch.hidden_act, arch.tie_word_embeddings) == (
        text.rms_norm_eps, text.query_pre_attn_scalar, text.sliding_window,
        text.hidden_activation, text.tie_word_embeddings)
    assert arch.layer_types == text.layer_types
    assert arch.rope_theta == rope["full_attention"]["rope_theta"]
    assert arch.rope_local_theta == rope["sliding_attention"]["rope_theta"]
    assert arch.rope_scaling["rope_type"] == rope["full_attention"]["rope_type"] == "linear"
    assert arch.rope_scaling["factor"] == rope["full_attention"]["factor"] == 8.0
    assert arch.attn_logit_softcapping is text.attn_logit_softcapping is None
    assert arch.final_logit_softcapping is text.final_logit_softcapping is None
    assert arch.bos_token_id == text.bos_token_id
    assert arch.eos_token_ids == [1, 106]  # the outer config's, as generation stops on both


def test_unsupported_language_model_is_one_line(tmp_path):
    from qserve.errors import ModelLoadError
    from qserve.loader import load_arch

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llava", "text_config": {"model_type": "deepseek_v3"}}))
    with pytest.raises(ModelLoadError, match=r"config\.json: model_type 'deepseek_v3' is not "
                                             r"supported; qserve runs llama, "):
        load_arch(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3",
                                                      "text_config": [1]}))
    with pytest.raises(ModelLoadError, match=r"config\.json: text_config is '\[1\]'; a gemma3 "
                                             r"config's language model must be an object$"):
        load_arch(tmp_path)


def test_missing_language_tensor_is_named(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from qserve.errors import ModelLoadError
    from qserve.loader import load_model

    shutil.copytree(checkpoints["llava"], tmp_path / "llava")
    tensors = load_file(tmp_path / "llava" / "model.safetensors")
    del tensors["language_model.model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "llava" / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj"
                                             r"\.weight$"):
        load_model(tmp_path / "llava")


# --- the language model alone, in memory and in a quantized copy ----------------------------

def test_memory_plan_counts_the_language_model_alone(checkpoints):
    from qserve.engine.memory_plan import resident_tensors
    from qserve.loader import load_arch
    from qserve.loader.hf_loader import expected_shapes

    path = checkpoints["gemma3"]
    arch = load_arch(path)
    names = {t[0] for t in resident_tensors(path, arch, torch.float32, True)}
    assert names == set(expected_shapes(arch))  # no vision tensor, none missing
    assert len(stored_names(path)) > len(names)


def test_info_says_it_runs_the_language_model_alone(checkpoints):
    from click.testing import CliRunner

    from qserve.cli import main

    r = CliRunner().invoke(main, ["info", str(checkpoints["gemma3"]), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["architecture"] == "gemma3_text"
    assert report["vision_language"].startswith("gemma3: its language model alone")
    # fp32 weights of the language model alone; the file holds the vision tower too
    assert report["weight_bytes"]["resident"] == 4 * report["num_params"]
    assert report["file_bytes"] > report["weight_bytes"]["resident"] + 4096
    plain = json.loads(CliRunner().invoke(main, ["info", "--json"]).output)
    assert "vision_language" not in plain


def test_quantized_copy_is_the_language_model(checkpoints, tmp_path):
    """`qserve quantize` of the whole checkpoint writes the language model alone, which runs
    as the same model does before quantizing (w8: the tokens of the dense model)."""
    from qserve.quant.quantize import quantize

    out = tmp_path / "gemma3-w8"
    quantize(str(checkpoints["gemma3"]), out, recipe="w8")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and "vision_config" not in cfg
    assert not [n for n in stored_names(out) if "vision" in n or "projector" in n]
    ids = list(prompt())
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = [LLM(str(p), kv_cache_memory="16MiB", max_model_len=256, kv_dtype="fp32")
            .generate([ids], params)[0].outputs[0].token_ids
            for p in (out, checkpoints["gemma3"])]
    assert runs[0] == runs[1]


def test_processor_chat_template_is_read(checkpoints, tmp_path):
    """A checkpoint whose chat template is the processor's chat_template.json alone."""
    import shutil

    from qserve.loader import load_tokenizer

    path = tmp_path / "llava"
    shutil.copytree(checkpoints["llava"], path)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_tokenizer(path).chat_template == template
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_tokenizer(path).chat_template == "{{ messages[0]['content'] }}"  # .jinja first


@pytest.mark.parametrize("part, what", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
     "a part of type 'image_url'"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     "a part of type 'input_audio'"),
    ("just text", "the part 'just text'"),
])
def test_an_image_in_a_chat_is_a_400_that_says_so(part, what):
    """The server serves text: an image (or audio) part is refused in one line that says why,
    never dropped silently."""
    from qserve.server import protocol as P

    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"}, part]}]}
    with pytest.raises(P.APIError) as e:
        P.parse_chat(body)
    assert e.value.status == 400 and e.value.param == "messages"
    assert re.fullmatch(rf"messages\[0\]\.content: {what} is not served; only text parts are "
                        r"\(a vision-language model runs as its language model alone\)",
                        e.value.message), e.value.message
    body["messages"][0]["content"][1] = {"type": "text", "text": 7}
    with pytest.raises(P.APIError, match=r"^messages\[0\]\.content: a text part's 'text' must "
                                         r"be a string$"):
        P.parse_chat(body)


def test_mistral3_gguf_metadata(tmp_path):
    """llama.cpp writes Mistral Small 3.x's language model and Ministral 3 as mistral3; the
    latter's query temperature takes YaRN's original context as its length, and without one
    the file is refused in one line. (Ministral 3 against transformers: test_families.py.)"""
    from test_loader import write_tiny_gguf

    from qserve.errors import ModelLoadError
    from qserve.loader import load_arch

    plain = load_arch(write_tiny_gguf(tmp_path / "plain.gguf", arch="mistral3"))
    assert (plain.architecture, plain.attn_temperature_beta) == ("mistral", None)
    yarn = {"mistral3.rope.scaling.type": "yarn", "mistral3.rope.scaling.factor": 16.0,
            "mistral3.rope.scaling.original_context_length": 16384}
    scaled = load_arch(write_tiny_gguf(tmp_path / "scaled.gguf", arch="mistral3", extra_kv={
        "mistral3.attention.temperature_scale": 0.1, **yarn}))
    assert scaled.attn_temperature_beta == pytest.approx(0.1)
    assert scaled.attn_temperature_length == 16384
    bad = write_tiny_gguf(tmp_path / "bad.gguf", arch="mistral3",
                          extra_kv={"mistral3.attention.temperature_scale": 0.1})
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(bad))}: attention temperature "
                                             r"length=None must be a positive integer$"):
        load_arch(bad)
