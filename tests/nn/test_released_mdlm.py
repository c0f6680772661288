"""Released MDLM-family checkpoints: both layouts reproduce the reference DiT's logits; bad checkpoints are one line.

The fixture (tests/fixtures/mdlm_owt, README there) was written in the released layout by the reference
implementation itself (kuleshov-group/mdlm models/dit.py) at a tiny size, with its logits.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tadm.cli import main
from tadm.nn import MDLM, load_model, load_released_mdlm
from tadm.nn.released_mdlm import read_lightning_checkpoint, released_parameter_names
from tadm.sampling import MDLMSampler, generate

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "mdlm_owt"
REFERENCE = load_file(FIXTURE / "reference_logits.safetensors")
TOL = 1e-5

# The released names of one block and of the rest, as models/dit.py registers them (the layout's facts).
RELEASED_BLOCK = ["norm1.weight", "attn_qkv.weight", "attn_out.weight", "norm2.weight", "mlp.0.weight", "mlp.0.bias",
                  "mlp.2.weight", "mlp.2.bias", "adaLN_modulation.weight", "adaLN_modulation.bias"]
RELEASED_REST = ["vocab_embed.embedding", "sigma_map.mlp.0.weight", "sigma_map.mlp.0.bias", "sigma_map.mlp.2.weight",
                 "sigma_map.mlp.2.bias", "output_layer.norm_final.weight", "output_layer.linear.weight",
                 "output_layer.linear.bias", "output_layer.adaLN_modulation.weight",
                 "output_layer.adaLN_modulation.bias"]


def raw_logits(model: MDLM, ids: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
    """The network's output-layer logits (B, L, V), before SUBS: what the reference DiT returns."""
    with torch.no_grad():
        c = model.encode(ids)
        hidden, cond = model.predict_hidden(ids, c, c, t)
        return model.head(hidden, cond).float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def hub_copy(tmp_path: Path, state_edit=None, config_edit=None) -> Path:
    """A copy of the Hub-layout fixture with its weights and/or config.json edited."""
    out = tmp_path / "hub"
    out.mkdir()
    state = load_file(FIXTURE / "model.safetensors")
    config = json.loads((FIXTURE / "config.json").read_text())
    if state_edit:
        state_edit(state)
    if config_edit:
        config_edit(config)
    save_file(state, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config))
    return out


def fixture_checkpoint() -> dict:
    """The fixture's .ckpt as a dict whose config is a real DictConfig again and whose tokenizer is None."""
    from omegaconf import OmegaConf

    from tadm.nn.released_mdlm import _plain

    ckpt = read_lightning_checkpoint(FIXTURE / "last.ckpt")
    config = OmegaConf.create(_plain(ckpt["hyper_parameters"]["config"]))
    ckpt["hyper_parameters"] = {"config": config, "tokenizer": None}
    return ckpt


def test_the_layouts_name_table_is_the_released_one():
    names = {released for released, _ in released_parameter_names(2)}
    expected = set(RELEASED_REST) | {f"blocks.{n}.{name}" for n in range(2) for name in RELEASED_BLOCK}
    assert names == expected
    assert set(load_file(FIXTURE / "model.safetensors")) == {f"backbone.{n}" for n in expected} | {
        "backbone.rotary_emb.inv_freq"}


def test_the_hub_layout_reproduces_the_reference_logits():
    loaded = load_released_mdlm(FIXTURE)
    assert loaded.layout == "hub" and loaded.weights == "as saved" and len(loaded.mapped) == 30
    assert loaded.checked == ["backbone.rotary_emb.inv_freq"]
    c = loaded.model.config
    assert (c.vocab_size, c.hidden_size, c.num_heads, c.cond_dim, c.num_layers, c.max_seq_len) == (33, 32, 2, 16, 2, 12)
    assert loaded.model.mask_token_id == 32 and not c.time_conditioning
    assert max_diff(raw_logits(loaded.model, REFERENCE["input_ids"]), REFERENCE["logits_ema"]) <= TOL
    # load_model recognises the layout and converts it
    assert max_diff(raw_logits(load_model(FIXTURE), REFERENCE["input_ids"]), REFERENCE["logits_ema"]) <= TOL


@pytest.mark.parametrize("weights, key", [(None, "logits_ema"), ("ema", "logits_ema"), ("live", "logits_live")])
def test_the_lightning_checkpoint_reproduces_the_reference_logits(weights, key):
    loaded = load_released_mdlm(FIXTURE / "last.ckpt", weights=weights)
    assert loaded.layout == "lightning" and loaded.weights == (weights or "ema")
    assert loaded.config_from.startswith("hyper_parameters.config")  # n_heads read from the pickled Hydra config
    assert max_diff(raw_logits(loaded.model, REFERENCE["input_ids"]), REFERENCE[key]) <= TOL
    assert max_diff(raw_logits(load_model(FIXTURE / "last.ckpt"), REFERENCE["input_ids"]), REFERENCE["logits_ema"]) <= TOL


def test_time_conditioning_embeds_the_released_sigma():
    """The released code embeds sigma(t) = -log(1 - (1 - 1e-3) t); feeding t itself would not match."""
    loaded = load_released_mdlm(FIXTURE, time_conditioning=True)
    assert loaded.model.config.time_input == "sigma-loglinear"
    ids, t = REFERENCE["input_ids"], REFERENCE["t"]
    assert max_diff(raw_logits(loaded.model, ids, t), REFERENCE["logits_ema_sigma"]) <= TOL
    loaded.model.time_embed.time_input = "t"
    assert max_diff(raw_logits(loaded.model, ids, t), REFERENCE["logits_ema_sigma"]) > 1e-3


def test_the_checkpoints_pickled_objects_are_never_imported():
    """The .ckpt pickles a tokenizer of a module that does not exist here and an OmegaConf config."""
    with pytest.raises(pickle.UnpicklingError):
        torch.load(FIXTURE / "last.ckpt", weights_only=True)
    before = set(sys.modules)
    ckpt = read_lightning_checkpoint(FIXTURE / "last.ckpt")
    assert "scratch_tokenizer" not in sys.modules and not {m for m in set(sys.modules) - before if "omegaconf" in m}
    assert type(ckpt["hyper_parameters"]["tokenizer"]).__name__ == "Tokenizer"  # an inert record of it


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # what a malicious checkpoint would run on unpickling
        return (Path.touch, (self.marker,))


def test_a_checkpoint_that_would_run_code_when_unpickled_runs_none(tmp_path):
    marker = tmp_path / "ran"
    ckpt = fixture_checkpoint()
    ckpt["hyper_parameters"]["tokenizer"] = _Payload(marker)
    torch.save(ckpt, tmp_path / "evil.ckpt")
    loaded = load_released_mdlm(tmp_path / "evil.ckpt")
    assert not marker.exists()
    assert max_diff(raw_logits(loaded.model, REFERENCE["input_ids"]), REFERENCE["logits_ema"]) <= TOL


def test_a_checkpoint_without_a_readable_config_needs_num_heads(tmp_path):
    ckpt = fixture_checkpoint()
    ckpt["hyper_parameters"] = None
    torch.save(ckpt, tmp_path / "bare.ckpt")
    with pytest.raises(ValueError, match="pass num_heads"):
        load_released_mdlm(tmp_path / "bare.ckpt")
    loaded = load_released_mdlm(tmp_path / "bare.ckpt", num_heads=2, max_seq_len=12)
    assert loaded.config_from == "the weights' shapes"
    assert max_diff(raw_logits(loaded.model, REFERENCE["input_ids"]), REFERENCE["logits_ema"]) <= TOL


@pytest.mark.parametrize("case, needle", [
    ("missing", "is missing 1 weight(s) of the released MDLM layout (2 blocks): backbone.blocks.1.attn_out.weight"),
    ("extra", "holds 1 weight(s) the released MDLM layout (2 blocks) does not have: backbone.blocks.2.attn_out.weight"),
    ("shape", "backbone.blocks.0.mlp.0.bias has shape (100,), but the config (n_blocks=2, hidden_dim=32, n_heads=2, "
              "cond_dim=16, vocab_size=33) needs (128,) for blocks.blocks.0.mlp.0.bias"),
    ("heads", "backbone.rotary_emb.inv_freq has shape (8,), but n_heads gives head dimension 8, which needs (4,)"),
    ("prefix", "holds weights outside the released layout's 'backbone.' prefix: model.extra"),
    ("bd3lm", "is a BD3-LM checkpoint (model_type 'bd3lm')"),
    ("unknown-key", "config keys ['hidden_size'] are not in the released MDLM layout"),
])
def test_a_bad_checkpoint_is_one_line_naming_what_is_wrong(tmp_path, capsys, case, needle):
    edits = {
        "missing": dict(state_edit=lambda s: s.pop("backbone.blocks.1.attn_out.weight")),
        "extra": dict(state_edit=lambda s: s.update({"backbone.blocks.2.attn_out.weight": torch.zeros(32, 32)})),
        "shape": dict(state_edit=lambda s: s.update({"backbone.blocks.0.mlp.0.bias": torch.zeros(100)})),
        "heads": dict(config_edit=lambda c: c.update(n_heads=4)),
        "prefix": dict(state_edit=lambda s: s.update({"model.extra": torch.zeros(1)})),
        "bd3lm": dict(config_edit=lambda c: c.update(model_type="bd3lm", block_size=4, cross_attn=True)),
        "unknown-key": dict(config_edit=lambda c: c.update(hidden_size=32)),
    }
    source = hub_copy(tmp_path, **edits[case])
    with pytest.raises(ValueError) as err:
        load_released_mdlm(source)
    assert needle in str(err.value) and "\n" not in str(err.value)
    code = main(["convert", str(source), str(tmp_path / "out")])
    message = capsys.readouterr().err
    assert code == 2 and message.count("\n") == 1 and needle in message and "Traceback" not in message
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_uniform_state_lightning_checkpoint_is_refused(tmp_path):
    from omegaconf import OmegaConf

    ckpt = fixture_checkpoint()
    config = OmegaConf.to_container(ckpt["hyper_parameters"]["config"])
    config.pop("parameterization")
    config["algo"] = {"name": "duo", "parameterization": "mean", "time_conditioning": True}
    ckpt["hyper_parameters"]["config"] = OmegaConf.create(config)
    torch.save(ckpt, tmp_path / "duo.ckpt")
    with pytest.raises(ValueError, match="parameterization 'mean'"):
        load_released_mdlm(tmp_path / "duo.ckpt")


def test_convert_names_what_it_loaded_and_writes_a_tadm_model(tmp_path, capsys):
    out = tmp_path / "converted"
    assert main(["convert", str(FIXTURE / "last.ckpt"), str(out), "--weights", "live", "--list-weights"]) == 0
    printed = capsys.readouterr().out
    assert "as a released MDLM DiT (Lightning checkpoint" in printed and "weights: live" in printed
    assert "2 blocks, hidden 32, 2 heads, cond 16, vocab 33 (mask id 32), length 12" in printed
    assert "30 tensors (39,201 parameters) mapped key by key" in printed
    assert "backbone.blocks.1.attn_qkv.weight -> blocks.blocks.1.qkv.weight (96, 32)" in printed
    model = load_model(out)
    assert isinstance(model, MDLM) and model.config.time_input == "sigma-loglinear"
    assert max_diff(raw_logits(model, REFERENCE["input_ids"]), REFERENCE["logits_live"]) <= TOL
    assert main(["convert", str(FIXTURE), str(out)]) == 2
    assert "already holds a model" in capsys.readouterr().err


def test_tadm_samplers_run_on_the_loaded_model():
    model = load_released_mdlm(FIXTURE).model

    def run(K: int, seed: int):
        return generate(model, MDLMSampler(model.mask_token_id), batch_size=2, seq_len=12, num_steps=8,
                        refresh_interval=K, generator=torch.Generator().manual_seed(seed)).tokens

    tokens = run(1, 0)
    assert tokens.shape == (2, 12) and bool((tokens != 32).all()) and bool((tokens < 32).all())
    assert torch.equal(run(1, 0), tokens) and torch.equal(run(3, 0), tokens)  # no anchor: caching changes nothing
    assert not torch.equal(run(1, 1), tokens)


def test_a_released_directory_copied_without_the_rotary_buffer_still_loads(tmp_path):
    source = hub_copy(tmp_path, state_edit=lambda s: s.pop("backbone.rotary_emb.inv_freq"))
    loaded = load_released_mdlm(source)
    assert loaded.checked == []
    assert max_diff(raw_logits(loaded.model, REFERENCE["input_ids"]), REFERENCE["logits_ema"]) <= TOL
    shutil.rmtree(source)
