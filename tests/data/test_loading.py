"""Every supported source loads the same rows; bad paths fail with one clear line."""

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_lightning.data.loading import load_rows
from rl_lightning.errors import DataError

ROWS = [
    {"messages": [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}], "answer": "2"},
    {"messages": [{"role": "system", "content": "Be brief, \"exact\"."}, {"role": "user", "content": "7 * 6,\nok?"}],
     "answer": "42"},
    {"messages": [{"role": "user", "content": "ünïcode ✓"}], "answer": "-3"},
]


def _write_all(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    with (tmp_path / "rows.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["messages", "answer"])
        writer.writeheader()
        for row in ROWS:
            writer.writerow({"messages": json.dumps(row["messages"]), "answer": row["answer"]})
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "rows.parquet")
    with pa.OSFile(str(tmp_path / "rows.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    import datasets

    dataset = datasets.Dataset.from_list(ROWS)
    dataset.save_to_disk(str(tmp_path / "saved"))
    return ["rows.json", "rows.jsonl", "rows.csv", "rows.parquet", "rows.arrow", "saved"]


def test_every_format_loads_the_same_rows(tmp_path):
    names = _write_all(tmp_path)
    # `datasets` writes Arrow stream files (.arrow) inside save_to_disk folders: load one directly too.
    stream_file = next((tmp_path / "saved").glob("*.arrow"))
    loaded = {name: load_rows(str(tmp_path / name)).rows for name in names}
    loaded["datasets-stream.arrow"] = load_rows(str(stream_file)).rows
    assert len(loaded) == 7
    for name, rows in loaded.items():
        assert rows == ROWS, name


def test_jsonl_rows_are_located_by_line(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    rows = load_rows(str(path))
    assert len(rows) == 2 and rows.locate(1) == f"{path} line 3"


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("missing.jsonl", None, r"data file not found: '.*missing.jsonl'"),
        ("rows.txt", "hello", r"unsupported data file extension '.txt'.*\.jsonl"),
        ("broken.jsonl", '{"messages": [}\n', r"broken.jsonl line 1: invalid JSON"),
    ],
)
def test_bad_files_raise_one_line(tmp_path, name, content, match):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=match) as info:
        load_rows(str(tmp_path / name))
    assert "\n" not in str(info.value)


def test_unreachable_hub_name_is_one_line_error():
    with pytest.raises(DataError, match="neither a local file nor a loadable Hugging Face dataset") as info:
        load_rows("no-such-org/no-such-dataset")
    assert "\n" not in str(info.value)
