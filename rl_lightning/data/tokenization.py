r"""Chat-template tokenisation with assistant-token masks.

Most chat templates have no ``{% generation %}`` block, so ``return_assistant_tokens_mask`` returns all zeros for
them. Instead we render growing prefixes of the conversation (as RL2 does) and tokenise only the text each message
adds: the text an assistant message adds after its generation prompt is the target (mask 1), everything else
(system/user/tool turns and the ``<|im_start|>assistant\n`` header) is context (mask 0). This works for any template
whose rendering of ``messages[:i]`` is a prefix of its rendering of ``messages[:i+1]``; templates that rewrite
earlier turns (e.g. ones that strip past reasoning) are detected and reported.

Tokenising each delta separately means the token boundaries follow message boundaries, which is what the model sees
at generation time (the prompt is tokenised, then the completion is generated token by token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl_lightning.errors import DataError


@dataclass
class TokenizedExample:
    """One tokenised sequence: `loss_mask[t] == 1` marks token t as a training target."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False
    # Per-token floats about token i as a *target* (e.g. the engine's log-probability of sampling it, its advantage);
    # batches carry them at the predicting position as ``target_<name>``.
    values: dict[str, list[float]] = field(default_factory=dict)

    @property
    def has_targets(self) -> bool:
        """Whether some token is predicted (a sequence's first token never is: nothing precedes it)."""
        return any(self.loss_mask[1:])


def _render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _target_turns(messages: list[dict], last_turn_only: bool) -> set[int]:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return set(turns[-1:] if last_turn_only else turns)


def _chat_segments(tokenizer: Any, messages: list[dict], where: str, targets: set[int]) -> list[tuple[str, int]]:
    """Split the rendered conversation into (text, is_target) segments by rendering prefixes."""
    segments: list[tuple[str, int]] = []
    rendered = ""
    for i in range(len(messages)):
        steps = [(messages[:i], True, 0)] if i in targets else []
        steps.append((messages[: i + 1], False, int(i in targets)))
        for prefix, generation_prompt, is_target in steps:
            text = _render(tokenizer, prefix, generation_prompt) if prefix or generation_prompt else ""
            if not text.startswith(rendered):
                raise DataError(
                    f"{where}: the chat template renders messages[:{i}] differently once later messages are added "
                    "(it rewrites earlier turns), so assistant tokens cannot be located; use a template without "
                    "that behaviour or set `apply_chat_template: false`"
                )
            segments.append((text[len(rendered) :], is_target))
            rendered = text
    return segments


def tokenize_messages(
    tokenizer: Any,
    messages: list[dict],
    max_length: int | None = None,
    apply_chat_template: bool = True,
    where: str = "row",
    last_turn_only: bool = False,
) -> TokenizedExample:
    """Tokenise a conversation and mark the assistant tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (with a chat template when `apply_chat_template`).
        messages: ``[{"role": ..., "content": ...}, ...]``, already validated.
        max_length: keep at most this many tokens (right truncation; `truncated` records it).
        apply_chat_template: when False (base models), concatenate the contents with no template and append the EOS
            token after each assistant message so the model learns to stop.
        where: row location for error messages.
        last_turn_only: only the last assistant message is a target (preference completions); otherwise every
            assistant message is.
    """
    targets = _target_turns(messages, last_turn_only)
    if apply_chat_template:
        segments = _chat_segments(tokenizer, messages, where, targets)
    else:
        if tokenizer.eos_token is None:
            raise DataError("`apply_chat_template: false` appends the EOS token, but the tokenizer defines none")
        segments = []
        for i, message in enumerate(messages):
            is_target = int(i in targets)
            segments.append((message["content"], is_target))
            if is_target:
                segments.append((tokenizer.eos_token, 1))
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for text, is_target in segments:
        ids = _encode(tokenizer, text)
        input_ids += ids
        loss_mask += [is_target] * len(ids)
    truncated = max_length is not None and len(input_ids) > max_length
    if truncated:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return TokenizedExample(input_ids, loss_mask, truncated)
