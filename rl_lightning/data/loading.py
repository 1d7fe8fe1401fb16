"""Load rows from a local file (JSON, JSONL, CSV, Parquet, Arrow), a `save_to_disk` folder or a Hugging Face dataset.

Rows come back as plain dicts together with a human-readable location for each row, so validation errors can say
"sft.jsonl line 12" instead of "index 11 of something".
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_lightning.errors import DataError

SUPPORTED_EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet", ".arrow")
# Columns that hold nested structures; CSV stores them as JSON strings.
NESTED_COLUMNS = ("messages", "chosen", "rejected")


@dataclass
class Rows:
    """Loaded rows and where they came from (`source`); `locate(i)` names row i for error messages."""

    rows: list[dict[str, Any]]
    source: str
    line_numbers: list[int] | None = None

    def locate(self, index: int) -> str:
        """Where row `index` came from, for error messages: ``<source> line <n>`` or ``<source> row <index>``."""
        if self.line_numbers is not None:
            return f"{self.source} line {self.line_numbers[index]}"
        return f"{self.source} row {index}"

    def __len__(self) -> int:
        return len(self.rows)


def load_rows(path: str, split: str = "train") -> Rows:
    """Load every row of `path`.

    Args:
        path: a local file (``.json`` array or object-per-line, ``.jsonl``, ``.csv``, ``.parquet``, ``.arrow``), a
            folder written by ``Dataset.save_to_disk``, or a Hugging Face dataset name (``org/name``).
        split: the split to read for Hugging Face names and ``DatasetDict`` folders.

    ``reasoning_gym:TASK[:SPLIT][?key=value&...]`` generates a reasoning-gym task instead (see
    `rl_lightning.data.reasoning_gym`; its split is part of the path).
    """
    if path.startswith("reasoning_gym:"):
        from rl_lightning.data.reasoning_gym import load_spec_rows

        return Rows(load_spec_rows(path), path)
    local = Path(path).expanduser()
    if local.is_dir():
        return _load_saved_dataset(local, split)
    if local.is_file():
        return _load_file(local)
    if local.suffix in SUPPORTED_EXTENSIONS or path.startswith((".", "/", "~")):
        raise DataError(f"data file not found: '{path}' (resolved to {local.resolve()}); check the `path` setting")
    return _load_hub(path, split)


def _load_file(path: Path) -> Rows:
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"unsupported data file extension '{path.suffix}' for '{path}'; use one of {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    if suffix in (".json", ".jsonl"):
        return _load_json(path)
    if suffix == ".csv":
        return _load_csv(path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    if suffix == ".parquet":
        table = pq.read_table(path)
    else:
        table = _read_arrow(path, pa)
    return Rows(table.to_pylist(), str(path))


def _read_arrow(path: Path, pa: Any) -> Any:
    # `datasets` writes Arrow *streams*; pyarrow's own default is the IPC *file* format. Accept both.
    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()


def read_text(path: Path) -> str:
    """The file as UTF-8 text (a leading byte-order mark dropped).

    Anything else is a one-line `DataError` naming the line and byte offset of the first undecodable byte.
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                        "re-save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 in.jsonl > out.jsonl") from None


def _load_csv(path: Path) -> Rows:
    """CSV rows numbered as the file shows them: the header is line 1, a row spanning lines is named by its first."""
    reader = csv.DictReader(io.StringIO(read_text(path), newline=""))
    rows, line_numbers = [], []
    for row in reader:
        # reader.line_num is the row's last line; quoted fields may hold line breaks
        first = reader.line_num - sum(str(v).count("\n") for v in row.values() if v is not None)
        rows.append(_decode_nested(dict(row), f"{path} line {first}"))
        line_numbers.append(first)
    return Rows(rows, str(path), line_numbers)


def _load_json(path: Path) -> Rows:
    text = read_text(path)
    stripped = text.lstrip()
    if path.suffix.lower() == ".json" and stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
        return Rows(rows, str(path))
    rows, line_numbers = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {lineno}: invalid JSON ({e.msg}); expected one JSON object per line") from None
        line_numbers.append(lineno)
    return Rows(rows, str(path), line_numbers)


def _decode_nested(row: dict[str, Any], where: str) -> dict[str, Any]:
    for key in NESTED_COLUMNS:
        value = row.get(key)
        if isinstance(value, str) and value.lstrip().startswith(("[", "{")):
            try:
                row[key] = json.loads(value)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: column '{key}' is not valid JSON ({e.msg})") from None
    return row


def _load_saved_dataset(path: Path, split: str) -> Rows:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise DataError(
            f"'{path}' is a folder but not one written by Dataset.save_to_disk; point `path` at a data file instead"
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise DataError(f"split '{split}' not in '{path}' (has {', '.join(dataset)}); set `split` to one of them")
        dataset = dataset[split]
    return Rows(dataset.to_list(), str(path))


def _load_hub(name: str, split: str) -> Rows:
    import datasets

    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - the hub raises many types; all mean "cannot load this name"
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"'{name}' is neither a local file nor a loadable Hugging Face dataset ({first_line}); "
            f"give a path to a {'/'.join(SUPPORTED_EXTENSIONS)} file"
        ) from None
    return Rows(dataset.to_list(), f"{name}[{split}]")
