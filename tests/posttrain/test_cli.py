"""``tadm posttrain train`` and ``tadm posttrain sample`` on a tiny base model saved to disk."""

import json

import pytest

from tadm.config import PRESET_DIR

from tadm.cli import main
from tadm.posttrain.adapter_io import ADAPTER_WEIGHTS_NAME
from tadm.training.tokenization import train_bpe_tokenizer

from .conftest import build_tiny_gemma, tiny_chat_tokenizer

CONFIGS = PRESET_DIR


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("posttrain-cli")
    base = root / "base"
    build_tiny_gemma().save_pretrained(base)
    tiny_chat_tokenizer().save_pretrained(base)
    rows = [
        {"prompt": "hello how are you", "response": "fine thanks the cat sat on a mat"},
        {"prompt": "what is it", "response": "it is a dog"},
        {"prompt": "the cat", "response": "sat on a mat the dog ran far away"},
    ]
    (root / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


@pytest.mark.slow
def test_train_then_sample_with_the_adapter(base_dir, capsys):
    out = base_dir / "run"
    code = main([
        "posttrain", "train", str(CONFIGS / "posttrain-tiny.yaml"),
        f"base.path={base_dir / 'base'}", f"data.train_file={base_dir / 'chat.jsonl'}", f"train.out_dir={out}",
        "train.max_steps=2", "train.micro_batch_size=2", "train.save_every=1", "fusion.rank=8", "rollout.sampler.num_steps=6",
        "data.canvases_per_example=1",
    ])
    assert code == 0
    adapter = out / "adapter"
    assert (adapter / ADAPTER_WEIGHTS_NAME).is_file() and (adapter / "training_state.pt").is_file()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model"] == str(base_dir / "base") and config["extra"]["step"] == 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1  # step 1 (log_every = 20)
    capsys.readouterr()

    argv = ["posttrain", "sample", "--base", str(base_dir / "base"), "--adapter", str(adapter), "--prompt", "hello",
            "--prompt", "what is it", "-K", "2", "--steps", "4", "--max-new-tokens", "8", "--json"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["texts"]) == 2 and len(record["token_ids"][0]) == 8
    calls = record["layer_calls"]
    assert (calls["shared"], calls["anchor"], calls["denoiser"], calls["anchor_refreshes"]) == (4, 6, 8, 2)  # one canvas, T = 4, K = 2
    # Same seed, same output; the naive baseline runs too.
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["token_ids"] == record["token_ids"]
    assert main(argv + ["--naive"]) == 0
    assert json.loads(capsys.readouterr().out)["fusion_mode"] == "naive"


def test_sample_without_adapter_and_user_errors(base_dir, capsys):
    argv = ["posttrain", "sample", "--base", str(base_dir / "base"), "--prompt", "the cat", "--split", "1,3",
            "--steps", "3", "--max-new-tokens", "8"]
    assert main(argv) == 0
    assert "layer calls: total=18 (shared=" in capsys.readouterr().out
    assert main(argv[:-6] + ["--split", "1,9"]) == 2
    assert "exceeds the backbone's 6 layers" in capsys.readouterr().err
    # the default split (the paper's 2,20) does not fit a 6-layer base: the message names --split
    assert main(argv[:5] + argv[7:]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "2 + 20 = 22 exceeds the backbone's 6 layers" in err[-1] and err[-1].endswith(
        ": without --adapter the split is --split SHARED,ANCHOR (default 2,20, the paper's for 30 layers); give one "
        "that fits this base")
    # contradicting refresh policies, and a tokenizer without a chat template
    assert main(argv + ["-K", "adaptive:tau=0.3", "--refresh-policy", "fixed"]) == 2
    assert "and --refresh-policy fixed name two policies" in capsys.readouterr().err
    plain = base_dir / "plain-tokenizer"
    train_bpe_tokenizer(["the cat sat on the mat"] * 20, vocab_size=270).save(plain)
    assert main(argv + ["--tokenizer", str(plain)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"tadm posttrain sample: error: the tokenizer of {plain} has no chat template: pass --raw to encode prompts "
        "as plain text, or --tokenizer DIR with a chat tokenizer")
    assert main(["posttrain", "sample", "--base", str(base_dir / "base")]) == 2
    assert "--prompt" in capsys.readouterr().err
    assert main(["posttrain", "train", str(CONFIGS / "posttrain-tiny.yaml"), "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err


def test_prompts_come_from_flags_then_from_a_prompt_file(base_dir, capsys):
    prompts = base_dir / "prompts.txt"
    prompts.write_text("what is it\n\n  \nthe dog\n")  # blank lines are skipped
    argv = ["posttrain", "sample", "--base", str(base_dir / "base"), "--prompt", "the cat",
            "--prompt-file", str(prompts), "--split", "1,3", "--steps", "2", "--max-new-tokens", "4", "--json"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompts"] == ["the cat", "what is it", "the dog"] and len(record["texts"]) == 3
    (base_dir / "blank.txt").write_text("\n  \n")
    (base_dir / "binary.txt").write_bytes(b"\xff\xfe\x00")
    for name, message in (("missing.txt", "missing.txt: no such file"), (".", " is a directory; give a file"),
                          ("blank.txt", "blank.txt has no prompt: give one prompt per line"),
                          ("binary.txt", "binary.txt is not UTF-8 text (byte 0xff at offset 0)")):
        assert main(argv[:6] + ["--prompt-file", str(base_dir / name)]) == 2
        assert capsys.readouterr().err.strip().endswith(message), name


@pytest.mark.parametrize("action", ["sample", "train"])
def test_a_base_without_a_tokenizer_is_one_line_naming_it(tmp_path, capsys, action):
    """Used to sample with transformers' empty 5-token tokenizer: prompts encoded to nothing, replies decoded to ''."""
    base = tmp_path / "base"
    build_tiny_gemma().save_pretrained(base)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "hello", "response": "fine"}) + "\n")
    if action == "sample":
        argv = ["posttrain", "sample", "--base", str(base), "--split", "1,3", "--raw", "--prompt", "hello",
                "--steps", "2", "--max-new-tokens", "8"]
        hint = "pass --tokenizer DIR"
    else:
        argv = ["posttrain", "train", "posttrain-tiny", f"base.path={base}", f"data.train_file={tmp_path / 'chat.jsonl'}",
                f"train.out_dir={tmp_path / 'run'}", "split.shared_layers=1", "split.anchor_layers=3",
                "split.denoiser_layers=2", "fusion.rank=8"]
        hint = "set data.tokenizer=DIR"
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tadm ")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert f"'{base}' is a model directory without a tokenizer" in lines[0] and hint in lines[0], lines[0]


@pytest.mark.parametrize("action", ["sample", "train", "train-pad-id"])
def test_a_tokenizer_larger_than_the_base_vocabulary_is_one_line(base_dir, tmp_path, capsys, action):
    """Used to end in an IndexError traceback from the embedding lookup."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tadm.posttrain.data import make_chat_tokenizer

    words = ["[UNK]"] + [f"w{i}" for i in range(300)] + "hello how are you fine thanks the cat sat on a mat".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big = tmp_path / "bigtok"
    make_chat_tokenizer(backend).save_pretrained(big)
    if action == "sample":
        argv = ["posttrain", "sample", "--base", str(base_dir / "base"), "--split", "1,3", "--tokenizer", str(big),
                "--prompt", "hello how are you", "--steps", "2", "--max-new-tokens", "8"]
    else:
        argv = ["posttrain", "train", "posttrain-tiny", f"base.path={base_dir / 'base'}", f"data.tokenizer={big}",
                f"data.train_file={base_dir / 'chat.jsonl'}", f"train.out_dir={tmp_path / 'run'}",
                "split.shared_layers=1", "split.anchor_layers=3", "split.denoiser_layers=2", "fusion.rank=8"]
    expected = f"tokenizer '{big}' has ids up to {len(words) + 3} but the base's vocabulary is 128"
    if action == "train-pad-id":  # an id the tokenizer has, the base has not
        argv += ["data.pad_id=200"]
        expected = "data.pad_id 200 is not a token id of the base's vocabulary (0..127)"
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tadm ")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert expected in lines[0], lines[0]
