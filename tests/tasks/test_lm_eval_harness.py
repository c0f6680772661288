"""lm-eval end to end, offline: a tiny generation task from a local JSONL file, run through the harness."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

ROWS = [
    {"question": "hello how are you", "answer": "fine"},
    {"question": "what is it", "answer": "a dog"},
    {"question": "the cat", "answer": "sat"},
]


@pytest.fixture
def task_dir(tmp_path):
    """A task folder: ``tiny_echo.yaml`` over ``data.jsonl`` (lm-eval's ``dataset_path: json``)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (tmp_path / "tiny_echo.yaml").write_text(f"""\
task: tadm_tiny_echo
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {tmp_path / "hf-cache"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["mat"]
  max_gen_toks: 12
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return tmp_path


@pytest.mark.slow
def test_simple_evaluate_runs_the_tadm_model(task_dir, base_dir, adapter_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tadm.tasks import register_lm_eval_model

    register_lm_eval_model()
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model="tadm", model_args={"base": str(base_dir), "adapter": str(adapter_dir), "K": 2, "steps": 3},
        tasks=["tadm_tiny_echo"], task_manager=manager, batch_size=2, log_samples=True)
    metrics = results["results"]["tadm_tiny_echo"]
    assert metrics["sample_len"] == 3 and 0.0 <= metrics["exact_match,none"] <= 1.0
    samples = results["samples"]["tadm_tiny_echo"]
    responses = [s["resps"][0][0] for s in samples]
    assert len(responses) == 3 and all("mat" not in r for r in responses)  # stop string honoured


@pytest.mark.slow
def test_command_line_wrapper_writes_results(task_dir, base_dir, tmp_path, capsys):
    from tadm.tasks.lm_eval_cli import main

    out = tmp_path / "results"
    assert main(["--model", "tadm", "--model_args", f"base={base_dir},split=1:3,steps=2,seed=1,K=2", "--tasks",
                 str(task_dir / "tiny_echo.yaml"), "--batch_size", "3", "--output_path", str(out),
                 "--log_samples"]) == 0  # no --device: lm-eval's default is cuda:0
    printed = capsys.readouterr().out
    assert "tadm_tiny_echo" in printed
    written = sorted(p.name.split("_")[0] for p in out.rglob("*.jsonl")) + [p.name for p in out.rglob("results_*.json")]
    assert written[0] == "samples" and written[-1].startswith("results_")
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    used = "cuda" if torch.cuda.is_available() else "cpu"
    assert results["config"]["device"] == used  # the device the model ran on, not lm-eval's cuda:0 default
    # after lm-eval's table, what generation cost: one batch of 3 prompts, 12 tokens = 2 canvases of 8, T = 2 each
    table = printed[printed.index(f"tadm model on {used}: what generation cost"):].splitlines()
    assert table[1].startswith("|refresh|requests|generated tokens|seconds|tokens/s|layer calls|")
    row = table[3].split("|")
    assert row[1:3] == ["K=2", "3"] and float(row[5]) > 0
    assert row[8] == "4 / 6 / 8" and row[9] == "2"  # 4 passes of 1 shared + 2 denoiser layers, 2 refreshes of 3


@pytest.mark.slow
def test_a_run_mixing_generation_and_log_likelihood_tasks_on_a_base_is_refused_before_generating(
        task_dir, base_dir, capsys, monkeypatch):
    """A post-training base answers generation tasks only; tadm's own models answer both (their mixed run is
    tested with the log-likelihood estimator)."""
    from tadm.tasks.lm_eval_cli import main
    from tadm.tasks.lm_eval_model import TadmLM

    (task_dir / "tiny_mc.yaml").write_text((task_dir / "tiny_echo.yaml").read_text().replace(
        "tadm_tiny_echo", "tadm_tiny_mc").replace("output_type: generate_until", "output_type: multiple_choice\n"
                                                  "doc_to_choice: [fine, sat]").split("generation_kwargs")[0])
    monkeypatch.setattr(TadmLM, "generate_until", lambda *a, **k: pytest.fail("generated before refusing"))
    argv = ["--model", "tadm", "--model_args", f"base={base_dir},split=1:3,steps=2", "--tasks",
            f"{task_dir / 'tiny_echo.yaml'},{task_dir / 'tiny_mc.yaml'}", "--limit", "1"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "tadm-lm-eval: error: tadm model: task 'tadm_tiny_mc' (output_type multiple_choice) needs log-likelihoods, "
        "which a post-training base (base=...) does not compute (tadm's own models, model=..., do); only generation "
        "tasks (output_type generate_until) run on a base: nothing was generated, drop it from --tasks "
        "(traceback: TADM_DEBUG=1)")


@pytest.mark.parametrize("model_args", [["model=tadm-tiny,K=2,K=3"], ["model=tadm-tiny,K=2", "K=3"]])
def test_command_line_refuses_a_model_arg_given_twice(model_args, capsys):
    from tadm.tasks.lm_eval_cli import main

    assert main(["--model", "tadm", "--model_args", *model_args, "--tasks", "x"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after lm-eval's own warning
    assert last == "tadm-lm-eval: error: --model_args gives K more than once; give each key once"


@pytest.mark.parametrize("model_args, task, flags, message", [
    pytest.param("base=BASE,split=1:3", "tiny_ll", [],
                 "(output_type loglikelihood) needs log-likelihoods, which a post-training base (base=...) does not",
                 marks=pytest.mark.slow),  # lm-eval indexes its task registry: about 10 s
    pytest.param("model=MODEL", "tiny_echo", ["--apply_chat_template"], "its tokenizer has no chat template; run",
                 marks=pytest.mark.slow),
    pytest.param("model=tadm-tiny,tokenizer=MODEL", "tiny_echo", [], "tokenizer vocabulary (320) != model vocabulary",
                 marks=pytest.mark.slow),
])
def test_command_line_failures_of_a_run_are_one_line(task_dir, tadm_model_dir, base_dir, capsys, monkeypatch,
                                                     model_args, task, flags, message):
    from tadm.tasks.lm_eval_cli import main

    (task_dir / "tiny_ll.yaml").write_text((task_dir / "tiny_echo.yaml").read_text().replace(
        "tadm_tiny_echo", "tadm_tiny_ll").replace("generate_until", "loglikelihood"))
    model_args = model_args.replace("MODEL", str(tadm_model_dir)).replace("BASE", str(base_dir))
    argv = ["--model", "tadm", "--model_args", model_args + ",steps=2",
            "--tasks", str(task_dir / f"{task}.yaml"), *flags, "--limit", "1", "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    # said once, in the last line: no traceback ending in "ValueError: <message>"
    assert lines[-1].startswith("tadm-lm-eval: error: ") and [line for line in lines if message in line] == lines[-1:]
    monkeypatch.setenv("TADM_DEBUG", "1")  # the developer's traceback
    with pytest.raises((NotImplementedError, ValueError)):
        main(argv)


def test_command_line_checks_a_refresh_schedule_against_the_steps_first(capsys):
    from tadm.tasks.lm_eval_cli import main

    argv = ["--model", "tadm", "--model_args", "model=tadm-tiny,K=schedule:steps=16/4,steps=8", "--tasks", "x"]
    assert main(argv) == 2  # refused before lm-eval loads anything
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "tadm-lm-eval: error: tadm model: the refresh schedule must list the first step, i = T = 8 (the anchor is "
        "computed there), got steps 16/4")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["truncated", "pickle-renamed", "bin-only"])
def test_command_line_names_damaged_adapter_weights_in_one_line(task_dir, base_dir, adapter_dir, tmp_path, capsys,
                                                                 case):
    import shutil

    from tadm.tasks.lm_eval_cli import main
    from tests.posttrain.test_adapter_io import WEIGHTS_CASES, plant_weights

    damaged = tmp_path / "adapter"
    shutil.copytree(adapter_dir, damaged)
    marker = tmp_path / "payload-ran"
    weights = plant_weights(damaged, case, marker)
    argv = ["--model", "tadm", "--model_args", f"base={base_dir},adapter={damaged},steps=2", "--tasks",
            str(task_dir / "tiny_echo.yaml"), "--limit", "1", "--device", "cpu"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # said once, in the last line: no traceback ending in "ValueError: <message>"
    assert lines[-1].startswith("tadm-lm-eval: error: ") and WEIGHTS_CASES[case] in lines[-1], lines
    assert [line for line in lines if str(weights) in line] == lines[-1:]
    assert not marker.exists()  # nothing was unpickled
