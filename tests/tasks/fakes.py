"""A fake generator for the task-runner tests: it answers each prompt with a text chosen by a function."""

from __future__ import annotations

from typing import Any, Callable

import torch

from tadm.tasks.generation import BatchOutput


class FakeGenerator:
    """Answers a prompt with ``answer(prompt_text, settings)``; token ids index the texts it has seen."""

    kind = "fake"

    def __init__(self, answer: Callable[[str, dict[str, Any]], str], settings: Any = None,
                 naive: bool = False, texts: list[str] | None = None) -> None:
        self.answer, self.settings, self.naive = answer, settings, naive
        self.texts = texts if texts is not None else []
        self.device = torch.device("cpu")
        self.name = "fake"
        self.calls = 0

    def with_settings(self, settings: Any, *, naive: bool | None = None) -> FakeGenerator:
        return FakeGenerator(self.answer, settings, bool(naive), self.texts)

    def encode(self, text: str) -> list[int]:
        self.texts.append(text)
        return [len(self.texts) - 1]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.texts[i] for i in ids)

    def _K(self) -> int:
        return self.settings.policy.config().get("interval", 1) if self.settings is not None else 1

    def generate(self, prompts: list[list[int]], max_new_tokens: int, generator: Any = None, stop: Any = None) -> BatchOutput:
        tokens = []
        for row in prompts:
            text = self.answer(self.texts[row[0]], {"K": self._K(), "naive": self.naive})
            self.texts.append(text)
            tokens.append([len(self.texts) - 1])
        return BatchOutput(tokens=tokens, ended=[True] * len(prompts), layer_calls={"total": 12 // self._K()},
                           encoder_layer_calls=0, decoder_forward_passes=[1] * len(prompts), seconds=0.5)

    def describe(self) -> dict[str, Any]:
        return {"kind": "fake", "K": self._K(), "naive": self.naive}
