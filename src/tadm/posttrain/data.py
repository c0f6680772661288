"""SFT data for post-training: chat JSONL -> (context, canvas) pairs for a block-diffusion backbone.

Each JSONL record is one no-think exchange, either ``{"prompt": ..., "response": ...}`` or
``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``. Records marked as reasoning
("reasoning": "on" / "thinking": true) are skipped, as the paper keeps only no-think samples.

With the model's chat template, ``prompt_ids`` is the templated user turn plus the generation
prompt, and ``response_ids`` is what the template appends for the assistant turn (the reply and
its end-of-turn marker). The prompt keeps its last ``max_prompt_tokens`` ids (the generation prompt
is at the end), the response its first ``max_response_tokens``. The response is cut into canvases
of ``L`` tokens (paper: 8 canvases of 256 per example); canvas ``j`` is predicted from the context
``prompt + response[: j L]``, exactly the context block-wise generation has at that canvas. The last
canvas is filled up with the padding id, which ``generate`` writes after the end of a reply.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tokenizers import Tokenizer
from torch import Tensor

__all__ = ["CHAT_SPECIAL_TOKENS", "DEFAULT_CHAT_TEMPLATE", "CanvasBatch", "CanvasExample", "ChatCanvasDataset",
           "ChatExample", "ChatTokenizer", "check_token_ids", "collate_canvases", "encode_chat", "left_pad",
           "make_chat_tokenizer", "read_chat_jsonl", "split_into_canvases", "user_turn_ids"]


DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""A Gemma-style turn template for tokenizers that ship none (the tiny demo models)."""

CHAT_SPECIAL_TOKENS = ("<pad>", "<bos>", "<start_of_turn>", "<end_of_turn>")


class ChatTokenizer(Protocol):
    """What is needed from a tokenizer: Hugging Face's ``apply_chat_template`` (returning ids)."""

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class ChatExample:
    """One prompt / response pair."""

    prompt: str
    response: str


@dataclass
class CanvasExample:
    """One training canvas: the context the encoder sees and the canvas the denoiser must produce."""

    context_ids: list[int]  # prompt + the response before this canvas
    target_ids: list[int]  # exactly L ids, padded
    target_mask: list[bool]  # L flags: True at response tokens, False at padding


@dataclass
class CanvasBatch:
    """A collated batch: left-padded contexts and their canvases."""

    context_ids: Tensor  # (B, P) long, left-padded
    context_mask: Tensor  # (B, P) bool, True at real tokens
    targets: Tensor  # (B, L) long
    target_mask: Tensor  # (B, L) bool

    def to(self, device: torch.device | str) -> CanvasBatch:
        return CanvasBatch(*(t.to(device) for t in (self.context_ids, self.context_mask, self.targets, self.target_mask)))

    @property
    def batch_size(self) -> int:
        return int(self.targets.shape[0])

    def whole_sequence(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The batch as one canvas per row for backbones that read the whole sequence (LLaDA, Dream, MDLM):
        ids ``[context, target]`` (B, P + L), the target positions (B, P + L) bool, and the padding mask
        (B, P + L) long (1 at real tokens; None when nothing is padded)."""
        ids = torch.cat([self.context_ids, self.targets], dim=1)  # (B, P + L)
        target = torch.cat([torch.zeros_like(self.context_mask), torch.ones_like(self.target_mask)], dim=1)
        real = torch.cat([self.context_mask, torch.ones_like(self.target_mask)], dim=1)
        return ids, target, None if bool(real.all()) else real.long()


def make_chat_tokenizer(backend: Any, *, chat_template: str = DEFAULT_CHAT_TEMPLATE) -> Any:
    """A ``transformers`` fast tokenizer with a chat template around a ``tokenizers.Tokenizer``.

    ``<pad>``, ``<bos>``, ``<start_of_turn>`` and ``<end_of_turn>`` are added as special tokens when
    missing (after the existing ids); ``<end_of_turn>`` is the end-of-sequence token. The given
    backend is copied, not modified.
    """
    # deferred: transformers is an optional dependency (the eval, posttrain and tasks extras)
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(backend.to_str())
    backend.add_special_tokens(list(CHAT_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<end_of_turn>",
        pad_token="<pad>",
        chat_template=chat_template,
    )


def _is_reasoning(record: dict[str, Any]) -> bool:
    flag = record.get("reasoning", record.get("thinking", record.get("enable_thinking")))
    if isinstance(flag, str):
        return flag.strip().lower() in ("on", "true", "yes", "1")
    return bool(flag)


def _from_messages(messages: Any, where: str) -> ChatExample:
    if not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
    user = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    reply = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    if len(user) != 1 or len(reply) != 1:
        raise ValueError(
            f"{where}: expected exactly one user and one assistant message, got {len(user)} and {len(reply)}"
        )
    return ChatExample(str(user[0]), str(reply[0]))


def read_chat_jsonl(
    path: str | os.PathLike[str],
    *,
    prompt_field: str = "prompt",
    response_field: str = "response",
    skip_reasoning: bool = True,
) -> list[ChatExample]:
    """Read chat examples from a JSONL file (see the module docstring for the two record shapes)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"chat data file {str(path)!r} is a directory; give a JSONL file")
    if not path.is_file():
        raise FileNotFoundError(f"chat data file {str(path)!r} does not exist")
    examples: list[ChatExample] = []
    with path.open(encoding="utf-8") as handle:
        for n, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object")
            if skip_reasoning and _is_reasoning(record):
                continue
            if "messages" in record:
                examples.append(_from_messages(record["messages"], where))
                continue
            missing = [f for f in (prompt_field, response_field) if f not in record]
            if missing:
                raise ValueError(f"{where}: record lacks {', '.join(map(repr, missing))} (has {sorted(record)})")
            examples.append(ChatExample(str(record[prompt_field]), str(record[response_field])))
    if not examples:
        raise ValueError(f"{path} holds no usable (no-think) chat examples")
    return examples


def _ids(value: Any) -> list[int]:
    """Token ids from whatever ``apply_chat_template(tokenize=True)`` returned (list, tensor, BatchEncoding)."""
    if isinstance(value, dict) or hasattr(value, "keys"):
        value = value["input_ids"]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if value and isinstance(value[0], list):
        if len(value) != 1:
            raise ValueError("expected the ids of a single conversation")
        value = value[0]
    return [int(i) for i in value]


def user_turn_ids(tokenizer: ChatTokenizer, text: str, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Ids of ``text`` as one user turn of the chat template with the generation prompt added.

    ``template_kwargs`` go to ``apply_chat_template`` (default ``{"enable_thinking": False}``).
    """
    kwargs = {"enable_thinking": False} if template_kwargs is None else template_kwargs
    user = [{"role": "user", "content": text}]
    return _ids(tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True, **kwargs))


def encode_chat(
    tokenizer: ChatTokenizer,
    example: ChatExample,
    *,
    max_prompt_tokens: int = 2048,
    max_response_tokens: int = 2048,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """``(prompt_ids, response_ids)`` of one example under the tokenizer's chat template (no-think).

    ``template_kwargs`` go to ``apply_chat_template`` (default ``{"enable_thinking": False}``;
    templates without that switch ignore it).
    """
    if max_prompt_tokens < 1 or max_response_tokens < 1:
        raise ValueError(
            f"max_prompt_tokens and max_response_tokens must be >= 1, got {max_prompt_tokens}, {max_response_tokens}"
        )
    kwargs = {"enable_thinking": False} if template_kwargs is None else dict(template_kwargs)
    both = [{"role": "user", "content": example.prompt}, {"role": "assistant", "content": example.response}]
    prompt = user_turn_ids(tokenizer, example.prompt, kwargs)
    full = _ids(tokenizer.apply_chat_template(both, tokenize=True, add_generation_prompt=False, **kwargs))
    if full[: len(prompt)] != prompt:
        raise ValueError(
            "the chat template does not extend the generation prompt with the assistant turn; cannot locate "
            "the response tokens"
        )
    response = full[len(prompt) :]
    if not response:
        raise ValueError("the chat template produced no response tokens")
    return prompt[-max_prompt_tokens:], response[:max_response_tokens]


def split_into_canvases(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    canvas_length: int,
    pad_id: int,
    max_canvases: int | None = None,
) -> list[CanvasExample]:
    """Cut a response into canvases of ``canvas_length`` ids, each with its block-wise context."""
    if canvas_length < 1:
        raise ValueError(f"canvas_length must be >= 1, got {canvas_length}")
    if max_canvases is not None and max_canvases < 1:
        raise ValueError(f"max_canvases must be >= 1 or None, got {max_canvases}")
    if not prompt_ids:
        raise ValueError("a canvas needs a non-empty prompt as context")
    count = math.ceil(len(response_ids) / canvas_length)
    if max_canvases is not None:
        count = min(count, max_canvases)
    canvases = []
    for j in range(count):
        piece = list(response_ids[j * canvas_length : (j + 1) * canvas_length])
        fill = canvas_length - len(piece)
        canvases.append(
            CanvasExample(
                context_ids=list(prompt_ids) + list(response_ids[: j * canvas_length]),
                target_ids=piece + [pad_id] * fill,
                target_mask=[True] * len(piece) + [False] * fill,
            )
        )
    return canvases


def check_token_ids(tokenizer: Any, max_id: int, vocab_size: int) -> None:
    """Raise a one-line ValueError when ``max_id``, the largest id ``tokenizer`` gave (padding included), lies
    outside a base vocabulary of ``vocab_size`` ids, which the base's embedding cannot look up."""
    if max_id < vocab_size:
        return
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    try:
        top = max(max_id, len(tokenizer) - 1)  # the tokenizer's own range, when it has a length
    except TypeError:
        top = max_id
    raise ValueError(f"tokenizer {name!r} has ids up to {top} but the base's vocabulary is {vocab_size} (ids 0.."
                     f"{vocab_size - 1}): use the base model's own tokenizer")


class ChatCanvasDataset(torch.utils.data.Dataset[CanvasExample]):
    """Canvases of a list of chat examples, built once (the paper's "preprocessing").

    With ``vocab_size`` (the base's), an id of the tokenizer or ``pad_id`` outside ``0..vocab_size - 1``
    is a one-line ValueError naming the tokenizer (:func:`check_token_ids`).
    """

    def __init__(
        self,
        examples: Iterable[ChatExample],
        tokenizer: ChatTokenizer,
        *,
        canvas_length: int,
        pad_id: int,
        max_prompt_tokens: int = 2048,
        max_response_tokens: int = 2048,
        canvases_per_example: int | None = 8,
        template_kwargs: dict[str, Any] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.canvases: list[CanvasExample] = []
        max_id = pad_id
        for example in examples:
            prompt, response = encode_chat(
                tokenizer,
                example,
                max_prompt_tokens=max_prompt_tokens,
                max_response_tokens=max_response_tokens,
                template_kwargs=template_kwargs,
            )
            self.canvases.extend(split_into_canvases(prompt, response, canvas_length, pad_id, canvases_per_example))
            max_id = max(max_id, *prompt, *response)
        if not self.canvases:
            raise ValueError("no canvases were built from the examples")
        if vocab_size is not None:
            check_token_ids(tokenizer, max_id, vocab_size)

    def __len__(self) -> int:
        return len(self.canvases)

    def __getitem__(self, index: int) -> CanvasExample:
        return self.canvases[index]


def collate_canvases(items: Sequence[CanvasExample], pad_id: int) -> CanvasBatch:
    """Stack canvases; contexts are left-padded with ``pad_id`` so every canvas starts at the same position."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    lengths = {len(item.target_ids) for item in items}
    if len(lengths) != 1:
        raise ValueError(f"canvases of different lengths {sorted(lengths)} cannot be batched")
    context, mask = left_pad([item.context_ids for item in items], pad_id)
    targets = torch.tensor([item.target_ids for item in items], dtype=torch.long)
    target_mask = torch.tensor([item.target_mask for item in items], dtype=torch.bool)
    return CanvasBatch(context_ids=context, context_mask=mask, targets=targets, target_mask=target_mask)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Id rows left-padded with ``pad_id`` to the longest: ids (B, P) long and mask (B, P) bool, True at real ids."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for n, row in enumerate(rows):
        ids[n, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[n, width - len(row) :] = True
    return ids, mask
