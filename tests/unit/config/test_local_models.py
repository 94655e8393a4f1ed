"""neutrain.config.local_models: a recipe's model and tokenizer names are found on this machine or refused in one line."""

from __future__ import annotations

import pytest

from neutrain.config import RecipeError, load_recipe
from neutrain.config import local_models
from neutrain.config.sections import ModelSection


def check_model_names(values: dict) -> None:
    """The check on a model section holding ``values`` (the keys a test leaves out at their defaults)."""
    local_models.check_model_names(ModelSection.model_construct(**values))

PRETRAINED = {"init": "pretrained", "config": None, "tokenizer": None, "gguf_file": None}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face hub cache; ``add(repo, *files)`` puts a snapshot of ``repo`` in it, as a download does."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    def add(repo: str, *files: str) -> None:
        folder = cache / ("models--" + repo.replace("/", "--"))
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text("0" * 40)
        snapshot = folder / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        for name in files:
            (snapshot / name).write_text("{}")

    add.path = cache
    return add


def test_a_hub_id_in_the_cache_or_a_local_directory_is_accepted(hub_cache, tmp_path):
    hub_cache("someone/cached-model", "config.json", "tokenizer_config.json")
    check_model_names({**PRETRAINED, "base_model": "someone/cached-model"})
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    check_model_names({**PRETRAINED, "base_model": str(tmp_path / "model"), "tokenizer": "someone/cached-model"})


def test_a_hub_id_not_in_the_cache_names_the_key_the_user_set(hub_cache):
    with pytest.raises(RecipeError) as err:
        check_model_names({**PRETRAINED, "base_model": "someone/not-downloaded"})
    message = str(err.value)
    assert message.startswith("model.base_model: 'someone/not-downloaded' is not a local directory and not in the "
                              f"local Hugging Face cache ({hub_cache.path})")
    assert "hf download someone/not-downloaded" in message and "\n" not in message
    # The tokenizer comes from the base model when model.tokenizer is unset: the base model is still the key named.
    hub_cache("someone/config-only", "config.json")
    with pytest.raises(RecipeError, match=r"^model\.tokenizer: 'someone/no-tokenizer' is not a local directory"):
        check_model_names({**PRETRAINED, "base_model": "someone/config-only", "tokenizer": "someone/no-tokenizer"})


def test_a_directory_without_the_files_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RecipeError, match=r"^model\.base_model: the directory '.*empty' holds no config\.json: it is "
                                          r"not a Hugging Face model directory$"):
        check_model_names({**PRETRAINED, "base_model": str(tmp_path / "empty")})
    with pytest.raises(RecipeError, match=r"^model\.tokenizer: the directory '.*empty' holds no tokenizer_config\.json "
                                          r"or tokenizer\.json"):
        check_model_names({**PRETRAINED, "base_model": str(tmp_path), "tokenizer": str(tmp_path / "empty")})


def test_a_path_that_does_not_exist_is_named_as_a_path(tmp_path):
    with pytest.raises(RecipeError, match=r"^model\.base_model: '/no/such/model' does not exist"):
        check_model_names({**PRETRAINED, "base_model": "/no/such/model"})
    with pytest.raises(RecipeError, match=r"^model\.tokenizer: '\./tok' does not exist"):
        check_model_names({**PRETRAINED, "base_model": "/no/such/model", "tokenizer": "./tok", "init": "random",
                           "config": {"model_type": "llama"}})


def test_a_gguf_repo_must_hold_the_file_and_built_tokenizers_need_nothing(hub_cache):
    hub_cache("someone/gguf-repo", "model.Q8_0.gguf")
    check_model_names({**PRETRAINED, "base_model": "someone/gguf-repo", "gguf_file": "model.Q8_0.gguf"})
    with pytest.raises(RecipeError, match=r"^model\.base_model: 'someone/gguf-repo' is not a local directory"):
        check_model_names({**PRETRAINED, "base_model": "someone/gguf-repo", "gguf_file": "other.gguf"})
    check_model_names({"init": "random", "config": {"model_type": "llama"}, "tokenizer": "train-bpe",
                       "base_model": None, "gguf_file": None})


def test_load_recipe_checks_the_names(hub_cache):
    with pytest.raises(RecipeError, match=r"^model\.base_model: 'someone/not-downloaded' is not a local directory"):
        load_recipe("recipes/default.yaml", ["model.init=pretrained", "model.base_model=someone/not-downloaded",
                                             "model.config=null", "model.tokenizer=null"])
