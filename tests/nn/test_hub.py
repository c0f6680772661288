"""save_pretrained / from_pretrained / load_model round trips, registries and error messages."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tadm.nn import (
    ADLM,
    MDLM,
    MODEL_BUILDERS,
    MODEL_CLASSES,
    TADM,
    ARTransformer,
    build_model,
    load_model,
)

TINY = {
    "tadm": ("tadm-tiny", TADM),
    "mdlm": ("mdlm-tiny", MDLM),
    "adlm": ("adlm-tiny", ADLM),
    "ar": ("ar-tiny", ARTransformer),
}


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module.eval()


def outputs(model: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    out = model(z)
    if isinstance(model, TADM):
        return torch.cat([out.log_probs, out.anchor_log_probs], dim=-1)
    if isinstance(model, ADLM):
        return torch.cat(out, dim=-1)
    return out


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))  # mask id 64 excluded


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(TINY))
def test_round_trip(model_type: str, tmp_path: Path) -> None:
    name, cls = TINY[model_type]
    model = randomize(build_model(name), seed=3)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == model_type
    assert (tmp_path / "model.safetensors").is_file()
    z = tokens()
    if model_type != "ar":
        z[:, ::3] = model.mask_token_id
    expected = outputs(model, z)
    for loaded in (load_model(tmp_path), cls.from_pretrained(str(tmp_path))):
        assert type(loaded) is cls and not loaded.training
        assert loaded.config == model.config
        assert torch.equal(outputs(loaded, z), expected)
    assert MODEL_CLASSES[model_type] is cls


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_the_model_card_says_what_the_model_is_and_how_to_load_it(model_type: str, tmp_path: Path) -> None:
    model = build_model(TINY[model_type][0])
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    params = f"{sum(p.numel() for p in model.parameters()):,}"
    assert f"# A tadm `{model_type}` model" in card and f"with {params} parameters" in card
    assert "load_model(" in card and "library_name: tadm" in card and f"- {model_type}" in card
    assert "pushed to the Hub" not in card and "More Information Needed" not in card


def test_round_trip_keeps_nondefault_config(tmp_path: Path) -> None:
    model = build_model("tadm-tiny", anchor_layers=3, time_conditioning=True, anchor_lm_head=False, mask_token_id=0)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config == model.config and loaded.mask_token_id == 0
    assert loaded.anchor_head is None and len(loaded.anchor.blocks) == 3


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        TADM.from_pretrained(missing)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model("./does-not-exist")


def test_hub_name_without_download_is_file_not_found() -> None:
    with pytest.raises(FileNotFoundError, match="someone/not-a-tadm-model"):
        load_model("someone/not-a-tadm-model", local_files_only=True)


def test_incomplete_directory(tmp_path: Path) -> None:
    build_model("mdlm-tiny").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unknown_or_wrong_model_type(tmp_path: Path) -> None:
    build_model("mdlm-tiny").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'mdlm'"):
        TADM.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt-7"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="gpt-7") as err:
        load_model(tmp_path)
    assert all(t in str(err.value) for t in ("adlm", "ar", "mdlm", "tadm"))
    del config["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="None"):
        load_model(tmp_path)


def test_unknown_config_key_and_weight_mismatch(tmp_path: Path) -> None:
    build_model("tadm-tiny").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hiden_size": 32}))
    with pytest.raises(ValueError, match="hiden_size"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "anchor_layers": 3}))
    with pytest.raises(RuntimeError, match="anchor.blocks.2"):
        load_model(tmp_path)


def test_builders_registry() -> None:
    expected = {f"{arch}-{size}" for arch in ("tadm", "mdlm", "adlm", "ar") for size in ("small", "tiny")}
    assert set(MODEL_BUILDERS) == expected
    model = build_model("mdlm-tiny", num_layers=2)
    assert isinstance(model, MDLM) and model.layer_split.denoiser == 2
    with pytest.raises(ValueError, match="tadm-tiny") as err:
        build_model("tadm-huge")
    assert "tadm-huge" in str(err.value) and "ar-small" in str(err.value)


def test_model_configs_share_one_size_schema():
    """Every network config takes the shared size fields from one base and validates them there."""
    from tadm.nn import ADLMConfig, ARConfig, DiTSizes, MaskedDiffusionSizes, MDLMConfig, TADMConfig

    shared = {"vocab_size", "hidden_size", "num_heads", "cond_dim", "mlp_ratio", "dropout", "max_seq_len"}
    for config_class in (TADMConfig, MDLMConfig, ADLMConfig, ARConfig):
        assert issubclass(config_class, DiTSizes)
        assert shared <= {f.name for f in dataclasses.fields(config_class)}
        with pytest.raises(ValueError, match=f"{config_class.__name__}.hidden_size"):
            config_class(hidden_size=30, num_heads=4)  # 30 is not divisible by 4
        for layer_field in config_class.layer_fields:
            with pytest.raises(ValueError, match=f"{config_class.__name__}.{layer_field} must be an int >= 1"):
                config_class(**{layer_field: 0})
    for config_class in (TADMConfig, MDLMConfig, ADLMConfig):
        assert issubclass(config_class, MaskedDiffusionSizes)
        assert config_class(vocab_size=10).resolved_mask_token_id == 9
    assert not issubclass(ARConfig, MaskedDiffusionSizes)


@pytest.mark.parametrize("name", sorted(MODEL_BUILDERS))
def test_a_preset_refuses_an_unknown_override_naming_the_valid_keys(name):
    expected = rf"^{name}: unknown \w+Config keys \['nosuch'\]; valid keys: \[.*'hidden_size'"
    with pytest.raises(ValueError, match=expected):
        build_model(name, nosuch=1)
    assert build_model(name, hidden_size=32, num_heads=2).config.hidden_size == 32


def test_a_size_preset_name_is_not_looked_up_on_the_hub() -> None:
    # "tadm-tiny" is also a valid Hub id: without this check it meant about 25 s of offline retries
    with pytest.raises(ValueError, match=r"'tadm-tiny' is a size preset, not a saved model: build it with "
                                         r"tadm\.nn\.build_model\('tadm-tiny'\)"):
        load_model("tadm-tiny")
