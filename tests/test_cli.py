import json
import tomllib
import warnings
from pathlib import Path

import pytest

import tadm
from tadm import cli
from tadm.cli import build_parser, main
from tadm.nn import tadm_tiny
from tadm.training.tokenization import train_bpe_tokenizer

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "brown_slice.jsonl"


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_compute_json_reports_table2_layer_calls(capsys):
    code, out, _ = _run(capsys, "compute", "--shared-layers", "0", "--anchor-layers", "12", "--denoiser-layers", "6",
                        "--steps", "1024", "--refresh", "8", "--json")
    assert code == 0
    record = json.loads(out)
    assert record["layer_calls"] == 7680  # Table 2, TADM at T = 1024, K = 8
    assert record["baseline_layer_calls"] == 1024 * 18


def test_compute_table_normalised_to_mdlm(capsys):
    code, out, _ = _run(capsys, "compute", "--anchor-layers", "12", "--denoiser-layers", "6", "--steps", "2048",
                        "--refresh", "4", "--baseline-layers", "12", "--json")
    assert json.loads(out)["relative_to_baseline"] == pytest.approx(0.75)


def test_lists_of_T_and_seeds_take_commas_or_spaces_like_K(capsys):
    rows = []
    for steps, refresh in ((["128,256"], ["1,8"]), (["128", "256"], ["1", "8"]),
                           (["128", "-T", "256"], ["1", "-K", "8"])):
        _, out, _ = _run(capsys, "compute", "--anchor-layers", "12", "--denoiser-layers", "6", "-T", *steps,
                         "-K", *refresh, "--json")
        rows.append([(r["steps"], r["refresh"]) for r in json.loads(out)])
    # a repeated flag adds to its list (the first replaces the default)
    assert rows[0] == rows[1] == rows[2] == [(128, 1), (128, 8), (256, 1), (256, 8)]
    parser = build_parser()
    args = parser.parse_args(["eval", "staleness", "--model", "m", "-T", "32,128", "64"])
    assert args.steps == [32, 128, 64]
    args = parser.parse_args(["eval", "tasks", "--model", "m", "--seeds", "0,1", "3", "-T", "16"])
    assert (args.seeds, args.steps) == ([0, 1, 3], 16)
    assert parser.parse_args(["eval", "tasks", "--model", "m"]).seeds == [0, 1, 2]


@pytest.mark.slow
def test_sample_json_counts_layers(capsys):
    code, out, _ = _run(capsys, "sample", "--model", "tadm-tiny", "--steps", "8", "--refresh", "2", "--length", "16",
                        "--batch-size", "2", "--sampler", "remdm-cap", "--json")
    assert code == 0
    record = json.loads(out)
    assert len(record["token_ids"]) == 2 and len(record["token_ids"][0]) == 16
    # tadm-tiny: 2 anchor + 1 denoiser layers; T = 8, K = 2 -> 8 * 1 + 4 * 2
    assert record["layer_calls"]["total"] == 16
    assert record["refresh_steps"] == [8, 6, 4, 2]


@pytest.mark.slow
def test_sample_prints_each_sample_and_the_layer_calls(capsys):
    """Without --json: one block per sample (ids when the model has no tokenizer), then the compute line."""
    args = ("sample", "--model", "tadm-tiny", "--steps", "8", "--refresh", "2", "--length", "16", "--batch-size", "2",
            "--sampler", "remdm-cap", "--seed", "5")
    code, out, _ = _run(capsys, *args)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "--- sample 0 ---" and lines[2] == "--- sample 1 ---"
    _, record, _ = _run(capsys, *args, "--json")
    assert [[int(v) for v in lines[n].split()] for n in (1, 3)] == json.loads(record)["token_ids"]
    assert lines[4].startswith("layer calls: total=16 (shared=0, anchor=8, denoiser=8); anchor refreshes=4 (K=2); ")
    assert lines[4].endswith(" tokens/s")


@pytest.mark.slow
def test_sample_with_refresh_policies(capsys):
    base = ("sample", "--model", "tadm-tiny", "--steps", "16", "--length", "8", "--json")
    _, out, _ = _run(capsys, *base, "--refresh-policy", "schedule", "--refresh-steps", "16,9,3")
    record = json.loads(out)
    assert record["refresh_steps"] == [16, 9, 3] and record["refresh"] is None
    assert record["refresh_policy"] == {"policy": "schedule", "skip_unchanged": False, "steps": [16, 9, 3]}
    _, out, _ = _run(capsys, *base, "--refresh-policy", "adaptive", "--tau", "2", "--max-interval", "4")
    assert json.loads(out)["refresh_steps"] == [16, 12, 8, 4]  # tau > 1: only the interval bound refreshes


@pytest.mark.slow
def test_sample_from_checkpoint_is_reproducible(tmp_path, capsys):
    tadm_tiny().save_pretrained(tmp_path / "ckpt")
    args = ("sample", "--model", str(tmp_path / "ckpt"), "--steps", "6", "--length", "8", "--seed", "3", "--json")
    _, first, _ = _run(capsys, *args)
    _, second, _ = _run(capsys, *args)
    assert json.loads(first)["token_ids"] == json.loads(second)["token_ids"]


@pytest.mark.slow
def test_sample_decodes_with_the_checkpoints_tokenizer(tmp_path, capsys):
    """A checkpoint saved with its tokenizer: --json adds the texts (what `tadm eval gen-ppl --samples` scores)."""
    docs = [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines()]
    tokenizer = train_bpe_tokenizer(docs, vocab_size=300)
    tadm_tiny(vocab_size=tokenizer.vocab_size, mask_token_id=tokenizer.mask_id).save_pretrained(tmp_path / "ckpt")
    tokenizer.save(tmp_path / "ckpt")
    args = ("sample", "--model", str(tmp_path / "ckpt"), "--steps", "4", "--length", "12", "--batch-size", "2")
    code, out, _ = _run(capsys, *args, "--json")
    record = json.loads(out)
    assert code == 0 and len(record["texts"]) == 2
    assert record["texts"] == [tokenizer.decode(ids) for ids in record["token_ids"]]  # all of it, for Gen PPL
    _, text_out, _ = _run(capsys, *args)
    shown = [tokenizer.decode_until_eos(ids) for ids in record["token_ids"]]  # printed: to the end-of-text token
    assert text_out.startswith(f"--- sample 0 ---\n{shown[0]}\n--- sample 1 ---\n{shown[1]}\n")


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory):
    docs = [json.loads(line)["text"] for line in FIXTURE.read_text().splitlines()]
    tokenizer = train_bpe_tokenizer(docs, vocab_size=300)
    ckpt = tmp_path_factory.mktemp("cli") / "ckpt"
    tadm_tiny(vocab_size=tokenizer.vocab_size, mask_token_id=tokenizer.mask_id).save_pretrained(ckpt)
    tokenizer.save(ckpt)
    return ckpt, tokenizer


def test_sample_after_a_prompt_keeps_it_and_prints_the_text(checkpoint_with_tokenizer, capsys):
    ckpt, tokenizer = checkpoint_with_tokenizer
    args = ("sample", "--model", str(ckpt), "--steps", "4", "--length", "16", "--batch-size", "2", "-K", "2",
            "--prompt", "The jury said")
    code, out, _ = _run(capsys, *args, "--json")
    record = json.loads(out)
    prompt = [tokenizer.bos_id, *tokenizer.encode("The jury said")]
    assert code == 0 and record["prompt"] == "The jury said" and record["prompt_tokens"] == len(prompt)
    assert [row[:len(prompt)] for row in record["token_ids"]] == [prompt, prompt]
    _, text_out, _ = _run(capsys, *args)
    samples = text_out.split("--- sample 1 ---\n")
    assert samples[0].startswith("--- sample 0 ---\nThe jury said") and samples[1].startswith("The jury said")
    assert "<|endoftext|>" not in text_out


def test_sample_refuses_a_prompt_it_cannot_honour(checkpoint_with_tokenizer, capsys):
    ckpt, tokenizer = checkpoint_with_tokenizer
    code, _, err = _run(capsys, "sample", "--steps", "4", "--prompt", "hi")  # a builder: random weights, no tokenizer
    assert code == 2 and err.strip() == ("tadm sample: error: --prompt needs the model's tokenizer, and model "
                                         "'tadm-tiny' has none saved with it: pass --tokenizer DIR")
    n = len(tokenizer.encode("The jury said it"))
    code, _, err = _run(capsys, "sample", "--model", str(ckpt), "--length", str(n + 1), "--prompt", "The jury said it")
    assert code == 2 and err.strip() == (f"tadm sample: error: --prompt is {n} tokens, which with BOS leaves nothing to "
                                         f"generate in --length {n + 1}: shorten it or give a larger --length")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["sample", "--refresh", "0"], "argument -K/--refresh: anchor refresh interval K must be an integer >= 1, got 0"),
        (["sample", "--steps", "0"], "argument -T/--steps: must be >= 1, got 0"),
        (["sample", "--sampler", "ddim"], "unknown sampler 'ddim'"),
        (["sample", "--schedule", "sqrt"], "sqrt"),
        (["sample", "--length", "100000"], "--length 100000"),
        (["sample", "--top-p", "1.5"], "top_p must be a finite number in (0, 1], got 1.5"),
        (["sample", "--top-p", "0"], "top_p must be a finite number in (0, 1], got 0"),
        (["sample", "--model", "no/such/dir/here"], "no/such/dir/here"),
        (["sample", "--eta", "0.1"], "sampler 'mdlm' has no option(s) eta"),
        (["sample", "--sampler", "remdm-rescale", "--eta", "5"], "eta must be a finite number in [0, 1], got 5.0"),
        (["sample", "--sampler", "remdm-cap", "--eta", "nan"], "eta must be a finite number in [0, 1], got nan"),
        (["sample", "--device", "tpu"], "unknown device 'tpu'"),
        (["sample", "--batch-size", "0"], "argument --batch-size/-B: must be >= 1, got 0"),
        (["sample", "--tau", "0.1"], "--tau do(es) not apply to --refresh-policy fixed"),
        (["sample", "--refresh-policy", "adaptive"], "needs --tau"),
        (["sample", "--refresh-policy", "adaptive", "--tau", "nan"], "tau (share of changed positions) must be a finite number in [0, inf), got nan"),
        (["sample", "--refresh-policy", "adaptive", "--tau", "0.1", "-K", "4"], "-K/--refresh 4 and --refresh-policy adaptive name two policies; give one"),
        (["sample", "--refresh-policy", "schedule", "--refresh-steps", "8,x"], "--refresh-steps: expected comma-separated integers (e.g. 128,120,96,64), got '8,x'"),
        (["sample", "--refresh-policy", "schedule"], "needs --refresh-steps"),
        (["sample", "-K", "1,2"], "-K/--refresh: this command takes one refresh policy, got 1, 2"),
        (["sample", "--min-interval", "2"], "--min-interval do(es) not apply to --refresh-policy fixed"),
        (["eval", "throughput", "--model", "tadm-tiny", "-T", "4", "-K", "2,2"],
         "-K/--refresh: the same refresh policy is listed twice: 2, 2"),
    ],
)
def test_bad_input_gives_one_line_error(capsys, argv, needle):
    code, _, err = _run(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err


def test_compute_rejects_zero_refresh(capsys):
    code = main(["compute", "--anchor-layers", "12", "--denoiser-layers", "6", "--steps", "8", "--refresh", "0"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "tadm compute: error: argument -K/--refresh: anchor refresh interval K must be an integer >= 1, got 0 "
        "(see 'tadm compute --help')"
    ]


def test_version_prints_the_package_version_the_build_declares(capsys):
    code, out, _ = _run(capsys, "--version")
    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert code == 0
    assert out.strip() == f"tadm {declared}" == f"tadm {tadm.__version__}"


def test_compute_prints_an_aligned_table_for_any_analytic_policy(capsys):
    code, out, _ = _run(capsys, "compute", "--anchor-layers", "12", "--denoiser-layers", "6", "-T", "1024",
                        "-K", "1,8,schedule:steps=1024/512", "--baseline-layers", "12")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "layer split: shared=0 anchor=12 denoiser=6"
    assert [line.split() for line in lines[2:]] == [
        ["1024", "1", "18432", "12288", "1.50x"],  # Table 2: TADM at K = 1 costs 1.5 MDLMs
        ["1024", "8", "7680", "12288", "0.62x"],
        ["1024", "schedule-steps1024_512", "6168", "12288", "0.50x"],  # 2 anchor refreshes x 12 + 1024 x 6
    ]
    assert len({len(line) for line in lines[1:]}) == 1  # every row as wide as the header


def test_compute_refuses_a_policy_without_analytic_compute_in_one_line(capsys):
    code, out, err = _run(capsys, "compute", "--anchor-layers", "2", "--denoiser-layers", "2", "-T", "16",
                          "-K", "adaptive:tau=0.1")
    assert code == 2 and out == ""
    assert err.strip() == ("tadm compute: error: the compute of the refresh policy 'adaptive tau=0.1' depends on the "
                           "sampled canvases; only a counted generation gives it")


def test_tadm_warnings_are_one_line_and_others_keep_their_form(tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "small.txt"
    corpus.write_text("the cat sat on the mat\n" * 20)
    assert main(["tokenizer", "train", "--source", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "t")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"saved bpe-270 tokenizer to {tmp_path / 't'}: vocab_size 270")  # named by its real size
    assert err.splitlines() == ["tadm tokenizer train: warning: the corpus only supports 270 tokens (asked for 300); "
                                "use a larger corpus or a smaller min_frequency"]
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda *args: shown.append(args))
    printer = cli._warning_printer("x")
    printer(UserWarning("from elsewhere"), UserWarning, "/elsewhere/mod.py", 3)
    printer(DeprecationWarning("old"), DeprecationWarning, tadm.__file__, 4)
    assert [args[2:4] for args in shown] == [("/elsewhere/mod.py", 3), (tadm.__file__, 4)]
    assert capsys.readouterr().err == ""


def test_sample_without_a_model_says_it_samples_random_weights(capsys):
    code, out, err = _run(capsys, "sample", "--steps", "4", "--length", "8", "--json")
    assert code == 0 and json.loads(out)["model"] == "tadm-tiny"
    assert err.strip() == ("tadm sample: no --model given: sampling tadm-tiny with random weights (pass --model DIR "
                           "for a trained one)")
    code, _, err = _run(capsys, "sample", "--model", "tadm-tiny", "--steps", "4", "--length", "8", "--json")
    assert code == 0 and err == ""


def test_help_states_the_default_of_T(capsys):
    assert main(["sample", "--help"]) == 0
    assert "reverse steps T (default: 128)" in " ".join(capsys.readouterr().out.split())


def test_every_option_with_a_default_states_it():
    import argparse

    def helps(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from helps(child)

    for parser in helps(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS, []):
                text = " ".join(parser._get_formatter()._expand_help(action).split())
                assert "default" in text.lower(), (parser.prog, action.option_strings)


def test_help_states_a_zero_default_and_list_defaults(capsys):
    assert main(["eval", "sweep", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--seed SEED default: 0" in text and "(default: 1,2,4,8)" in text and "--top-p TOP_P default: 0.9" in text


def test_refresh_on_a_model_without_an_anchor_network():
    from tadm.cli.common import CLIError, check_refresh_applies
    from tadm.nn import build_model
    from tadm.sampling.refresh import parse_refresh

    mdlm, model = build_model("mdlm-tiny"), build_model("tadm-tiny")
    check_refresh_applies(mdlm, [parse_refresh(1)], "m")
    check_refresh_applies(mdlm, [parse_refresh("1:skip_unchanged=true")], "m")  # skipping does change what runs
    check_refresh_applies(model, [parse_refresh(4), parse_refresh("adaptive:tau=0.1")], "t")
    for spec in ("4", "adaptive:tau=0.1", "schedule:steps=8/4"):
        with pytest.raises(CLIError, match="model 'm' has no anchor network"):
            check_refresh_applies(mdlm, [parse_refresh(1), parse_refresh(spec)], "m")


# --------------------------------------------------------------------- under torchrun, and Ctrl-C at start-up
TORCHRUN_RANK_1 = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}


@pytest.mark.parametrize("argv, line", [
    (["train", "tadm-tiny", "train.bogus=1"], "tadm train: error: overrides: unknown key 'train.bogus'"),
    (["train", "tadm-tiny", "--bogus"], "tadm train: error: unrecognized arguments: --bogus"),
])
def test_under_torchrun_only_rank_0_prints_the_line_and_torchrun_reads_it(tmp_path, capsys, monkeypatch, argv, line):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))  # torchrun sets one per rank
    for name, value in TORCHRUN_RANK_1.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    assert capsys.readouterr().err == ""  # rank 1: silent
    # torchrun's summary of the failed rank shows the line, instead of a pointer to its documentation
    summary = ChildFailedError("tadm", {1: ProcessFailure(1, 4242, 2, str(error_file))}).format_msg()
    assert f"traceback : {line}" in summary and "To enable traceback" not in summary, summary
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(line), err


@pytest.mark.slow
def test_torchrun_with_a_bad_argument_prints_tadms_line_once(tmp_path):
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "tadm", "train", "tadm-tiny",
               "train.bogus=1", f"train.out_dir={tmp_path / 'run'}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode != 0  # torchrun reports the failure
    said = [line for line in run.stderr.splitlines() if line.startswith("tadm train: error:")]
    assert len(said) == 1 and "unknown key 'train.bogus'" in said[0], run.stderr
    # torchrun's own summary names it for both ranks
    assert run.stderr.count("traceback : tadm train: error: overrides: unknown key 'train.bogus'") == 2, run.stderr
    assert not (tmp_path / "run").exists()


# Sends this process a Ctrl-C when the first module of the named package starts to import.
_CTRL_C_DURING_IMPORT = """
import os, signal, sys

PACKAGE = sys.argv[1]

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == PACKAGE:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["tadm", *sys.argv[2:]]
from tadm.cli import main  # as the console script does
sys.exit(main())
"""


@pytest.mark.parametrize("rank, said", [("0", ["tadm: interrupted"]), ("1", [])])
def test_ctrl_c_while_the_cli_imports_torch_is_one_line(rank, said):
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _CTRL_C_DURING_IMPORT, "torch", "train", "tadm-tiny"],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RANK": rank, "OMP_NUM_THREADS": "1", "TADM_DEBUG": ""})
    assert run.returncode == 130 and run.stderr.splitlines() == said, run.stderr
    assert run.stdout == ""


def test_ctrl_c_while_the_parser_is_built_is_one_line(capsys, monkeypatch):
    import os
    import signal

    real_build = cli.build_parser

    def build_then_ctrl_c():
        parser = real_build()
        os.kill(os.getpid(), signal.SIGINT)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_then_ctrl_c)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["compute", "--anchor-layers", "12"]) == 130
    assert capsys.readouterr().err.splitlines() == ["tadm: interrupted"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back for the command and for pytest
