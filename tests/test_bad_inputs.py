"""A table of bad inputs: each ends in one line naming the bad value and exit status 2 (or a specific exception).

Every command-line case runs ``tadm.cli.main`` in-process and checks that stderr holds exactly one
line, with no traceback, containing the needle (the bad value, a path or a key). ``{d}`` in an
argument or needle stands for a directory of prepared bad files (see :func:`bad`). Python API
cases check the exception type and message.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tadm.cli import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "brown_slice.jsonl"
LAPTOP_TASK = Path(__file__).resolve().parents[1] / "scripts" / "laptop_task.py"


@pytest.fixture(autouse=True)
def no_code_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """The opt-in to run model-written code is absent unless a case gives it."""
    monkeypatch.delenv("TADM_ALLOW_CODE_EXEC", raising=False)
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)


class Payload:
    """Pickles as a call of os.system: loading it would create the file ``{d}/pwned``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of bad (and a few good) inputs."""
    from tadm.nn import adlm_tiny, ar_tiny, mdlm_tiny, tadm_tiny
    from tadm.training.checkpoint import STATE_FORMAT
    from tadm.training.tokenization import train_bpe_tokenizer

    d = tmp_path_factory.mktemp("bad")
    (d / "broken.yaml").write_text("train:\n  max_steps: [1, 2\n")
    (d / "latin1.yaml").write_bytes(b"train:\n  out_dir: caf\xe9\n")
    (d / "bad.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    (d / "blank.jsonl").write_text('{"text": "   "}\n')
    (d / "plain.txt").write_text("some plain text\n")
    packed = gzip.compress(FIXTURE.read_bytes())
    (d / "trunc.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    (d / "notgz.txt.gz").write_text("not gzip\n")
    (d / "bad.json").write_text("{not json")
    (d / "data.csv").write_text("a,b\n1,2\n")
    (d / "afile").write_text("user data")
    (d / "binary.json").write_bytes(b"\xff\xfe\x00binary")
    (d / "empty.json").write_text("  \n")
    (d / "numbers.json").write_text("[1, 2]")
    (d / "empty.yaml").write_text("# nothing set\n")
    (d / "ids.json").write_text('{"token_ids": [[5, 6, 7]]}')
    (d / "nothing.json").write_text('{"steps": 8}\n{"steps": 16}\n')
    (d / "tasks").mkdir()
    (d / "tasks" / "aime.jsonl").write_bytes(b'{"problem": "p", "answer": 1}\n{"problem": "caf\xe9", "answer": 2}\n')
    (d / "tasks" / "gsm8k.jsonl").write_text('{"question": "q", "answer": "1"}\n' * 6)
    docs = [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines()]
    tokenizer = train_bpe_tokenizer(docs, vocab_size=300, save_dir=d / "tok")
    for broken, name in (("badtok", "tokenizer.json"), ("badmeta", "tadm_tokenizer.json")):
        shutil.copytree(d / "tok", d / broken)
        (d / broken / name).write_text("{")
    adlm_tiny(vocab_size=300).save_pretrained(d / "adlm")
    tokenizer.save(d / "adlm")
    (d / "tiny.yaml").write_text(
        f"model: {{preset: tiny}}\ndata: {{source: {FIXTURE}, tokenizer: {d / 'tok'}, seq_len: 32, "
        f"val_fraction: 0.1, cache_dir: {d / 'cache'}}}\n"
        f"train: {{max_steps: 1, global_batch_size: 4, micro_batch_size: 4, device: cpu, out_dir: {d / 'run'}}}\n")
    tadm_tiny().save_pretrained(d / "ckpt")
    mdlm_tiny().save_pretrained(d / "mdlm")
    ar_tiny(vocab_size=300).save_pretrained(d / "ar")
    shutil.copytree(d / "ckpt", d / "trunc")
    weights = (d / "trunc" / "model.safetensors").read_bytes()
    (d / "trunc" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    shutil.copytree(d / "ckpt", d / "badcfg")
    (d / "badcfg" / "config.json").write_text("{oops")
    (d / "r-trunc").mkdir()
    (d / "r-trunc" / "training_state.pt").write_bytes(b"PK\x03\x04" + b"\0" * 60)  # a zip cut off after its header
    torch.save({"format": STATE_FORMAT, "step": Payload(f"touch {d / 'pwned'}")}, d / "payload.pt")
    return d


TRAIN = ("train", "{d}/tiny.yaml")

CLI_CASES = [
    # ------------------------------------------------------------------------------ tadm train
    pytest.param(["train", "{d}/missing.yaml"], "config '{d}/missing.yaml' is neither a file", id="train-missing-config"),
    pytest.param(["train", "{d}/broken.yaml"], "{d}/broken.yaml: not valid YAML", id="train-yaml-syntax"),
    pytest.param(["train", "{d}/latin1.yaml"], "{d}/latin1.yaml: not a UTF-8 text file", id="train-yaml-latin1"),
    pytest.param([*TRAIN, "train.max_stepz=3"], "train.max_stepz", id="train-unknown-key"),
    pytest.param([*TRAIN, "train.max_steps=many"], "Value 'many'", id="train-wrong-type"),
    pytest.param([*TRAIN, "nokeyvalue"], "got 'nokeyvalue'", id="train-override-without-equals"),
    pytest.param([*TRAIN, "optim.lr=nan"], "optim.lr must be a finite number > 0, got nan", id="train-lr-nan"),
    pytest.param([*TRAIN, "optim.lr=inf"], "optim.lr must be a finite number > 0, got inf", id="train-lr-inf"),
    pytest.param([*TRAIN, "optim.eps=0"], "optim.eps must be a finite number > 0, got 0.0", id="train-adam-eps-0"),
    pytest.param([*TRAIN, "optim.betas=[0.9]"], "got [0.9]", id="train-one-beta"),
    pytest.param([*TRAIN, "train.ema=1.5"], "train.ema must be a finite number in [0, 1)", id="train-ema-1.5"),
    pytest.param([*TRAIN, "data.val_fraction=0"], "data.val_fraction must be a finite number in (0, 1), got 0.0",
                 id="train-val-fraction-0"),
    pytest.param([*TRAIN, "model.arch=sedd"], "model.arch 'sedd' is unknown", id="train-unknown-arch"),
    pytest.param([*TRAIN, "train.device=tpu"], "train.device 'tpu' is unknown", id="train-unknown-device"),
    pytest.param([*TRAIN, "train.precision=fp8"], "train.precision 'fp8' is unknown", id="train-unknown-precision"),
    pytest.param([*TRAIN, "train.micro_batch_size=3"], "train.micro_batch_size (3)", id="train-batch-not-multiple"),
    pytest.param([*TRAIN, "train.out_dir={d}/afile"], "train.out_dir '{d}/afile' is an existing file",
                 id="train-out-dir-is-a-file"),
    pytest.param([*TRAIN, "train.out_dir={d}/afile/run"], "train.out_dir '{d}/afile/run' cannot be created",
                 id="train-out-dir-under-a-file"),
    pytest.param([*TRAIN, "train.out_dir={d}/r-none", "--resume"],
                 "nothing to resume: no training state at {d}/r-none/training_state.pt", id="train-nothing-to-resume"),
    pytest.param([*TRAIN, "train.out_dir={d}/r-trunc", "--resume"],
                 "training state {d}/r-trunc/training_state.pt is truncated or corrupt", id="train-truncated-state"),
    pytest.param([*TRAIN, "data.source={d}/missing.jsonl", "train.out_dir={d}/r1"], "'{d}/missing.jsonl' does not exist",
                 id="train-missing-corpus"),
    pytest.param([*TRAIN, "data.source={d}/bad.jsonl", "train.out_dir={d}/r2"], "{d}/bad.jsonl:2: not valid UTF-8",
                 id="train-corpus-not-utf8"),
    pytest.param([*TRAIN, "data.source={d}/trunc.jsonl.gz", "train.out_dir={d}/r2gz"],
                 "{d}/trunc.jsonl.gz: truncated or corrupt gzip file", id="train-corpus-truncated-gzip"),
    pytest.param([*TRAIN, "data.source={d}/notgz.txt.gz", "train.out_dir={d}/r2ngz"],
                 "{d}/notgz.txt.gz: truncated or corrupt gzip file", id="train-corpus-not-gzip"),
    pytest.param([*TRAIN, "data.source={d}/blank.jsonl", "train.out_dir={d}/r3"],
                 "corpus '{d}/blank.jsonl' holds no non-blank text", id="train-blank-corpus"),
    pytest.param([*TRAIN, "data.source={d}/data.csv", "train.out_dir={d}/r4"], "{d}/data.csv: unsupported file type",
                 id="train-csv-corpus"),
    pytest.param([*TRAIN, "data.tokenizer={d}/notok", "train.out_dir={d}/r5"], "tokenizer directory '{d}/notok' does not exist",
                 id="train-missing-tokenizer"),
    pytest.param([*TRAIN, "data.tokenizer={d}/badtok", "train.out_dir={d}/r5t"],
                 "{d}/badtok/tokenizer.json: not a readable tokenizer file", id="train-corrupt-tokenizer-json"),
    pytest.param([*TRAIN, "data.tokenizer={d}/badmeta", "train.out_dir={d}/r5m"],
                 "{d}/badmeta/tadm_tokenizer.json: not valid JSON", id="train-corrupt-tokenizer-meta"),
    pytest.param([*TRAIN, "data.tokenizer=bpe", "data.tokenizer_vocab_size=100", "train.out_dir={d}/r6"],
                 "data.tokenizer_vocab_size must be >= 258 for data.tokenizer=bpe (256 byte symbols, <|endoftext|> "
                 "and <|mask|>), got 100", id="train-bpe-vocab-too-small"),
    pytest.param(["train", "adlm-tiny", "model.arch=mdlm"], "objective.gamma=0.003 has no effect on model.arch mdlm "
                 "(its loss reads objective: schedule, eps, antithetic); remove it", id="train-objective-key-ignored"),
    pytest.param(["train", "ar-tiny", "objective.eps=0.01", "objective.step_budgets=[8]"], "objective.eps=0.01, "
                 "objective.step_budgets=[8] have no effect on model.arch ar (its loss reads objective: none of "
                 "them); remove them", id="train-objective-keys-ignored-by-ar"),
    pytest.param([*TRAIN, "train.out_dir="], "overrides: train.out_dir is empty; it needs a value of type str",
                 id="train-empty-override-value"),
    pytest.param([*TRAIN, "=3"], "overrides must look like section.key=value, got '=3'", id="train-override-no-key"),
    pytest.param([*TRAIN, "data.seq_len=2", "train.out_dir={d}/r7"], "seq_len=2 is too short", id="train-seq-len-2"),
    pytest.param([*TRAIN, "train.global_batch_size=100000", "train.micro_batch_size=100000", "train.out_dir={d}/r8"],
                 "train.global_batch_size=100000 does not fit the data", id="train-batch-larger-than-data"),
    pytest.param([*TRAIN, "model.overrides.hidden_sise=8", "train.out_dir={d}/r9"], "'hidden_sise'",
                 id="train-unknown-model-override"),
    pytest.param([*TRAIN, "objective.schedule=quadratic", "train.out_dir={d}/r10"], "'quadratic'",
                 id="train-unknown-schedule"),
    pytest.param(["train", "{d}/empty.yaml"], "{d}/empty.yaml is empty: a config is a YAML mapping of sections",
                 id="train-empty-config"),
    pytest.param([*TRAIN, "train.loggers=[jsonl"], "override 'train.loggers=[jsonl': the value is not valid YAML",
                 id="train-override-not-yaml"),
    pytest.param(["study", "study-tiny", "sampling.refresh=[1,2"], "override 'sampling.refresh=[1,2': the value is "
                 "not valid YAML", id="study-override-not-yaml"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "rollout.cache_ages=[0,1"], "override "
                 "'rollout.cache_ages=[0,1': the value is not valid YAML", id="posttrain-override-not-yaml"),
    pytest.param(["quickstart", "--sampler", "entropy-bound", "--out", "{d}/qs"], "--sampler 'entropy-bound': "
                 "quickstart samples a masked model; valid: mdlm, remdm-cap", id="quickstart-sampler-before-training"),
    # ----------------------------------------------------------------------------- tadm sample
    pytest.param(["sample", "--model", "{d}/ckpt", "--sampler", "entropy-bound"], "sampler 'entropy-bound' reads raw "
                 "logits (predict_logits), which TADM does not give", id="sample-entropy-bound-on-tadm"),
    pytest.param(["sample", "--model", "{d}/no/such/dir"], "{d}/no/such/dir", id="sample-missing-model"),
    pytest.param(["sample", "--steps", "0"], "must be >= 1, got 0", id="sample-zero-steps"),
    pytest.param(["eval", "throughput", "--model", "{d}/mdlm", "-T", "4", "-K", "1,2"], "-K/--refresh: model "
                 "'{d}/mdlm' has no anchor network (0 anchor layers), so every refresh policy runs the same layers",
                 id="eval-throughput-K-without-anchor"),
    pytest.param(["sample", "--model", "mdlm-tiny", "-K", "adaptive:tau=0.1"], "model 'mdlm-tiny' has no anchor "
                 "network", id="sample-K-without-anchor"),
    pytest.param(["sample", "--sampler", "remdm-cap", "--time-grid", "released", "--schedule", "cosine"],
                 "--schedule has no effect with --time-grid released", id="sample-schedule-released-grid"),
    pytest.param(["eval", "sweep", "--models", "m={d}/ckpt", "-T", "4", "--time-grid", "released", "--schedule",
                  "cosine"], "sweep.sampler.schedule 'cosine' has no effect with time_grid 'released'",
                 id="eval-sweep-schedule-released-grid"),
    pytest.param(["sample", "--seed", "99999999999999999999"], "argument --seed: must be <= 4294967295, got "
                 "99999999999999999999", id="sample-seed-overflow"),
    pytest.param(["sample", "--seed", "-1"], "argument --seed: must be >= 0, got -1", id="sample-seed-negative"),
    pytest.param(["eval", "tasks", "--tasks", "gsm8k", "--seeds", "0,4294967296"], "argument --seeds: must be <= "
                 "4294967295, got 4294967296", id="eval-tasks-seed-overflow"),
    pytest.param(["train", "tadm-tiny", "train.seed=99999999999999999999999"], "train.seed must be an integer in "
                 "[0, 4294967295], got 99999999999999999999999", id="train-seed-overflow"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "fusion.gate_bias=nan"], "fusion.gate_bias must be a "
                 "finite number, got nan", id="posttrain-gate-bias-nan"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "fusion.eps=-1"], "fusion.eps must be a finite number > 0, "
                 "got -1", id="posttrain-fusion-eps"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "loss.ce_weight=0", "loss.kd_weight=0"],
                 "loss.ce_weight and loss.kd_weight are both 0: nothing would be trained", id="posttrain-no-loss"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "rollout.cache_ages=[0,1]", "rollout.cache_age_probs=[1,0]"],
                 "rollout.cache_age_probs [1.0, 0.0] give ages > 0 no probability, and at age 0 (a fresh anchor) the "
                 "fusion returns the anchor unchanged: nothing would be trained", id="posttrain-only-fresh-anchors"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "train.seed=-3"], "train.seed must be an integer in "
                 "[0, 4294967295], got -3", id="posttrain-seed-negative"),
    pytest.param(["sample", "--model", "{d}/ckpt", "-K", "adaptive:tau=0.1:skip_unchanged=false", "--skip-unchanged"],
                 "--skip-unchanged and -K adaptive:tau=0.1:skip_unchanged=false both set skip_unchanged; give one",
                 id="sample-skip-unchanged-twice"),
    pytest.param(["sample", "--model", "{d}/ckpt", "-K", "fixed:K=2:K=3"], "refresh spec 'fixed:K=2:K=3' gives "
                 "'interval' twice", id="sample-refresh-key-twice"),
    pytest.param(["sample", "--top-p", "1.5"], "top_p must be a finite number in (0, 1], got 1.5", id="sample-top-p"),
    pytest.param(["sample", "--sampler", "remdm-cap", "--eta", "nan"], "got nan", id="sample-eta-nan"),
    pytest.param(["sample", "--sampler", "ddim"], "unknown sampler 'ddim'", id="sample-unknown-sampler"),
    pytest.param(["sample", "--device", "tpu"], "unknown device 'tpu'", id="sample-unknown-device"),
    pytest.param(["sample", "--length", "100000"], "--length 100000", id="sample-too-long"),
    pytest.param(["sample", "--seed", "x"], "argument --seed: expected an integer, got 'x'", id="sample-seed-not-int"),
    pytest.param(["sample", "--model", "{d}/ckpt", "--tokenizer", "{d}/notok"], "'{d}/notok'", id="sample-missing-tokenizer"),
    pytest.param(["sample", "--refresh-policy", "schedule", "--refresh-steps", "8,x"], "'8,x'", id="sample-refresh-steps"),
    pytest.param(["sample", "--model", "{d}/trunc"], "{d}/trunc/model.safetensors", id="sample-truncated-weights"),
    pytest.param(["sample", "--model", "{d}/badcfg"], "{d}/badcfg/config.json", id="sample-corrupt-config-json"),
    # ---------------------------------------------------------------------------- tadm compute
    pytest.param(["compute", "--anchor-layers", "-1", "--denoiser-layers", "6", "--steps", "8"], "got -1",
                 id="compute-negative-layers"),
    pytest.param(["compute", "--anchor-layers", "1", "--steps", "8"], "--denoiser-layers", id="compute-missing-flag"),
    pytest.param(["compute", "--anchor-layers", "1", "--denoiser-layers", "1", "--steps", "0"], "got 0",
                 id="compute-zero-steps"),
    pytest.param(["compute", "--anchor-layers", "1", "--denoiser-layers", "1", "--steps", "8", "--refresh", "x"],
                 "refresh spec 'x': unknown policy 'x'; valid forms: 4, fixed:K=4", id="compute-refresh-not-int"),
    pytest.param(["compute", "--anchor-layers", "1", "--denoiser-layers", "1", "--steps", "8", "--baseline-layers", "0"],
                 "--baseline-layers: must be >= 1, got 0", id="compute-zero-baseline"),
    # ------------------------------------------------------------------------------- tadm eval
    pytest.param(["eval", "gen-ppl", "--samples", "{d}/missing.json"], "{d}/missing.json", id="eval-missing-samples"),
    pytest.param(["eval", "mauve", "--texts", "brown", "--reference", "brown", "--tokenizer", "{d}/tok"],
                 "--tokenizer decodes the token ids of --samples; --texts are already text", id="eval-texts-tokenizer"),
    pytest.param(["eval", "gen-ppl", "--samples", "{d}/bad.json"], "{d}/bad.json is neither JSON nor JSON lines",
                 id="eval-samples-not-json"),
    pytest.param(["eval", "mauve", "--texts", "brown", "--reference", "brown", "--num-buckets", "many"], "got 'many'",
                 id="eval-mauve-buckets"),
    pytest.param(["eval", "staleness", "--model", "{d}/ckpt", "--val-fraction", "2"], "got 2.0",
                 id="eval-staleness-val-fraction"),
    pytest.param(["eval", "staleness", "--model", "{d}/ckpt", "--val-fraction", "nan"], "got nan",
                 id="eval-staleness-val-fraction-nan"),
    pytest.param(["eval", "staleness", "--model", "{d}/ckpt", "--max-age", "-1"], "got -1", id="eval-staleness-age"),
    pytest.param(["eval", "staleness", "--model", "{d}/adlm", "--naive"], "--naive bypasses a TADM's fusion; model "
                 "'adlm' is ADLM, which has none", id="eval-staleness-naive-without-fusion"),
    pytest.param(["eval", "staleness", "--model", "{d}/ckpt", "--split", "all", "--val-fraction", "0.5"],
                 "--val-fraction holds out documents for --split val; --split all reads every document",
                 id="eval-staleness-val-fraction-with-all"),
    pytest.param(["eval", "likelihood", "--model", "{d}/ckpt", "--data", "brown", "--discrete-steps", "5",
                  "--t-samples", "3"], "--t-samples draws continuous times t; --discrete-steps sums the bound over T "
                 "discrete steps instead (no t is drawn): give one", id="eval-likelihood-discrete-and-t-samples"),
    pytest.param(["eval", "likelihood", "--model", "{d}/ckpt", "{d}/r-trunc/../ckpt", "--data", "brown"],
                 "two paths end in 'ckpt', which names them both; name each as NAME=PATH",
                 id="eval-likelihood-same-last-path-part"),
    pytest.param(["eval", "staleness", "--model", "{d}/ckpt", "--plot", "{d}"], "argument --plot: {d} is a "
                 "directory; give a file name", id="eval-staleness-plot-a-directory"),
    pytest.param(["eval", "likelihood", "--model", "{d}/ckpt", "--data", "brown", "--cache-dir", "{d}/afile"],
                 "argument --cache-dir: {d}/afile is an existing file; give a directory",
                 id="eval-likelihood-cache-dir-a-file"),
    pytest.param(["eval", "convert-livecodebench", "{d}/bad.jsonl", "--out", "{d}/afile/x.jsonl"],
                 "argument --out: {d}/afile/x.jsonl: a parent of it is an existing file",
                 id="convert-livecodebench-out-under-a-file"),
    pytest.param(["eval", "likelihood", "--model", "{d}/nomodel", "--data", "brown"], "'{d}/nomodel'",
                 id="eval-likelihood-missing-model"),
    pytest.param(["eval", "likelihood", "--model", "{d}/ckpt", "--data", "brown", "--tokenizer", "{d}/notok"],
                 "'{d}/notok'", id="eval-likelihood-missing-tokenizer"),
    pytest.param(["eval", "throughput", "--model", "tadm-tiny", "-T", "8", "--generations", "0"], "got 0",
                 id="eval-throughput-generations"),
    pytest.param(["eval", "sweep", "--models", "noequals", "-T", "8"], "'noequals' must look like NAME=PATH",
                 id="eval-sweep-model-spec"),
    pytest.param(["eval", "sweep", "--models", "m={d}/ckpt", "-T", "4", "--throughput-baseline", "mm"],
                 "throughput baseline 'mm' is not one of the sweep's models (m)", id="eval-sweep-unknown-baseline"),
    pytest.param(["eval", "sweep", "--models", "m={d}/ckpt", "-T", "4", "--reference", "none", "--num-reference", "9",
                  "--num-buckets", "3"], "--num-reference, --num-buckets have no effect: --reference none skips MAUVE",
                 id="eval-sweep-reference-flags-without-reference"),
    pytest.param(["eval", "sweep", "--models", "m={d}/ckpt", "-T", "4", "--throughput-generations", "0",
                  "--throughput-warmup", "3"], "--throughput-warmup has no effect: --throughput-generations 0 skips "
                 "timing", id="eval-sweep-timing-flags-without-timing"),
    pytest.param(["eval", "sweep", "--models", "m={d}/ckpt", "-T", "4", "--out", "{d}/ids.json"],
                 "argument --out: {d}/ids.json is an existing file; give a directory", id="eval-sweep-out-a-file"),
    pytest.param(["eval", "tasks", "--tasks", "gsm8k", "--model", "{d}/ckpt", "--data-dir", "{d}/tasks",
                  "--judge-model", "m"], "--judge-model names the model served at a --judge URL; --judge is 'none'",
                 id="eval-tasks-judge-model-without-url"),
    pytest.param(["eval", "tasks", "--tasks", "gsm8k", "--model", "{d}/ckpt", "--data-dir", "{d}/tasks",
                  "--judge", "http://localhost:1"], "--judge URL needs --judge-model", id="eval-tasks-url-no-model"),
    pytest.param(["eval", "tasks", "--tasks", "gsm8k", "--model", "{d}/ckpt", "--data-dir", "{d}/tasks",
                  "--code-timeout", "3", "--allow-uncontained-code", "signals"], "--code-timeout and "
                 "--allow-uncontained-code apply to the code tasks (humaneval, livecodebench), and this run has none",
                 id="eval-tasks-code-flags-unused"),
    pytest.param(["eval", "tasks", "--tasks", "gsm8k", "--model", "{d}/ckpt", "--out", "{d}/ids.json"],
                 "argument --out: {d}/ids.json is an existing file; give a directory", id="eval-tasks-out-a-file"),
    pytest.param(["eval", "sweep", "--models", "m={d}/ckpt", "-T", "4", "-K", "1", "--samples", "2",
                  "--evaluator", "{d}/nope", "--out", "{d}/sweep-ev", "--allow-dirty"],
                 "evaluator path '{d}/nope' does not exist; pass --evaluator PATH", id="eval-sweep-evaluator-first"),
    pytest.param(["eval", "frobnicate"], "invalid choice: 'frobnicate'", id="eval-unknown-action"),
    pytest.param(["eval", "gen-ppl", "--samples", "{d}/binary.json"], "--samples {d}/binary.json is not UTF-8 text",
                 id="eval-samples-binary"),
    pytest.param(["eval", "gen-ppl", "--samples", "{d}/empty.json"], "--samples {d}/empty.json is empty",
                 id="eval-samples-empty"),
    pytest.param(["eval", "gen-ppl", "--samples", "{d}/numbers.json"],
                 "--samples {d}/numbers.json must hold JSON objects with 'token_ids' or 'texts'", id="eval-samples-list"),
    pytest.param(["eval", "gen-ppl", "--samples", "{d}/ids.json"],
                 "--samples holds token ids only: pass --tokenizer DIR", id="eval-samples-ids-without-tokenizer"),
    pytest.param(["eval", "gen-ppl", "--samples", "{d}/nothing.json"],
                 "--samples {d}/nothing.json holds no token_ids or texts", id="eval-samples-without-samples"),
    # ------------------------------------------------------------------------- tadm eval tasks
    pytest.param(["eval", "tasks", "--base", "{d}/ckpt", "--tasks", "humaneval", "--data-dir", "{d}/tasks"],
                 "humaneval (its check) runs model-written code; allow it with --allow-code-execution or "
                 "TADM_ALLOW_CODE_EXEC=1", id="tasks-code-without-opt-in"),
    pytest.param(["eval", "tasks", "--base", "{d}/ckpt", "--tasks", "gsm8k", "--code-timeout", "nan"],
                 "--code-timeout: must be a finite number > 0, got 'nan'", id="tasks-code-timeout-nan"),
    pytest.param(["eval", "tasks", "--base", "{d}/ckpt", "--tasks", "humaneval", "--code-timeout", "0.001"],
                 "--code-timeout: must be at least 1 s (the sandbox starts two Python interpreters before the "
                 "program's first line), got '0.001'", id="tasks-code-timeout-below-the-floor"),
    pytest.param(["eval", "tasks", "--base", "{d}/ckpt", "--tasks", "humaneval", "--allow-uncontained-code",
                  "network,everything"], "--allow-uncontained-code: unknown sandbox gap 'everything'; valid: network, "
                 "local-sockets, file-writes, process-files, signals, leftover-processes",
                 id="tasks-unknown-sandbox-gap"),
    pytest.param(["eval", "tasks", "--base", "{d}/ckpt", "--tasks", "gsm8k", "--data-dir", "{d}/tasks", "--judge",
                  "foo"], "unknown judge 'foo': use none, local, local:PATH, local-free:PATH, or an http(s):// URL",
                 id="tasks-unknown-judge"),
    pytest.param(["eval", "tasks", "--base", "{d}/ckpt", "--tasks", "aime", "--data-dir", "{d}/tasks"],
                 "{d}/tasks/aime.jsonl:2: not UTF-8 (byte 0xe9", id="tasks-file-not-utf8"),
    # ---------------------------------------------------------------------- refresh policies
    pytest.param(["sample", "--refresh-policy", "adaptive", "--tau", "1.5"],
                 "tau 1.5 > 1 never refreshes the anchor again", id="sample-adaptive-tau-above-1"),
    pytest.param(["sample", "-T", "8", "--length", "8", "--refresh-policy", "schedule", "--refresh-steps",
                  "6,4"], "the refresh schedule must list the first step, i = T = 8 (the anchor is computed there), "
                 "got steps 6/4", id="sample-schedule-without-T"),
    pytest.param(["compute", "--anchor-layers", "4", "--denoiser-layers", "1", "-T", "16", "-K",
                  "schedule:steps=8/4"], "the refresh schedule must list the first step, i = T = 16",
                 id="compute-schedule-without-T"),
    pytest.param(["compute", "--anchor-layers", "4", "--denoiser-layers", "1", "-T", "16", "-K", "4,"],
                 "refresh list '4,' has an empty item", id="refresh-trailing-comma"),
    pytest.param(["compute", "--anchor-layers", "4", "--denoiser-layers", "1", "-T", "16,", "-K", "4"],
                 "expected comma-separated integers, got '16,' (an empty item)", id="steps-trailing-comma"),
    pytest.param(["compute", "--anchor-layers", "4", "--denoiser-layers", "1", "-T", "16,16"],
                 "argument -T/--steps: 16 is listed twice", id="steps-twice"),
    pytest.param(["eval", "tasks", "--model", "{d}/ckpt", "--seeds", "0", "0"], "argument --seeds: 0 is listed twice",
                 id="tasks-seed-twice"),
    pytest.param(["tokenizer", "train", "--out", ""], "argument --out: must not be empty", id="tokenizer-empty-out"),
    pytest.param(["tokenizer", "train", "--out", "{d}/afile/sub"], "argument --out: {d}/afile/sub: a parent of it is "
                 "an existing file", id="tokenizer-out-under-a-file"),
    pytest.param(["tokenizer", "train", "--out", "{d}/tk", "--source", " "], "argument --source: must not be empty",
                 id="tokenizer-empty-source"),
    pytest.param(["study", "study-tiny", "seeds=[0,0]", "out_dir={d}/st"], "seeds lists 0 twice",
                 id="study-seed-twice"),
    pytest.param(["study", "study-tiny", "out_dir={d}/st-ev", "sampling.evaluators=[ar,{d}/nope]"],
                 "sampling.evaluators: evaluator path '{d}/nope' does not exist; name in sampling.evaluators (a local",
                 id="study-evaluator-checked-before-training"),
    pytest.param(["study", "study-tiny", "out_dir={d}/st-untrained", "--stages", "sample", "score"],
                 "model 'tadm' seed 0 (and 7 more) is not trained in {d}/st-untrained; run the train stage first",
                 id="study-stages-without-training"),
    pytest.param(["study", "study-tiny", "out_dir={d}/st-empty", "--stages", "report"],
                 "{d}/st-empty holds no finished unit of this study to report", id="study-report-of-nothing"),
    pytest.param(["sample", "-K", "4", "-K", "8"], "this command takes one refresh policy, got 4, 8",
                 id="sample-repeated-K"),
    pytest.param(["eval", "tasks", "--base", "{d}/ckpt", "--tasks", "gsm8k,", "--data-dir", "{d}/tasks"],
                 "task list 'gsm8k,' has an empty item", id="tasks-trailing-comma"),
    pytest.param(["eval", "likelihood", "--model", "{d}/ar", "--tokenizer", "{d}/tok", "--data", str(FIXTURE),
                  "--discrete-steps", "8", "--schedule", "cosine"], "--discrete-steps, --schedule set(s) the "
                 "diffusion bound, and every --model is autoregressive", id="likelihood-ar-with-bound-flags"),
    pytest.param(["eval", "staleness", "--model", "{d}/ckpt", "--no-cached", "-K", "2"],
                 "-K/--refresh set(s) the cached-process bound, which --no-cached skips", id="staleness-no-cached-K"),
    pytest.param(["eval", "staleness", "--model", "{d}/ckpt", "--no-cached", "--discrete-steps", "8"],
                 "--discrete-steps set(s) the cached-process bound", id="staleness-no-cached-discrete"),
    pytest.param(["posttrain", "sample", "--base", "{d}/ckpt", "--adapter", "{d}/ckpt", "--split", "2,2", "--prompt",
                  "hi"], "give an adapter or a split, not both", id="posttrain-sample-adapter-and-split"),
    pytest.param(["eval", "gen-ppl", "--samples", "{d}/ids.json", "--tokenizer", "{d}/tok/tokenizer.json"],
                 "tokenizer '{d}/tok/tokenizer.json' is a file; give the directory that holds it",
                 id="gen-ppl-tokenizer-file"),
    pytest.param(["eval", "gen-ppl", "--samples", "{d}/tasks"], "--samples {d}/tasks is a directory; give a file",
                 id="gen-ppl-samples-directory"),
    pytest.param(["compute", "--anchor-layers", "0", "--denoiser-layers", "0", "--steps", "8"],
                 "--shared-layers, --anchor-layers and --denoiser-layers are all 0", id="compute-all-zero"),
    # -------------------------------------------------------------------------- tadm posttrain
    pytest.param(["posttrain", "train", "{d}/missing.yaml"], "'{d}/missing.yaml'", id="posttrain-missing-config"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "train.nope=1"], "train.nope", id="posttrain-unknown-key"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "train.max_steps=0"], "train.max_steps must be > 0, got 0",
                 id="posttrain-zero-steps"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "optim.lr=nan"], "optim.lr must be a finite number > 0, "
                 "got nan", id="posttrain-lr-nan"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "loss.kd_temperature=inf"], "loss.kd_temperature",
                 id="posttrain-kd-temperature-inf"),
    pytest.param(["posttrain", "train", "posttrain-tiny", "data.canvas_length=0"], "data.canvas_length must be null "
                 "(the base's canvas length) or an integer >= 1, got 0", id="posttrain-canvas-length-0"),
    pytest.param(["posttrain", "plan", "posttrain-diffusiongemma", "data.canvas_length=-4"], "data.canvas_length must "
                 "be null (the base's canvas length) or an integer >= 1, got -4", id="posttrain-plan-canvas-length-neg"),
    pytest.param(["posttrain", "sample", "--base", "{d}/nobase", "--prompt", "hi"], "'{d}/nobase' does not exist",
                 id="posttrain-missing-base"),
    pytest.param(["posttrain", "sample", "--base", "{d}/ckpt", "--split", "x,y", "--prompt", "hi"], "got 'x,y'",
                 id="posttrain-split"),
    pytest.param(["posttrain", "sample", "--base", "{d}/ckpt", "--steps", "0"], "got 0", id="posttrain-zero-steps-flag"),
    pytest.param(["posttrain", "sample", "--base", "{d}/mdlm", "--backbone", "mdlm", "--split", "1,1", "--prompt",
                  "hi"], "--backbone mdlm cannot encode a prompt: posttrain sample continues prompts of a "
                 "DiffusionGemma-class base", id="posttrain-sample-mdlm"),
    # -------------------------------------------------------------------------- tadm tokenizer
    pytest.param(["tokenizer", "train", "--vocab-size", "0", "--out", "{d}/t1"], "got 0", id="tokenizer-vocab-0"),
    pytest.param(["tokenizer", "train", "--source", "{d}/plain.txt", "--text-field", "body", "--out", "{d}/t-tf"],
                 "text_field 'body' applies to JSON lines, Parquet and Arrow files; '{d}/plain.txt' is plain text",
                 id="tokenizer-text-field-on-txt"),
    pytest.param([*TRAIN, "data.text_field=body", "data.source=brown", "train.out_dir={d}/r-tf"],
                 "text_field 'body' does not apply to the bundled corpus 'brown'", id="train-text-field-on-brown"),
    pytest.param(["tokenizer", "train", "--vocab-size", "100", "--out", "{d}/t2"], "vocab_size=100 is too small",
                 id="tokenizer-vocab-too-small"),
    pytest.param(["tokenizer", "train", "--source", "{d}/missing.jsonl", "--out", "{d}/t3"], "'{d}/missing.jsonl'",
                 id="tokenizer-missing-source"),
    pytest.param(["tokenizer", "train", "--source", "{d}/bad.jsonl", "--out", "{d}/t4"], "{d}/bad.jsonl:2",
                 id="tokenizer-source-not-utf8"),
    pytest.param(["tokenizer", "train", "--source", "{d}/data.csv", "--out", "{d}/t5"], "{d}/data.csv",
                 id="tokenizer-csv-source"),
    pytest.param(["tokenizer", "train", "--out", "{d}/tok"], "--out '{d}/tok' already holds a tokenizer",
                 id="tokenizer-out-holds-one"),
    pytest.param(["tokenizer", "train", "--out", "{d}/afile"], "argument --out: {d}/afile is an existing file; give a directory",
                 id="tokenizer-out-is-a-file"),
    pytest.param(["tokenizer", "train", "--min-frequency", "0", "--out", "{d}/t6"], "got 0", id="tokenizer-min-frequency"),
    pytest.param(["tokenizer", "frobnicate"], "invalid choice: 'frobnicate'", id="tokenizer-unknown-action"),
    pytest.param(["eval", "likelihood", "--model", "a={d}/ckpt", "a={d}/trunc", "--data", "brown"],
                 "name 'a' is given twice", id="eval-likelihood-name-twice"),
    pytest.param(["eval", "likelihood", "--model", "={d}/ckpt", "--data", "brown"],
                 "'={d}/ckpt' must look like NAME=VALUE or VALUE", id="eval-likelihood-empty-name"),
    pytest.param(["eval", "staleness", "--model", "{d}/ckpt", "-K", "1,adaptive:tau=0.1"],
                 "the cached-process bound is defined for fixed intervals K", id="eval-staleness-adaptive"),
    pytest.param(["eval", "throughput", "--model", "ar-tiny", "-T", "4"], "model 'ar-tiny' has no mask token",
                 id="eval-throughput-ar"),
    pytest.param(["eval", "throughput", "--model", "{d}/ckpt", "-T", "4", "--length", "100000"],
                 "--length 100000 exceeds the model's maximum 64", id="eval-throughput-too-long"),
    pytest.param(["sample", "--model", "{d}/ckpt", "--frobnicate"],
                 "unrecognized arguments: --frobnicate (see 'tadm sample --help')", id="sample-unknown-flag"),
    pytest.param(["eval", "gen-ppl", "--samples", "{d}/ids.json", "--frobnicate", "2"],
                 "unrecognized arguments: --frobnicate 2 (see 'tadm eval gen-ppl --help')", id="eval-unknown-flag"),
]


@pytest.mark.parametrize("argv, needle", CLI_CASES)
def test_cli_bad_input(argv: list[str], needle: str, bad: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([a.format(d=bad) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert code == 2 and len(lines) == 1, err
    assert needle.format(d=bad) in lines[0], lines[0]
    nested = argv[0] in ("eval", "posttrain", "tokenizer") and "invalid choice" not in needle  # an action was named
    command = " ".join(argv[:2] if nested else argv[:1])
    assert lines[0].startswith(f"tadm {command}: error: "), lines[0]


@pytest.mark.parametrize("argv", [["eval", "gen-ppl", "--texts", "nosuchcorpus"],
                                  ["tokenizer", "train", "--source", "nosuchcorpus", "--out", "{d}/t-hub"]])
def test_an_unknown_text_source_is_one_line(argv: list[str], bad: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that is neither a path nor a bundled corpus is tried as a Hub dataset; offline that fails in one line
    that says how to pass local text (whether or not the datasets package is installed)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main([a.replace("{d}", str(bad)) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nosuchcorpus'" in err[0] and "a bundled corpus ('brown')" in err[0], err


def test_user_files_survive_the_bad_inputs(bad: Path) -> None:
    assert (bad / "afile").read_text() == "user data"
    assert not (bad / "pwned").exists()


def test_train_on_a_locked_out_dir(bad: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tadm.training.rundir import RunDirLock

    (bad / "r-locked").mkdir(exist_ok=True)
    with RunDirLock(bad / "r-locked"):
        code = main(["train", str(bad / "tiny.yaml"), f"train.out_dir={bad / 'r-locked'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and f"'{bad / 'r-locked'}' is in use by another run (PID {os.getpid()}" in err


# ------------------------------------------------------------------------------------ Python API
def _api_cases() -> list[Any]:
    from tadm.config import ConfigError, load_config
    from tadm.nn import build_model, load_model
    from tadm.sampling import AdaptiveRefresh, generate, get_sampler
    from tadm.tasks.sandbox import CodeExecutionNotAllowed, run_program
    from tadm.specs import resolve_device, resolve_dtype
    from tadm.training.checkpoint import CorruptStateError, UnsafeStateError, load_training_state
    from tadm.training.data import BlockSampler, build_packed_dataset, load_texts
    from tadm.training.ema import EMA
    from tadm.training.lr import WarmupSchedule
    from tadm.training.provenance import TokenizerMismatchError, check_provenance
    from tadm.training.tokenization import TextTokenizer, train_bpe_tokenizer

    def packed(d: Path, **kw: Any) -> Any:
        return build_packed_dataset(FIXTURE, TextTokenizer.load(d / "tok"), cache_dir=d / "cache", **kw)

    return [
        pytest.param(lambda d: load_config(None, ["optim.lr=nan"]), ConfigError, "got nan", id="api-config-lr-nan"),
        pytest.param(lambda d: load_config(None, ["optim.weight_decay=-inf"]), ConfigError, "got -inf",
                     id="api-config-weight-decay"),
        pytest.param(lambda d: load_config("tadm-hugee"), FileNotFoundError, "'tadm-hugee'", id="api-unknown-preset"),
        pytest.param(lambda d: load_config(d / "broken.yaml"), ConfigError, "line 3, column 1", id="api-yaml-syntax"),
        pytest.param(lambda d: load_texts(d / "missing.jsonl"), FileNotFoundError, "missing.jsonl",
                     id="api-missing-corpus"),
        pytest.param(lambda d: list(load_texts(d / "bad.jsonl")), ValueError, "bad.jsonl:2: not valid UTF-8",
                     id="api-corpus-not-utf8"),
        pytest.param(lambda d: load_texts("brown", split="test"), ValueError, "split='test'", id="api-split"),
        pytest.param(lambda d: packed(d, seq_len=2), ValueError, "seq_len=2", id="api-pack-seq-len"),
        pytest.param(lambda d: packed(d, seq_len=8, val_fraction=1.0), ValueError, "val_fraction=1.0",
                     id="api-pack-val-fraction"),
        pytest.param(lambda d: train_bpe_tokenizer("one string"), TypeError, "not a single string", id="api-bpe-str"),
        pytest.param(lambda d: train_bpe_tokenizer(["x"], vocab_size=100), ValueError, "vocab_size=100",
                     id="api-bpe-vocab"),
        pytest.param(lambda d: TextTokenizer.load(d / "ckpt"), FileNotFoundError, "ckpt lacks tokenizer.json",
                     id="api-not-a-tokenizer"),
        pytest.param(lambda d: load_training_state(d / "r-trunc" / "training_state.pt"), CorruptStateError,
                     "truncated or corrupt", id="api-truncated-state"),
        pytest.param(lambda d: load_training_state(d / "payload.pt"), UnsafeStateError, "'posix.system'",
                     id="api-state-with-payload"),
        pytest.param(lambda d: BlockSampler(1, 4), ValueError, "num_blocks=1", id="api-sampler-blocks"),
        pytest.param(lambda d: BlockSampler(10, 4, rank=3, world_size=2), ValueError, "rank=3", id="api-sampler-rank"),
        pytest.param(lambda d: get_sampler("ddim", 0), ValueError, "'ddim'", id="api-unknown-sampler"),
        pytest.param(lambda d: get_sampler("mdlm", 0, top_p=float("nan")), ValueError, "got nan", id="api-top-p-nan"),
        pytest.param(lambda d: build_model("tadm-huge"), ValueError, "'tadm-huge'", id="api-unknown-model"),
        pytest.param(lambda d: resolve_device("tpu"), ValueError, "'tpu'", id="api-unknown-device"),
        pytest.param(lambda d: resolve_dtype("fp8"), ValueError, "'fp8'", id="api-unknown-dtype"),
        pytest.param(lambda d: WarmupSchedule(1, 5, schedule="linear"), ValueError, "'linear'", id="api-lr-schedule"),
        pytest.param(lambda d: EMA(torch.nn.Linear(1, 1), decay=float("nan")), ValueError, "got nan", id="api-ema-nan"),
        pytest.param(lambda d: check_provenance(d / "tok", d / "bad.jsonl", 300), TokenizerMismatchError,
                     "no record of what it was trained on", id="api-tokenizer-without-provenance"),
        pytest.param(lambda d: load_model(d / "trunc"), ValueError, "model.safetensors", id="api-truncated-weights"),
        pytest.param(lambda d: load_model(None), TypeError, "load_model needs a checkpoint directory or a Hub id",
                     id="api-load-model-none"),
        pytest.param(lambda d: generate(None, get_sampler("mdlm", 1), batch_size=1, seq_len=4, num_steps=2), TypeError,
                     "model must be a CacheableDenoiser", id="api-generate-model-none"),
        pytest.param(lambda d: AdaptiveRefresh(tau=1.5), ValueError, "tau 1.5 > 1 never refreshes",
                     id="api-adaptive-tau-above-1"),
        pytest.param(lambda d: run_program("print(1)"), CodeExecutionNotAllowed, "--allow-code-execution",
                     id="api-code-without-opt-in"),
    ]


@pytest.mark.parametrize("call, error, needle", _api_cases())
def test_api_bad_input(call: Callable[[Path], Any], error: type[BaseException], needle: str, bad: Path) -> None:
    with pytest.raises(error) as caught:
        call(bad)
    assert needle in str(caught.value)


# ------------------------------------------------------------------------------------- --debug
@pytest.mark.parametrize("how", ["flag-first", "flag-last", "environment"])
def test_debug_shows_the_traceback(how: str, bad: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["train", str(bad / "tiny.yaml"), "optim.lr=nan"]
    if how == "environment":
        monkeypatch.setenv("TADM_DEBUG", "1")
    argv = ["--debug", *argv] if how == "flag-first" else argv + ["--debug"] if how == "flag-last" else argv
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.strip().endswith("ConfigError: optim.lr must be a finite number > 0, got nan")
    monkeypatch.setenv("TADM_DEBUG", "0")
    assert main(argv[:3] if how != "flag-first" else argv[1:]) == 2
    assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------------------- more front doors
def test_out_of_memory_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tadm.cli import sample

    def allocate(args: Any) -> int:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 1638400000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(sample, "run", allocate)
    code = main(["sample", "-B", "200000"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert err == ("tadm sample: error: out of memory (an allocation of 1638400000 bytes failed); use a smaller batch "
                   "(-B/--batch-size), shorter sequences, or another --device")


def test_study_on_a_locked_out_dir(bad: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tadm.training.rundir import RunDirLock

    out = bad / "study-locked"
    out.mkdir(exist_ok=True)
    with RunDirLock(out):
        code = main(["study", "study-tiny", f"out_dir={out}", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert f"study out_dir '{out}' is in use by another run (PID {os.getpid()}" in err


def test_overrides_may_follow_the_flags() -> None:
    from tadm.cli import _parse, build_parser

    args = _parse(build_parser(), ["study", "study-tiny", "--no-progress", "out_dir=x", "seeds=[1]"])
    assert args.overrides == ["out_dir=x", "seeds=[1]"] and args.no_progress
    with pytest.raises(SystemExit):
        _parse(build_parser(), ["study", "study-tiny", "--no-progress", "--bogus"])


def _laptop_task() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("laptop_task_bad", LAPTOP_TASK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAPTOP_CASES = [
    pytest.param(["--digits", "-1"], "argument --digits: must be >= 1, got -1", id="laptop-digits-negative"),
    pytest.param(["--digits", "0"], "argument --digits: must be >= 1, got 0", id="laptop-digits-zero"),
    pytest.param(["--threads", "0"], "argument --threads: must be >= 1, got 0", id="laptop-threads-zero"),
    pytest.param(["--out", "{d}/afile"], "argument --out: {d}/afile is an existing file", id="laptop-out-is-a-file"),
    pytest.param(["--seeds", "abc"], "argument --seeds: expected comma-separated integers, got 'abc'",
                 id="laptop-seeds-abc"),
    pytest.param(["--refresh", "0"], "argument --refresh: expected integers >= 1, got '0'", id="laptop-refresh-zero"),
    pytest.param(["--canvas-length", "0"], "argument --canvas-length: must be >= 1, got 0", id="laptop-canvas-zero"),
    pytest.param(["--canvas-length", "4"], "argument --canvas-length: an answer of 2-digit operands needs 5 tokens",
                 id="laptop-canvas-too-short"),
    pytest.param(["--digits", "1", "--eval-examples", "200"],
                 "argument --eval-examples: 1-digit operands give only 19 distinct totals", id="laptop-too-many-eval"),
    pytest.param(["--eval-examples", "0"], "argument --eval-examples: must be >= 1, got 0", id="laptop-eval-zero"),
    pytest.param(["--train-examples", "-5"], "argument --train-examples: must be >= 1, got -5",
                 id="laptop-train-negative"),
    pytest.param(["--posttrain-lr", "nan"], "argument --posttrain-lr: must be a finite number > 0, got 'nan'",
                 id="laptop-lr-nan"),
    pytest.param(["--posttrain-set", "fusion.rank=0"], "argument --posttrain-set: fusion.rank must be > 0, got 0",
                 id="laptop-posttrain-set"),
    pytest.param(["--posttrain-set", "rollout.mode=backward"], "rollout.mode 'backward' is unknown",
                 id="laptop-rollout-mode"),
    pytest.param(["--hidden", "63"], "argument --hidden: 63 must be divisible by --heads 2", id="laptop-hidden-heads"),
    pytest.param(["--judge", "gpt"], "argument --judge: none, local, local:PATH or local-free:PATH, got 'gpt'",
                 id="laptop-judge"),
]


@pytest.mark.parametrize("argv, needle", LAPTOP_CASES)
def test_laptop_task_bad_input(argv: list[str], needle: str, bad: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = _laptop_task()
    with pytest.raises(SystemExit) as stopped:
        module.parse_args([a.format(d=bad) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert stopped.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert needle.format(d=bad) in lines[0], lines[0]


LM_EVAL_CASES = [
    pytest.param("model=tadm-tiny,K=0", "K must be an integer >= 1, got 0", id="lm-eval-K-zero"),
    pytest.param("model=tadm-tiny,flavour=1", "unknown model_args flavour", id="lm-eval-unknown-key"),
    pytest.param("K=2", "give exactly one of model=", id="lm-eval-no-model"),
    pytest.param("model={d}/nomodel", "model '{d}/nomodel' is neither a checkpoint directory", id="lm-eval-missing-model"),
    pytest.param("base={d}/nobase", "base '{d}/nobase' does not exist", id="lm-eval-missing-base"),
    pytest.param("base={d}/ckpt,adapter={d}/noadapter", "adapter '{d}/noadapter' does not exist",
                 id="lm-eval-missing-adapter"),
    pytest.param("model=tadm-tiny,refresh_policy=adaptive,tau=nan", "tau (share of changed positions) must be a "
                 "finite number", id="lm-eval-tau-nan"),
    pytest.param("model=tadm-tiny,top_p=2", "top_p must be a finite number in (0, 1], got 2", id="lm-eval-top-p"),
    pytest.param("model=tadm-tiny,steps=0", "steps must be an integer >= 1, got 0", id="lm-eval-steps-zero"),
    pytest.param("model=tadm-tiny,dtype=banana", "unknown dtype 'banana'", id="lm-eval-dtype"),
    pytest.param("model=tadm-tiny,canvas_length=-3", "canvas_length must be an integer >= 1, got -3",
                 id="lm-eval-canvas"),
    pytest.param("model=tadm-tiny,max_gen_toks=0", "max_gen_toks must be an integer >= 1, got 0", id="lm-eval-budget"),
    pytest.param("model=tadm-tiny,seed=-1", "seed must be an integer >= 0", id="lm-eval-seed"),
    pytest.param("model=tadm-tiny,batch_size=0", "batch_size must be >= 1, got 0", id="lm-eval-batch"),
    pytest.param("model=tadm-tiny,sampler=ddim", "unknown sampler 'ddim'", id="lm-eval-sampler"),
    pytest.param("model=tadm-tiny,naive=true", "adapter, naive and split apply to a post-training base",
                 id="lm-eval-naive-own-model"),
    pytest.param("model=tadm-tiny,refresh_policy=adaptive,tau=1.5", "tau 1.5 > 1 never refreshes",
                 id="lm-eval-tau-above-1"),
    pytest.param("model=tadm-tiny,self_conditioning=maybe", "self_conditioning must be true or false",
                 id="lm-eval-bool"),
]


@pytest.mark.parametrize("model_args, needle", LM_EVAL_CASES)
def test_tadm_lm_eval_bad_model_args(model_args: str, needle: str, bad: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from tadm.tasks.lm_eval_cli import main as lm_eval_main

    code = lm_eval_main(["--model", "tadm", "--model_args", model_args.format(d=bad), "--tasks", "gsm8k"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "tadm-lm-eval" in line]
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and needle.format(d=bad) in lines[0], err
