"""A self-draft's weights (`--draft self:RECIPE`): the target's own weights quantized with a
recipe, made by the caller before the engine starts (the engine never quantizes)."""
from __future__ import annotations

import torch

from qserve.errors import ConfigError
from qserve.progress import bar
from qserve.quant.quantize import CALIB_TOKENS, num_steps, plan_layers, quantize_weights
from qserve.quant.recipe import Recipe, load_recipe


def self_recipe(name: str) -> Recipe:
    """The recipe of `--draft self:NAME`, checked (ConfigError for a bad or gguf recipe)."""
    try:
        recipe = load_recipe(name)
    except ConfigError as e:
        raise ConfigError(f"--draft self:{name}: {e}") from None
    if recipe.method == "gguf":
        raise ConfigError(f"--draft self:{name} imports GGUF blocks, which is the target "
                          f"itself; choose an rtn or awq recipe, e.g. self:w4g64")
    return recipe


def self_draft_weights(recipe_name: str, loaded) -> dict[str, torch.Tensor]:
    """The target's weights quantized with a recipe, as a qserve checkpoint would hold them."""
    recipe = self_recipe(recipe_name)
    if loaded.quant is not None:
        raise ConfigError(f"--draft self:{recipe_name} quantizes the target's weights, but "
                          f"{loaded.path} is already quantized; give the original model, or use "
                          f"--draft ngram")
    ids = None
    if recipe.method == "awq":
        from qserve.quant.calibration import read_text

        ids = loaded.tokenizer.encode(read_text(None)[:CALIB_TOKENS * 20],
                                      add_special_tokens=False)[:CALIB_TOKENS]
    plans = plan_layers(loaded.arch, recipe)
    with bar(num_steps(loaded.arch, recipe, plans), f"quantizing the self-draft ({recipe_name})",
             unit="step") as shown:
        def step(label: str, total: int) -> None:
            shown.set_postfix_str(label, refresh=False)
            shown.update()
        tensors, _ = quantize_weights(loaded, recipe, plans, ids, step)
    return tensors
