"""One training seed gives stale- and fresh-trained TADM the same start and the same data: a paired design."""

from dataclasses import asdict
from pathlib import Path

import torch

from tadm.study import load_study_config, model_experiment_config
from tadm.training.data import BlockSampler
from tadm.training.distributed import DistInfo
from tadm.training.trainer import _initial_model, _noise_seed, prepare_tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"


def _flat(d, prefix=""):
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_one_seed_gives_both_recipes_the_same_initial_weights_data_order_and_noise(tmp_path):
    cfg = load_study_config("study-paired-cpu", [f"out_dir={tmp_path}", f"data.source={FIXTURE}", "data.seq_len=16",
                                                 "size.hidden_size=16", "size.num_heads=2", "size.cond_dim=16"])
    stale_model, fresh_model = (next(m for m in cfg.models if m.kind == kind) for kind in ("tadm", "tadm-fresh"))
    stale, fresh = model_experiment_config(cfg, stale_model, 3), model_experiment_config(cfg, fresh_model, 3)
    a, b = _flat(asdict(stale)), _flat(asdict(fresh))
    # the recipes differ in the refresh intervals their anchors are drawn from, and where they write; nothing else
    assert {k for k in a if a[k] != b[k]} == {"objective.refresh_intervals", "train.out_dir"}
    assert a["objective.refresh_intervals"] == [1, 2, 4, 8] and b["objective.refresh_intervals"] == [1]
    assert a["train.seed"] == b["train.seed"] == 3

    tokenizer = prepare_tokenizer(stale, tmp_path / "tok")
    w_stale = _initial_model(stale, tokenizer, DistInfo()).state_dict()
    w_fresh = _initial_model(fresh, tokenizer, DistInfo()).state_dict()
    assert w_stale.keys() == w_fresh.keys()
    assert all(torch.equal(w_stale[k], w_fresh[k]) for k in w_stale)
    other = model_experiment_config(cfg, stale_model, 4)  # another seed starts elsewhere
    w_other = _initial_model(other, tokenizer, DistInfo()).state_dict()
    assert not all(torch.equal(w_stale[k], w_other[k]) for k in w_stale)

    # data order and diffusion noise are functions of (seed, step) only
    order = [BlockSampler(500, 32, seed=c.train.seed).global_batch(s) for c in (stale, fresh) for s in (0, 7, 40)]
    assert order[:3] == order[3:]
    assert _noise_seed(stale.train.seed, 5, 0) == _noise_seed(fresh.train.seed, 5, 0)
