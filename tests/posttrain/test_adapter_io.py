"""Adapter checkpoints: the fusion saved apart from the backbone, with its base model and split."""

import json

import pytest
import torch

from tadm.posttrain import (
    AnchoredBackbone,
    DiffusionGemmaBackbone,
    FusionSpec,
    SplitSpec,
    StackContext,
    attach_adapter,
    load_adapter_config,
    save_adapter,
)
from tadm.posttrain.adapter_io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME

from .conftest import build_tiny_gemma, randomize

V, L = 128, 8


def _trained(gemma):
    model = AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(1, 3), FusionSpec(rank=8, num_heads=2, gate_bias=-2.0))
    randomize(model.fusion, seed=4)
    return model


@pytest.mark.slow
def test_round_trip_restores_fusion_and_predictions(gemma, tmp_path):
    model = _trained(gemma)
    directory = save_adapter(tmp_path / "adapter", model, base_model="some/base", extra={"step": 7})
    assert sorted(p.name for p in directory.iterdir()) == sorted([ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME])
    config = load_adapter_config(directory)
    assert (config.base_model, config.backbone, config.num_layers, config.hidden_size) == ("some/base", "diffusion-gemma", 6, 32)
    assert (config.shared_layers, config.anchor_layers, config.denoiser_layers) == (1, 3, 2)
    assert (config.rank, config.num_heads, config.gate_bias, config.extra) == (8, 2, -2.0, {"step": 7})
    # The weights file holds the fusion only (tiny), none of the backbone.
    size = (directory / ADAPTER_WEIGHTS_NAME).stat().st_size
    assert size < 4 * sum(p.numel() for p in model.fusion.parameters()) + 4096

    restored = attach_adapter(DiffusionGemmaBackbone(build_tiny_gemma()), directory)
    assert restored.layer_split == model.layer_split
    for (name, a), b in zip(model.fusion.state_dict().items(), restored.fusion.state_dict().values()):
        assert torch.equal(a, b), name
    # Stale-anchor predictions agree.
    g = torch.Generator().manual_seed(0)
    prompt, z_old = torch.randint(3, V, (2, 5), generator=g), torch.randint(0, V, (2, L), generator=g)
    z_new = (z_old + torch.randint(0, 2, (2, L), generator=g)) % V

    def stale(m):
        ctx = StackContext(prompt=m.backbone.prefill(prompt))
        p_old, p_new = m.prepare(z_old, ctx), m.prepare(z_new, ctx)
        anchor = m.compute_anchor(m.encode(z_old, prepared=p_old), prepared=p_old)
        return m.predict_logits(z_new, m.encode(z_new, prepared=p_new), anchor, prepared=p_new)

    assert torch.equal(stale(model), stale(restored))
    naive = attach_adapter(DiffusionGemmaBackbone(build_tiny_gemma()), directory, fusion_mode="naive")
    assert naive.fusion_mode == "naive"


def test_mismatched_backbone_and_corrupt_files_are_refused(gemma, tmp_path):
    directory = save_adapter(tmp_path / "a", _trained(gemma), base_model="tiny")
    with pytest.raises(ValueError, match="trained on a 6-layer backbone of hidden size 32"):
        attach_adapter(DiffusionGemmaBackbone(build_tiny_gemma(num_layers=8)), directory)
    payload = json.loads((directory / ADAPTER_CONFIG_NAME).read_text())
    payload["learning_rate"] = 1.0
    (directory / ADAPTER_CONFIG_NAME).write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="unknown keys \\['learning_rate'\\]"):
        load_adapter_config(directory)
    with pytest.raises(FileNotFoundError, match="not a tadm adapter directory"):
        load_adapter_config(tmp_path)


MALFORMED = {
    "not-json": ("{not json", "is not valid JSON: Expecting property name"),
    "a-list": ("[1, 2]", "must hold a JSON object, got list"),
    "rank-as-text": ({"rank": "8"}, "'rank' must be an integer >= 1, got '8'"),
    "zero-heads": ({"num_heads": 0}, "'num_heads' must be an integer >= 1, got 0"),
    "negative-rank": ({"rank": -8}, "'rank' must be an integer >= 1, got -8"),
    "null-count": ({"shared_layers": None}, "'shared_layers' must be an integer >= 0, got None"),
    "bool-size": ({"hidden_size": True}, "'hidden_size' must be an integer >= 1, got True"),
    "nan-gate": ({"gate_bias": float("nan")}, "'gate_bias' must be a finite number, got nan"),
    "zero-eps": ({"eps": 0}, "'eps' must be a finite number > 0, got 0"),
    "empty-base": ({"base_model": ""}, "'base_model' must be a non-empty string, got ''"),
    "indivisible": ({"rank": 9}, "'rank' 9 must be divisible by 'num_heads' 2"),
    "layers-disagree": ({"denoiser_layers": 5}, "= 9 must equal 'num_layers' 6"),
    "missing-key": ({"hidden_size": KeyError}, "missing keys ['hidden_size']"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_adapter_config_is_one_line_naming_file_and_key(gemma, tmp_path, case):
    edit, needle = MALFORMED[case]
    directory = save_adapter(tmp_path / "a", _trained(gemma), base_model="tiny")
    path = directory / ADAPTER_CONFIG_NAME
    if isinstance(edit, str):
        path.write_text(edit)
    else:
        payload = json.loads(path.read_text())
        for key, value in edit.items():
            if value is KeyError:
                del payload[key]
            else:
                payload[key] = value
        path.write_text(json.dumps(payload))
    with pytest.raises(ValueError) as error:
        load_adapter_config(directory)
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(path)) and needle in message, message
    with pytest.raises(ValueError, match="^" + str(path)):  # attaching reads it the same way
        attach_adapter(DiffusionGemmaBackbone(gemma), directory)


def test_a_malformed_adapter_config_is_one_cli_line(gemma, tmp_path, capsys):
    from tadm.cli import main

    gemma.save_pretrained(tmp_path / "base")
    directory = save_adapter(tmp_path / "a", _trained(gemma), base_model="tiny")
    (directory / ADAPTER_CONFIG_NAME).write_text('{"format": 1, "num_heads": 0}')
    code = main(["posttrain", "sample", "--base", str(tmp_path / "base"), "--adapter", str(directory), "--prompt", "hi"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tadm ")]  # not transformers' progress bars
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("tadm posttrain sample: error: ") and "missing keys" in lines[0]
    assert str(directory / ADAPTER_CONFIG_NAME) in lines[0]


# ------------------------------------------------------------------- adapter weights that cannot be read
class Payload:
    """Unpickling this object runs code: it writes ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


def plant_weights(directory, case, marker):
    """Replace the adapter's weights file in ``directory`` by a broken or planted one; returns the file to name."""
    weights = directory / ADAPTER_WEIGHTS_NAME
    if case == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif case == "random-bytes":
        weights.write_bytes(bytes(range(256)) * 8)
    elif case == "empty":
        weights.write_bytes(b"")
    elif case == "pickle-renamed":  # a torch.save pickle under the safetensors name
        torch.save({"fusion.gate": Payload(marker)}, weights)
    elif case == "bin-only":  # PEFT's older pickle name instead of the safetensors file
        weights.unlink()
        weights = directory / "adapter_model.bin"
        torch.save({"fusion.gate": Payload(marker)}, weights)
    return weights


WEIGHTS_CASES = {
    "truncated": "is not a readable safetensors file (incomplete metadata",
    "random-bytes": "is not a readable safetensors file (header too large",
    "empty": "is not a readable safetensors file (header too small",
    "pickle-renamed": "is not a readable safetensors file (header too large",
    "bin-only": "tadm loads adapter weights only from safetensors",
}


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """A tiny saved base and a saved adapter for it (copied per test before it is damaged)."""
    root = tmp_path_factory.mktemp("weights-safety")
    gemma = build_tiny_gemma()
    gemma.save_pretrained(root / "base")
    save_adapter(root / "adapter", _trained(gemma), base_model=str(root / "base"))
    return root / "base", root / "adapter"


def _damaged_copy(saved_pair, tmp_path, case):
    import shutil

    directory = tmp_path / "adapter"
    shutil.copytree(saved_pair[1], directory)
    marker = tmp_path / "payload-ran"
    return directory, plant_weights(directory, case, marker), marker


@pytest.mark.parametrize("case", list(WEIGHTS_CASES))
def test_damaged_adapter_weights_are_one_line_naming_the_file_through_from_pretrained(saved_pair, tmp_path, case):
    from tadm.posttrain import TimeAnchoredDiffusionGemma

    directory, weights, marker = _damaged_copy(saved_pair, tmp_path, case)
    for load in (lambda: attach_adapter(DiffusionGemmaBackbone(build_tiny_gemma()), directory),
                 lambda: TimeAnchoredDiffusionGemma.from_pretrained(saved_pair[0], adapter=directory)):
        with pytest.raises((ValueError, FileNotFoundError)) as error:
            load()
        message = str(error.value)
        assert "\n" not in message and str(weights) in message and WEIGHTS_CASES[case] in message, message
    assert not marker.exists()  # nothing was unpickled


@pytest.mark.parametrize("case", ["truncated", "pickle-renamed", "bin-only"])
def test_damaged_adapter_weights_are_one_line_in_posttrain_sample(saved_pair, tmp_path, capsys, case):
    from tadm.cli import main

    directory, weights, marker = _damaged_copy(saved_pair, tmp_path, case)
    code = main(["posttrain", "sample", "--base", str(saved_pair[0]), "--adapter", str(directory), "--prompt", "hi"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tadm ")]  # not transformers' progress bars
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("tadm posttrain sample: error: ") and str(weights) in lines[0], lines[0]
    assert WEIGHTS_CASES[case] in lines[0] and not marker.exists()
