"""Row validation: each malformed row is reported with its file, row/line, field and value."""

import pytest

from rl_lightning.data.loading import Rows
from rl_lightning.data.rows import check_preference_rows, check_prompt_rows, check_sft_rows
from rl_lightning.errors import DataError

GOOD = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def _rows(*rows):
    return Rows(list(rows), "f.jsonl", list(range(1, len(rows) + 1)))


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"text": "x"}, r"f.jsonl line 2: missing 'messages' \(have \['text'\]\)"),
        ({"messages": []}, r"f.jsonl line 2: 'messages' must be a non-empty list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, r"line 2: messages\[0\] has unknown role 'bot'; allowed"),
        ({"messages": [{"role": "user", "content": 3}]}, r"line 2: messages\[0\] content must be a string, got int 3"),
        ({"messages": [{"role": "user", "content": None}]}, r"content must be a string, got NoneType"),
        ({"messages": ["hi"]}, r"messages\[0\] must be a dict"),
        ({"messages": [{"role": "user", "content": "q"}]}, r"line 2: no assistant message"),
    ],
)
def test_bad_sft_rows(row, match):
    with pytest.raises(DataError, match=match):
        check_sft_rows(_rows({"messages": GOOD}, row))


def test_empty_dataset():
    with pytest.raises(DataError, match="dataset 'f.jsonl' is empty"):
        check_sft_rows(_rows())


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"messages": GOOD[:1], "rejected": "b"}, r"line 1: missing 'chosen'"),
        ({"messages": GOOD[:1], "chosen": "a", "rejected": "a"}, r"line 1: 'chosen' and 'rejected' are identical"),
        ({"messages": GOOD[:1], "chosen": ["a"], "rejected": "b"}, r"'chosen' must be a string, got list"),
    ],
)
def test_bad_preference_rows(row, match):
    with pytest.raises(DataError, match=match):
        check_preference_rows(_rows(row))


def test_prompt_rows_need_answer():
    check_prompt_rows(_rows({"messages": GOOD[:1], "answer": 0}))
    with pytest.raises(DataError, match=r"line 1: missing 'answer'"):
        check_prompt_rows(_rows({"messages": GOOD[:1]}))
