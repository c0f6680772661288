"""tadm.specs: one way to name a model, a tokenizer, a device and a dtype."""

import pytest
import torch

from tadm.nn import TADM, build_model
from tadm.specs import find_tokenizer, find_tokenizer_dir, resolve_device, resolve_dtype, resolve_model
from tests.eval.test_evaluator import tiny_tokenizer


def test_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'; valid: auto, cpu, cuda, cuda:N"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="unknown device 'cuda:x'"):
        resolve_device("cuda:x")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_dtypes_share_one_vocabulary_with_long_aliases():
    for short, long, dtype in (("fp32", "float32", torch.float32), ("bf16", "bfloat16", torch.bfloat16),
                               ("fp16", "float16", torch.float16)):
        assert resolve_dtype(short) is dtype and resolve_dtype(long) is dtype and resolve_dtype(short.upper()) is dtype
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; valid: auto, fp32, bf16, fp16"):
        resolve_dtype("fp8")


def test_one_resolver_for_builders_directories_and_errors(tmp_path):
    built = resolve_model("tadm-tiny")
    assert isinstance(built, TADM) and not built.training
    saved = build_model("tadm-tiny")
    saved.save_pretrained(tmp_path / "ckpt")
    loaded = resolve_model(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), loaded.state_dict().values()))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file; pass the checkpoint directory"):
        resolve_model(tmp_path / "file.txt")
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory, a Hub id.*builders: .*tadm-tiny"):
        resolve_model("./no/such/dir")
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory"):
        resolve_model("tadm-huge")


def test_tokenizer_is_found_in_or_beside_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    assert find_tokenizer_dir(run / "final") is None
    with pytest.raises(FileNotFoundError, match="no tokenizer found for model .*--tokenizer DIR"):
        find_tokenizer(run / "final")
    tiny_tokenizer().save(run / "tokenizer")  # tadm train's layout: OUT/tokenizer beside OUT/final
    assert find_tokenizer_dir(run / "final") == run / "tokenizer"
    assert find_tokenizer(run / "final").vocab_size == tiny_tokenizer().vocab_size
    assert find_tokenizer(None, run / "tokenizer").vocab_size == tiny_tokenizer().vocab_size
    with pytest.raises(FileNotFoundError, match="no such directory"):
        find_tokenizer(run / "final", tmp_path / "missing")


def test_training_devices_use_the_same_names():
    """The recipes' device resolution is tadm.specs' plus the process's local rank under torchrun."""
    from tadm.training.distributed import resolve_device as training_device

    assert training_device("cpu", local_rank=3) == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'; valid: auto, cpu, cuda, cuda:N"):
        training_device("tpu")
    if not torch.cuda.is_available():
        assert training_device("auto", local_rank=1) == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            training_device("cuda", local_rank=1)


@pytest.mark.parametrize("builder", ["tadm-tiny", "mdlm-tiny", "ar-tiny"])
def test_a_builder_name_is_sized_to_the_tokenizer_given(builder, tmp_path):
    from tadm.specs import load_model_and_tokenizer

    tiny_tokenizer().save(tmp_path / "tok")
    model, tok = load_model_and_tokenizer(builder, tmp_path / "tok")
    assert model.vocab_size == tok.vocab_size != build_model(builder).vocab_size
    if model.mask_token_id is not None:
        assert model.mask_token_id == tok.mask_id
    with pytest.raises(FileNotFoundError):
        load_model_and_tokenizer(builder)  # random weights need a tokenizer to be sized to
