"""scripts/laptop_task.py: the addition data is deterministic and its held-out problems never appear in training."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tadm.tasks.benchmarks import get_benchmark
from tadm.tasks.datasets import load_task

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "laptop_task.py"


@pytest.fixture(scope="module")
def laptop_task():
    spec = importlib.util.spec_from_file_location("laptop_task", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pairs(rows):
    return {tuple(int(x) for x in r["problem"][len("What is "):-1].split("+")) for r in rows}


def test_addition_data_is_deterministic_and_held_out_is_disjoint(laptop_task):
    train, held = laptop_task.make_addition_data(2, 3000, 200, seed=0)
    assert (train, held) == laptop_task.make_addition_data(2, 3000, 200, seed=0)
    assert held != laptop_task.make_addition_data(2, 3000, 200, seed=1)[1]
    assert len(train) == 3000 and len(held) == len(_pairs(held)) == 200
    held_pairs = _pairs(held)
    assert not _pairs(train) & (held_pairs | {(b, a) for a, b in held_pairs})
    for row in train[:50] + held:
        a, b = next(iter(_pairs([row])))
        assert row["answer"] == str(a + b) and 0 <= a < 100 and 0 <= b < 100
    with pytest.raises(ValueError, match="too many"):
        laptop_task.make_addition_data(1, 10, 30, seed=0)


def test_held_out_file_is_the_addition_task(laptop_task, tmp_path):
    _, held = laptop_task.make_addition_data(3, 10, 5, seed=0)
    laptop_task.write_jsonl(tmp_path / "addition.jsonl", held)
    data = load_task(get_benchmark("addition"), tmp_path)
    assert [e.answer for e in data.examples] == [r["answer"] for r in held] and data.shots == []
    assert laptop_task.chat_prompt("What is 1+2?") == "Give only the sum.\n\nQuestion: What is 1+2?\nAnswer:"


def test_digit_tokenizer_keeps_digits_apart(laptop_task):
    from tadm.posttrain.data import make_chat_tokenizer

    texts = [laptop_task.chat_prompt(f"What is {a}+{a + 11}?") + f" {2 * a + 11}" for a in range(10, 99)] * 5
    tokenizer = make_chat_tokenizer(laptop_task.digit_bpe(texts, vocab_size=300))
    ids = tokenizer("What is 47+385?", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == "What is 47+385?"
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["4", "7", "3", "8", "5"]


def test_split_data_is_deterministic_and_answers_add_up(laptop_task, tmp_path):
    train, held = laptop_task.make_task_data("split", 2, 2000, 50, seed=0)
    assert (train, held) == laptop_task.make_split_data(2, 2000, 50, seed=0)
    assert held != laptop_task.make_split_data(2, 2000, 50, seed=1)[1]
    for row in train:
        total = int(row["problem"].split()[1])
        a, b = (int(x) for x in row["answer"].split("+"))
        assert row["problem"] == f"Write {total} as a sum of two numbers." and a + b == total and 0 <= a < 100 > b >= 0
    assert len({row["answer"] for row in train if row["problem"] == train[0]["problem"]}) > 1  # many answers
    laptop_task.write_jsonl(tmp_path / "split.jsonl", held)
    data = load_task(get_benchmark("split"), tmp_path)
    assert [e.answer for e in data.examples] == [r["problem"].split()[1] for r in held]
    assert all(0 <= int(e.answer) <= 198 for e in data.examples)
    assert laptop_task.parse_args([]).out == "runs/laptop-task-split"
    assert laptop_task.parse_args(["--task", "addition"]).out == "runs/laptop-task"
    split, addition = laptop_task.parse_args([]), laptop_task.parse_args(["--task", "addition"])
    assert (split.digits, split.pretrain_steps, split.posttrain_steps, split.eval_examples) == (2, 9000, 9600, 199)
    assert (addition.digits, addition.pretrain_steps, addition.posttrain_steps) == (2, 3000, 600)
    assert laptop_task.parse_args(["--digits", "2"]).digits == 2
    assert laptop_task.parse_args(["--seed", "3"]).model_seed == 3  # the model follows the data seed...
    assert laptop_task.parse_args(["--seed", "3", "--model-seed", "1"]).model_seed == 1  # ...unless given


@pytest.mark.parametrize("digits", [1, 2])
def test_split_held_out_prompts_are_distinct(laptop_task, digits):
    totals = laptop_task.split_totals(digits)
    assert totals == 2 * 10 ** digits - 1
    for seed in range(3):
        _, held = laptop_task.make_split_data(digits, 10, totals, seed=seed)
        prompts = [row["problem"] for row in held]
        assert len(prompts) == len(set(prompts)) == totals  # every total exactly once
        assert sorted(int(row["answer"]) for row in held) == list(range(totals))
    _, few = laptop_task.make_split_data(digits, 10, 7, seed=0)
    assert len({row["problem"] for row in few}) == 7
    with pytest.raises(ValueError, match=f"only {totals} distinct totals"):
        laptop_task.make_split_data(digits, 10, totals + 1, seed=0)


def test_a_judge_without_a_model_is_refused_before_any_training(laptop_task, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TADM_CACHE_DIR", str(tmp_path / "cache"))  # no prepared default judge there
    for judge, advice in ((f"local:{tmp_path / 'nothing'}", "give a Hugging Face model folder"),
                          ("local", "run `tadm eval prepare-evaluator` first")):
        with pytest.raises(SystemExit) as exit_info:
            laptop_task.parse_args(["--judge", judge, "--out", str(tmp_path / "run")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "argument --judge:" in err and "holds no model (no config.json)" in err and advice in err
    assert not (tmp_path / "run").exists()


TINY = ["--digits", "1", "--train-examples", "300", "--eval-examples", "5", "--pretrain-steps", "3",
        "--pretrain-batch", "8", "--posttrain-steps", "2", "--posttrain-batch", "4", "--refresh", "1,2",
        "--seeds", "0", "--batch-size", "5", "--canvas-length", "4"]


def test_until_stops_a_rerun_after_its_stage(laptop_task, tmp_path):
    out = tmp_path / "run"
    for _ in range(2):  # the second run finds the data done and must still stop there
        laptop_task.main([*TINY, "--out", str(out), "--until", "data"])
        assert sorted(p.name for p in out.iterdir()) == ["args.json", "data", "timings.json"]


@pytest.mark.parametrize("until", ["data", "tokenizer", "pretrain", "posttrain", "diagnose", "eval"])
def test_until_stops_after_a_stage_that_had_nothing_to_do(laptop_task, tmp_path, monkeypatch, until):
    import transformers

    ran = []
    for stage in laptop_task.STAGES:
        monkeypatch.setattr(laptop_task, f"stage_{stage}", lambda *a, stage=stage: ran.append(stage))
    monkeypatch.setattr(laptop_task, "read_jsonl", lambda path: [])
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)
    laptop_task.main([*TINY, "--refresh", "1", "--out", str(tmp_path / "run"), "--until", until])
    assert ran == list(laptop_task.STAGES[: laptop_task.STAGES.index(until) + 1])


def test_default_held_out_count_fits_the_digits(laptop_task):
    assert laptop_task.parse_args(["--digits", "1"]).eval_examples == 19  # every distinct total
    assert laptop_task.parse_args(["--digits", "3"]).eval_examples == 199
    assert laptop_task.parse_args(["--task", "addition", "--digits", "1"]).eval_examples == 25
    assert laptop_task.parse_args(["--task", "addition"]).eval_examples == 200
    assert laptop_task.parse_args(["--digits", "1", "--eval-examples", "7"]).eval_examples == 7
    with pytest.raises(SystemExit):
        laptop_task.parse_args(["--digits", "1", "--eval-examples", "20"])


def test_a_rerun_may_not_change_the_settings_of_stages_already_done(laptop_task, tmp_path, capsys):
    out = tmp_path / "run"
    laptop_task.main([*TINY, "--out", str(out), "--until", "data"])
    laptop_task.parse_args([*TINY, "--out", str(out), "--until", "data"])  # the same command resumes
    # pretraining has not run yet: its settings may still change (and are recorded for it)
    laptop_task.main([*TINY, "--out", str(out), "--until", "data", "--hidden", "32"])
    assert laptop_task.json.loads((out / "args.json").read_text())["hidden"] == 32
    changed = [a if a not in ("1", "5") else {"1": "2", "5": "7"}[a] for a in TINY[:6]] + TINY[6:]
    with pytest.raises(SystemExit) as exit_info:
        laptop_task.parse_args([*changed, "--out", str(out), "--canvas-length", "6"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument --out:" in err
    assert "--digits 1 (now 2)" in err and "--eval-examples at most 5, the held-out problems on disk (now 7)" in err
    assert "--hidden" not in err
    (out / "base").mkdir()
    (out / "base" / "pretrain.json").write_text("{}")
    (out / "adapter").mkdir()
    (out / "adapter" / "posttrain.json").write_text("{}")
    (out / "kl.json").write_text("{}")
    with pytest.raises(SystemExit):
        laptop_task.parse_args([*TINY, "--out", str(out), "--hidden", "64"])
    assert "--hidden 32 (now 64)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        laptop_task.parse_args([*TINY, "--out", str(out), "--hidden", "32", "--posttrain-set", "fusion.rank=8"])
    assert "--posttrain-set none (now [\"fusion.rank=8\"])" in capsys.readouterr().err
    # evaluation-only changes resume: fewer held-out problems, other K and batch size, another judge folder
    laptop_task.parse_args([*TINY, "--out", str(out), "--hidden", "32", "--eval-examples", "3",
                            "--refresh", "1,2,3,4", "--batch-size", "2", "--eval-out", "eval-wide-k"])


def test_a_variant_keeps_its_own_arguments_and_timings(laptop_task, tmp_path, capsys):
    out = tmp_path / "run"
    laptop_task.main([*TINY, "--out", str(out), "--until", "data"])
    base_args, base_timings = (out / "args.json").read_text(), (out / "timings.json").read_text()
    laptop_task.main([*TINY, "--out", str(out), "--until", "data", "--variant", "v1", "--posttrain-steps", "3"])
    assert (out / "args.json").read_text() == base_args and (out / "timings.json").read_text() == base_timings
    variant = out / "variants" / "v1"
    assert laptop_task.json.loads((variant / "args.json").read_text())["posttrain_steps"] == 3
    (variant / "adapter").mkdir()
    (variant / "adapter" / "posttrain.json").write_text("{}")
    laptop_task.parse_args([*TINY, "--out", str(out), "--variant", "v2"])  # another variant: its own settings
    laptop_task.parse_args([*TINY, "--out", str(out)])  # the base has no adapter yet
    with pytest.raises(SystemExit):
        laptop_task.parse_args([*TINY, "--out", str(out), "--variant", "v1"])
    assert "--posttrain-steps 3 (now 2)" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the held-out split
HELD_OUT_RECORD = Path(__file__).resolve().parents[2] / "docs" / "results" / "posttrain-recovery-ablation-cpu" / \
    "held-out" / "split.jsonl"


def test_split_data_without_hold_out_is_unchanged_draw_for_draw(laptop_task):
    import hashlib
    import json

    train, held = laptop_task.make_split_data(2, 200_000, 199, seed=0)  # the published runs' data (seed 0)
    digest = hashlib.sha256(json.dumps([train, held]).encode()).hexdigest()
    assert digest == "617cd19b68bd3e615754f4e2db83aeb1d4100ae5992f35654de292a7afcfcf8d"
    assert (train, held) == laptop_task.make_task_data("split", 2, 200_000, 199, seed=0, hold_out=False)


def test_held_out_totals_are_half_of_them_spread_over_every_digit(laptop_task):
    held = laptop_task.split_held_out_totals(2)
    assert len(held) == len(set(held)) == 100 and held[:6] == [1, 3, 5, 7, 9, 10] and held[-1] == 198
    trained = sorted(set(range(199)) - set(held))
    assert len(trained) == 99 and trained[0] == 0 and trained[-1] == 197
    for place in (lambda t: t % 10, lambda t: t // 10 % 10):  # every digit in every place, in both sets
        assert {place(t) for t in trained} == {place(t) for t in held} == set(range(10))
    assert laptop_task.split_held_out_totals(1) == [1, 3, 5, 7, 9, 10, 12, 14, 16, 18]


def test_no_training_prompt_is_a_held_out_prompt(laptop_task, tmp_path):
    """The data stage exactly as the runs call it (200,000 problems, seed 0): pretraining and post-training read
    data/train.jsonl, and none of its prompts, as strings or as the chat prompt the model sees, is held out."""
    out = tmp_path / "run"
    laptop_task.main(["--hold-out", "--out", str(out), "--until", "data"])
    train = laptop_task.read_jsonl(out / "data" / "train.jsonl")
    held = laptop_task.read_jsonl(out / "data" / "held-out" / "split.jsonl")
    old = laptop_task.read_jsonl(out / "data" / "split.jsonl")
    assert len(train) == 200_000 and len(held) == len({r["problem"] for r in held}) == 100
    held_prompts = {r["problem"] for r in held}
    train_prompts = {r["problem"] for r in train}
    assert not train_prompts & held_prompts
    assert not {laptop_task.chat_prompt(p, "split") for p in train_prompts} & {
        laptop_task.chat_prompt(p, "split") for p in held_prompts}
    assert len(train_prompts) == 99 and train_prompts | held_prompts == {r["problem"] for r in old}
    for row in train:
        a, b = (int(x) for x in row["answer"].split("+"))
        assert a + b not in laptop_task.split_held_out_totals(2)
    # the old evaluation set (every total, in the published order) is unchanged
    assert old == laptop_task.make_split_data(2, 10, 199, seed=0)[1]
    # and the held-out prompts are the ones recorded beside the published results
    assert held == laptop_task.read_jsonl(HELD_OUT_RECORD)


def test_the_held_out_evaluation_reads_the_held_out_prompts(laptop_task, tmp_path):
    args = laptop_task.parse_args(["--hold-out", "--eval-set", "held-out", "--out", str(tmp_path / "r")])
    assert args.eval_out == "eval-held-out" and laptop_task.kl_name(args) == "kl-held-out.json"
    cfg = laptop_task.eval_config(args, Path(args.out))
    assert Path(cfg.data_dir) == tmp_path / "r" / "data" / "held-out" and cfg.limit is None
    args = laptop_task.parse_args(["--hold-out", "--eval-set", "held-out", "--variant", "v", "--out", str(tmp_path)])
    assert args.eval_out == "variants/v/eval-held-out"
    args = laptop_task.parse_args(["--hold-out", "--out", str(tmp_path / "r")])
    assert args.eval_out == "eval" and laptop_task.kl_name(args) == "kl.json"
    assert Path(laptop_task.eval_config(args, Path(args.out)).data_dir) == tmp_path / "r" / "data"


@pytest.mark.parametrize("argv, needle", [
    (["--task", "addition", "--hold-out"], "argument --hold-out: only the split task holds totals out"),
    (["--eval-set", "held-out"], "argument --eval-set: held-out needs --hold-out"),
])
def test_hold_out_arguments_that_cannot_work_are_refused(laptop_task, capsys, argv, needle):
    with pytest.raises(SystemExit):
        laptop_task.parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


def test_a_rerun_may_not_switch_hold_out_on_data_already_made(laptop_task, tmp_path, capsys):
    out = tmp_path / "run"
    laptop_task.main([*TINY, "--out", str(out), "--until", "data"])
    with pytest.raises(SystemExit):
        laptop_task.main([*TINY, "--out", str(out), "--until", "data", "--hold-out"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--hold-out False (now True)" in err


@pytest.mark.slow
def test_a_held_out_run_evaluates_both_prompt_sets(laptop_task, tmp_path):
    import json

    out = tmp_path / "run"
    common = [*TINY, "--hold-out", "--out", str(out), "--variant", "v"]
    laptop_task.main(common)
    laptop_task.main([*common, "--eval-set", "held-out"])
    own = out / "variants" / "v"
    held = {laptop_task.chat_prompt(r["problem"], "split")
            for r in laptop_task.read_jsonl(out / "data" / "held-out" / "split.jsonl")}
    units = sorted((own / "eval-held-out" / "units" / "split").glob("*.json"))
    assert units and all({r["prompt"] for r in json.loads(u.read_text())["records"]} == held for u in units)
    assert len(held) == 10 and (own / "kl.json").is_file() and (own / "kl-held-out.json").is_file()
    old = json.loads(next((own / "eval" / "units" / "split").glob("*.json")).read_text())["records"]
    assert len(old) == 5
    timings = json.loads((own / "timings.json").read_text())
    assert {"eval", "eval-held-out", "diagnose", "diagnose-held-out"} <= set(timings)
    for record in (out / "base" / "pretrain.json", own / "adapter" / "posttrain.json"):
        assert "commit" in json.loads(record.read_text())
    assert "kd_last" in json.loads((own / "adapter" / "posttrain.json").read_text())
