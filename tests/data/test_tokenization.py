"""Assistant-token masks from prefix rendering, checked against the template's own `{% generation %}` masks; the
last turn alone as target; which examples have a target at all."""

import copy

import pytest

from rl_lightning.data.tokenization import TokenizedExample, tokenize_messages
from rl_lightning.errors import DataError

SINGLE = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
MULTI = [
    {"role": "system", "content": "Be exact."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And times 10?"},
    {"role": "assistant", "content": "40, since 4 * 10 = 40."},
    {"role": "tool", "content": "calculator: 40"},
    {"role": "assistant", "content": "Confirmed."},
]

# The shipped ChatML template with a `{% generation %}` block around what the assistant writes (content + end token),
# so transformers' own `return_assistant_tokens_mask` serves as the reference implementation.
GENERATION_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _targets(tokenizer, example):
    """Decoded runs of consecutive target tokens."""
    runs, current = [], []
    for token, is_target in zip(example.input_ids, example.loss_mask, strict=True):
        if is_target:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single-turn", "multi-turn"])
def test_mask_marks_exactly_the_assistant_turns(tokenizer, messages):
    example = tokenize_messages(tokenizer, messages)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(example.input_ids) == rendered
    expected = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
    assert _targets(tokenizer, example) == expected


@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single-turn", "multi-turn"])
def test_mask_equals_generation_block_reference(tokenizer, messages):
    reference_tokenizer = copy.deepcopy(tokenizer)
    reference_tokenizer.chat_template = GENERATION_TEMPLATE
    reference = reference_tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert sum(reference["assistant_masks"]) > 0
    ours = tokenize_messages(tokenizer, messages)  # shipped template: no generation block
    assert ours.input_ids == list(reference["input_ids"])
    assert ours.loss_mask == list(reference["assistant_masks"])


def test_without_chat_template_concatenates_contents_and_appends_eos(tokenizer):
    example = tokenize_messages(tokenizer, MULTI[1:5], apply_chat_template=False)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [tokenizer.eos_token_id]
    expected_ids = encode("What is 2 + 2?") + encode("4") + eos + encode("And times 10?")
    expected_ids += encode("40, since 4 * 10 = 40.") + eos
    assert example.input_ids == expected_ids
    expected_mask = [0] * 14 + [1, 1] + [0] * 13 + [1] * 23
    assert example.loss_mask == expected_mask
    assert "<|im_start|>" not in tokenizer.decode(example.input_ids)


def test_last_turn_only_and_has_targets(tokenizer):
    messages = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    all_turns = tokenize_messages(tokenizer, messages)
    last = tokenize_messages(tokenizer, messages, last_turn_only=True)
    assert last.input_ids == all_turns.input_ids
    assert sum(all_turns.loss_mask) == 2 * sum(last.loss_mask)  # "2<|im_end|>\n" and "4<|im_end|>\n", 3 tokens each
    assert tokenizer.decode([i for i, m in zip(last.input_ids, last.loss_mask, strict=True) if m]) == "4<|im_end|>\n"
    assert not TokenizedExample([5, 6], [1, 0]).has_targets and TokenizedExample([5, 6], [0, 1]).has_targets


def test_truncation_is_flagged_and_keeps_the_prefix(tokenizer):
    full = tokenize_messages(tokenizer, MULTI)
    cut = tokenize_messages(tokenizer, MULTI, max_length=20)
    assert not full.truncated and cut.truncated
    assert cut.input_ids == full.input_ids[:20] and cut.loss_mask == full.loss_mask[:20]
    exact = tokenize_messages(tokenizer, MULTI, max_length=len(full.input_ids))
    assert not exact.truncated


def test_template_that_rewrites_history_is_rejected(tokenizer):
    rewriting = copy.deepcopy(tokenizer)
    # Drops earlier assistant turns' content, like templates that strip past reasoning.
    rewriting.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\\n"
        "<|im_end|>\\n' }}{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(DataError, match=r"row 7: the chat template renders messages\[:3\] differently"):
        tokenize_messages(rewriting, MULTI, where="row 7")
