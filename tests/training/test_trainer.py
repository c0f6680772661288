"""The pretraining loop end to end on the Brown fixture, plus its parts (LR schedule, EMA, metrics, CLI)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tadm.cli import main
from tadm.config import ConfigError, ExperimentConfig, load_config, save_config
from tadm.nn import load_model
from tadm.training import objectives
from tadm.training.checkpoint import CONFIG_FILENAME, load_training_state, save_training_state
from tadm.training.ema import EMA
from tadm.training.lr import WarmupSchedule, build_lr_scheduler
from tadm.training.metrics import MetricsLogger, read_metrics
from tadm.training.tokenization import TextTokenizer
from tadm.training.trainer import DataPreparationError, NonFiniteLossError, build_training_model, train

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "brown_slice.jsonl"
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tadm_tiny_losses.json"


def tiny(out_dir: Path, tokenizer: str | Path, cache_dir: Path, *overrides: str) -> ExperimentConfig:
    base = [
        "model.preset=tiny",
        f"data.source={FIXTURE}",
        f"data.tokenizer={tokenizer}",
        "data.tokenizer_vocab_size=320",
        "data.seq_len=32",
        "data.val_fraction=0.1",
        f"data.cache_dir={cache_dir}",
        "objective.step_budgets=[8,16,32]",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "train.max_steps=4",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.log_every=1",
        "train.eval_every=1000",
        "train.eval_batches=4",
        "train.save_every=1000",
        "train.ema=0",
        "train.device=cpu",
        f"train.out_dir={out_dir}",
    ]
    return load_config(None, base + list(overrides))


# ------------------------------------------------------------------------------- whole runs
@pytest.mark.slow
def test_twenty_steps_lower_the_validation_loss(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path) -> None:
    cfg = tiny(tmp_path, tokenizer_dir, cache_dir, "train.max_steps=20", "train.eval_every=10", "train.ema=0.5",
               "train.save_best=true")
    result = train(cfg)
    steps = [s for s, _ in result.val_history]
    assert steps == [0, 10, 20]
    start, end = result.val_history[0][1], result.val_history[-1][1]
    assert end < start - 0.3, result.val_history
    assert result.val_ppl == pytest.approx(math.exp(end))
    assert result.tokens_seen == 20 * 8 * 32 and len(result.losses) == 20

    records = read_metrics(tmp_path / "metrics.jsonl")
    train_records = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train_records] == list(range(1, 21))
    assert [r["loss"] for r in train_records] == result.losses
    assert {"loss", "diffusion", "anchor", "lr", "grad_norm", "tokens_per_s", "tokens_seen"} <= set(train_records[0])
    assert [r["nelbo"] for r in records if r["split"] == "val"] == [v for _, v in result.val_history]

    # final/: the EMA model with its tokenizer and resolved config, loadable as is
    model = load_model(result.model_dir)
    state = load_training_state(result.state_path)
    assert state["step"] == 20
    for key, value in model.state_dict().items():
        assert torch.equal(value, state["ema"]["weights"][key])
    assert not torch.equal(state["ema"]["weights"]["head.linear.weight"], state["model"]["head.linear.weight"])
    assert TextTokenizer.load(result.model_dir).vocab_size == model.vocab_size == 320
    assert model.config.max_seq_len == 32 and model.anchor_head is None  # gamma = 0: no anchor LM head
    assert load_config(result.model_dir / CONFIG_FILENAME) == cfg
    assert (tmp_path / "best" / "model.safetensors").is_file()


@pytest.mark.slow
def test_golden_losses(tmp_path: Path) -> None:
    """10 steps of a tiny TADM (BPE trained on the fixture) against the checked-in per-step losses."""
    cfg = tiny(tmp_path / "run", "bpe", tmp_path / "cache", "train.max_steps=10",
               "objective.refresh_intervals=[1,2,4,8]")
    result = train(cfg)
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()  # data.tokenizer=bpe trains it there
    if os.environ.get("TADM_REGENERATE_GOLDEN") == "1":
        payload = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
        payload["losses"] = result.losses
        payload["torch_version"] = torch.__version__
        GOLDEN.write_text(json.dumps(payload, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert len(golden["losses"]) == 10
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(golden["losses"]), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["tadm", "ar"])
def test_validation_does_not_depend_on_the_micro_batch(arch: str, tmp_path: Path, tokenizer_dir: Path,
                                                       cache_dir: Path) -> None:
    """Validation scores train.eval_batches batches of the global batch (eval_batch_size unset), whatever the
    micro-batch, so the same weights give the same val NELBO. TADM's weights differ after a step (the training
    noise is drawn per micro-batch), so its step 0 is compared; AR draws no noise, so its later steps are too."""
    steps = 2 if arch == "ar" else 1
    runs = {micro: train(tiny(tmp_path / f"m{micro}", tokenizer_dir, cache_dir, f"model.arch={arch}",
                              f"train.micro_batch_size={micro}", f"train.max_steps={steps}", "train.eval_every=1",
                              "train.ema=0.5"))
            for micro in (8, 2)}
    assert [s for s, _ in runs[8].val_history] == [s for s, _ in runs[2].val_history] == list(range(steps + 1))
    v8, v2 = ([v for _, v in runs[m].val_history] for m in (8, 2))
    compared = steps + 1 if arch == "ar" else 1
    torch.testing.assert_close(torch.tensor(v2[:compared]), torch.tensor(v8[:compared]), rtol=1e-6, atol=0)
    if arch == "tadm":  # an explicit eval_batch_size is another sample of blocks and noise
        smaller = train(tiny(tmp_path / "e2", tokenizer_dir, cache_dir, "train.max_steps=1",
                             "train.eval_batch_size=2"))
        assert abs(smaller.val_history[0][1] - v8[0]) > 1e-4


@pytest.mark.slow
def test_a_run_saved_before_eval_batch_size_existed_resumes(tmp_path: Path, tokenizer_dir: Path,
                                                            cache_dir: Path) -> None:
    train(tiny(tmp_path, tokenizer_dir, cache_dir, "train.max_steps=1"))
    state = load_training_state(tmp_path / "training_state.pt")
    del state["config"]["train"]["eval_batch_size"]
    save_training_state(state, tmp_path / "training_state.pt")
    resumed = train(tiny(tmp_path, tokenizer_dir, cache_dir, "train.max_steps=2"), resume=True)
    assert (resumed.start_step, resumed.step) == (1, 2)


@pytest.mark.parametrize("arch, extra", [
    ("mdlm", ()),
    ("adlm", ("objective.gamma=0.01",)),
    ("ar", ()),
    ("tadm", ("objective.gamma=0.01", "train.precision=bf16")),  # anchor loss; CPU bf16 autocast
])
@pytest.mark.slow
def test_baselines_train(arch: str, extra: tuple[str, ...], tmp_path: Path, tokenizer_dir: Path,
                         cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = train(tiny(tmp_path, tokenizer_dir, cache_dir, f"model.arch={arch}", "train.max_steps=2", *extra))
    assert len(result.losses) == 2 and all(math.isfinite(v) for v in result.losses)
    said = capsys.readouterr().out  # an AR model's validation loss is its exact NLL, not a bound
    wording = ("val NLL", "perplexity ") if arch == "ar" else ("val NELBO", "perplexity bound")
    assert all(w in said for w in wording) and ("NELBO" in said) == (arch != "ar")
    assert load_model(result.model_dir).vocab_size == 320
    if arch == "adlm":  # the rare-token table is cached beside the packed blocks
        assert list(cache_dir.glob("*/train.counts.npy"))


@pytest.mark.slow
def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(
    tmp_path: Path, tokenizer_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    real = objectives.OBJECTIVES["tadm"]
    calls = {"n": 0}

    def poisoned(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        calls["n"] += model.training  # validation batches do not count
        if calls["n"] > 2 * 3:  # two micro-batches per step: step 4 goes bad
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setitem(objectives.OBJECTIVES, "tadm", poisoned)
    cfg = tiny(tmp_path, tokenizer_dir, cache_dir, "train.max_steps=6", "train.save_every=2")
    with pytest.raises(NonFiniteLossError, match="at step 4") as err:
        train(cfg)
    assert err.value.step == 4 and "training_state.pt (step 2)" in str(err.value)
    state = load_training_state(tmp_path / "training_state.pt")
    assert state["step"] == 2 and all(torch.isfinite(v).all() for v in state["model"].values())
    assert not (tmp_path / "final").exists()

    # the CLI: one line on stderr, exit status 3
    calls["n"] = 0
    (tmp_path / "cli.yaml").write_text(json.dumps(cfg.to_dict()))  # JSON is YAML
    code = main(["train", str(tmp_path / "cli.yaml"), f"train.out_dir={tmp_path / 'cli'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 3
    assert len(lines) == 1 and "training loss is nan at step 4" in lines[0]


@pytest.mark.slow
def test_out_dir_guard_and_overwrite(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path) -> None:
    first = train(tiny(tmp_path, tokenizer_dir, cache_dir, "train.max_steps=1"))
    with pytest.raises(ConfigError, match="already holds a run"):
        train(tiny(tmp_path, tokenizer_dir, cache_dir, "train.max_steps=1"))
    again = train(tiny(tmp_path, tokenizer_dir, cache_dir, "train.max_steps=2", "train.overwrite=true"))
    assert again.losses[0] == first.losses[0]  # the same seed gives the same first step
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", "train")] == [1, 2]


@pytest.mark.slow
def test_overwrite_refuses_to_delete_its_own_tokenizer_or_corpus(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """train.overwrite=true deletes the previous run's final/, tokenizer/, ...: a data.tokenizer or data.source in
    there is refused in one line before anything is deleted."""
    out = tmp_path / "run"
    train(tiny(out, tokenizer_dir, cache_dir, "train.max_steps=1"))
    corpus = out / "final" / "corpus.jsonl"
    corpus.write_text(FIXTURE.read_text())
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for key, value in (("data.tokenizer", out / "final"), ("data.source", corpus)):
        with pytest.raises(ConfigError, match=rf"{key}='.*' lies in .*final, which train.overwrite=true deletes"):
            train(tiny(out, tokenizer_dir, cache_dir, f"{key}={value}", "train.overwrite=true"))
    config = tmp_path / "c.yaml"
    save_config(tiny(out, out / "final", cache_dir, "train.overwrite=true"), config)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("tadm train: error: data.tokenizer=") and "copy it out of" in err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing was deleted
    # a tokenizer outside what is deleted is fine
    assert train(tiny(out, tokenizer_dir, cache_dir, "train.max_steps=1", "train.overwrite=true")).step == 1


def test_setup_errors_are_clear(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path) -> None:
    tok = TextTokenizer.load(tokenizer_dir)
    with pytest.raises(ConfigError, match="vocab_size=999 does not match the tokenizer's 320"):
        build_training_model(tiny(tmp_path, tokenizer_dir, cache_dir, "model.overrides.vocab_size=999"), tok)
    with pytest.raises(ConfigError, match="max_seq_len=16 < data.seq_len=32"):
        build_training_model(tiny(tmp_path, tokenizer_dir, cache_dir, "model.overrides.max_seq_len=16"), tok)
    with pytest.raises(ConfigError, match="anchor_lm_head"):
        build_training_model(tiny(tmp_path, tokenizer_dir, cache_dir, "objective.gamma=0.1",
                                  "model.overrides.anchor_lm_head=false"), tok)
    with pytest.raises(ConfigError, match="hidden_sise"):
        build_training_model(tiny(tmp_path, tokenizer_dir, cache_dir, "model.overrides.hidden_sise=8"), tok)
    assert build_training_model(tiny(tmp_path, tokenizer_dir, cache_dir, "objective.gamma=0.1"), tok).anchor_head
    with pytest.raises(ConfigError, match="global_batch_size=100000 does not fit the data"):
        train(tiny(tmp_path, tokenizer_dir, cache_dir, "train.global_batch_size=100000"))
    with pytest.raises(DataPreparationError, match="does not exist"):
        train(tiny(tmp_path, tokenizer_dir, cache_dir, f"data.source={tmp_path / 'nope.jsonl'}"))


@pytest.mark.slow
def test_a_single_text_file_is_a_corpus(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(json.loads(line)["text"] for line in FIXTURE.read_text().splitlines()[:6]))
    cfg = tiny(tmp_path / "run", tokenizer_dir, cache_dir, f"data.source={book}", "train.max_steps=1")
    result = train(cfg)
    assert result.step == 1 and result.val_nelbo is not None and math.isfinite(result.val_nelbo)
    assert "val blocks" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ CLI
def test_cli_user_errors_print_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "   "}\n')
    good = tmp_path / "ok.yaml"
    good.write_text(
        f"data:\n  source: {empty}\n  cache_dir: {tmp_path / 'cache'}\ntrain:\n  out_dir: {tmp_path / 'run'}\n"
    )
    cases = [
        (["train", str(tmp_path / "missing.yaml")], "is neither a file nor a shipped preset"),
        (["train", str(good), "train.max_stepz=3"], "max_stepz"),
        (["train", str(good), "train.max_steps=many"], "max_steps"),
        (["train", str(good)], "holds no non-blank text"),
        (["tokenizer", "train", "--source", str(empty), "--out", str(tmp_path / "tok")], "holds no non-blank text"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (argv, err)


def test_tokenizer_cli_trains_a_loadable_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--source", str(FIXTURE), "--vocab-size", "300", "--out", str(out)]) == 0
    assert "vocab_size 300" in capsys.readouterr().out
    tok = TextTokenizer.load(out)
    assert tok.vocab_size == 300 and tok.mask_id == 299
    assert tok.decode(tok.encode("The jury said.")) == "The jury said."


# ------------------------------------------------------------------------------ loop pieces
def test_warmup_then_constant_or_cosine() -> None:
    const = WarmupSchedule(warmup_steps=4, max_steps=10, schedule="constant")
    assert [const(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = WarmupSchedule(warmup_steps=2, max_steps=6, schedule="cosine", min_lr_ratio=0.1)
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p / 4)) for p in range(4)] + [0.1, 0.1]
    assert [cos(s) for s in range(8)] == pytest.approx(expected)
    assert WarmupSchedule(0, 5)(0) == 1.0
    with pytest.raises(ValueError, match="valid: constant, cosine"):
        WarmupSchedule(1, 5, schedule="linear")

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = build_lr_scheduler(opt, warmup_steps=2, max_steps=6, schedule="cosine", min_lr_ratio=0.1)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2 * v for v in expected[:4]])
    # a resumed run keeps its own max_steps and sets the optimizer's lr for the restored step
    state = sched.state_dict()
    opt2 = torch.optim.SGD([param], lr=2.0)
    sched2 = build_lr_scheduler(opt2, warmup_steps=2, max_steps=10, schedule="cosine", min_lr_ratio=0.1)
    sched2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == pytest.approx(2 * WarmupSchedule(2, 10, "cosine", 0.1)(4))


def test_ema_update_by_hand() -> None:
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, -2.0]]))
    ema.update(model)
    torch.testing.assert_close(ema.model.weight, torch.tensor([[0.9 * 1 + 0.1 * 3, 0.9 * 2 + 0.1 * -2]]))
    ema.update(model)
    torch.testing.assert_close(ema.model.weight, torch.tensor([[0.81 * 1 + 0.19 * 3, 0.81 * 2 + 0.19 * -2]]))
    assert not ema.model.weight.requires_grad and not ema.model.training
    copy = EMA(torch.nn.Linear(2, 1), decay=0.9)
    copy.load_state_dict(ema.state_dict())
    assert torch.equal(copy.model.weight, ema.model.weight) and copy.num_updates == 2
    with pytest.raises(ValueError, match="decay"):
        EMA(model, decay=1.0)


def test_metrics_logger_truncates_on_resume(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path)
    for step in (1, 2, 3):
        log.log(step, "train", {"loss": torch.tensor(0.5 * step)})
    log.log(3, "val", {"nelbo": float("nan")})
    assert read_metrics(tmp_path / "metrics.jsonl", "val") == [{"step": 3, "split": "val", "nelbo": "nan"}]
    MetricsLogger(tmp_path, resume_step=2)  # records after the checkpoint go
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    MetricsLogger(tmp_path, enabled=False).log(9, "train", {"loss": 1.0})  # other ranks write nothing
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2


def test_tensorboard_is_optional(tmp_path: Path) -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.warns(UserWarning, match=r"pip install 'tadm\[tracking\]'"):
            log = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"])
        installed = False
    else:
        log = MetricsLogger(tmp_path, loggers=["jsonl", "tensorboard"])
        installed = True
    log.log(1, "train", {"loss": 1.5})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "split": "train", "loss": 1.5}]
    assert (tmp_path / "tensorboard").is_dir() == installed
