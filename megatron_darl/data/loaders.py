"""Load a prompt dataset (jsonl, jsonl.gz or parquet) into ``PromptRecord``s.

Each dataset's columns are mapped through its ``FieldMapConfig``. A malformed row (bad JSON,
not an object, a mapped column missing or empty, undecodable tests, a reference the task's
verifier cannot use, HumanEval test or prompt code the check cannot run) raises ``ValueError``
naming the file, the line (jsonl) or row (parquet, 1-based) and the field (a line that is not
UTF-8 included), unless the config
says ``skip_malformed: true``, in which case it is skipped and counted in ``LoadResult``.

Whether a reference can be graded is the verifier's knowledge (math: math-verify parses it), and
the verifiers live a layer up (``rewards/``). The caller that wires both passes the task's check
(``rewards.reference_check(task)``) as ``check_reference``; data imports no reward code.
"""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from megatron_darl.data.builtin import builtin_records
from megatron_darl.data.countdown import countdown_records
from megatron_darl.data.config import DataConfig
from megatron_darl.data.records import PromptRecord
from megatron_darl.data.testcases import FunctionTestError, decode_cases, humaneval_setup

logger = logging.getLogger(__name__)
ReferenceCheck = Callable[[str], "str | None"]  # why a reference cannot be graded, or None
ENTRY_POINT = "entry_point"  # metadata column naming a HumanEval row's function


class MalformedRowError(ValueError):
    """A dataset row that cannot become a ``PromptRecord``; the message names file, line, field."""


@dataclass
class LoadResult:
    """Records of one dataset and what was skipped."""

    records: list[PromptRecord]  # usable records, in file order
    skipped: int = 0  # malformed rows skipped (skip_malformed only)
    skipped_lines: list[int] = field(default_factory=list)  # their line/row numbers (1-based)


def _jsonl_rows(path: Path) -> Iterator[tuple[int, object]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:  # bytes: a line that is not UTF-8 is named, not a bare decode error
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield line_no, MalformedRowError(f"{path}:{line_no}: not UTF-8 (byte 0x{raw[exc.start]:02x} "
                                                 f"at column {exc.start + 1}); re-encode the file as UTF-8")
                continue
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                yield line_no, MalformedRowError(f"{path}:{line_no}: invalid JSON ({exc.msg})")


def _parquet_rows(path: Path) -> Iterator[tuple[int, object]]:
    import pyarrow.parquet as pq

    row_no = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for row in batch.to_pylist():
            row_no += 1
            yield row_no, row


def iter_rows(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line or row number, parsed row or the error it raised) for every row of ``path``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    suffixes = "".join(path.suffixes[-2:])
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    if path.suffix == ".jsonl" or suffixes == ".jsonl.gz":
        return _jsonl_rows(path)
    raise ValueError(f"dataset file {path}: unsupported format (use .jsonl, .jsonl.gz or .parquet)")


def _column(row: dict, name: str, where: str, required: bool = True):
    value = row.get(name)
    if required and (value is None or (isinstance(value, str) and not value.strip())):
        raise MalformedRowError(f"{where}: field {name!r} is missing or empty")
    return value


def build_messages(prompt: str, cfg: DataConfig, values: dict) -> list[dict[str, str]]:
    """Chat messages for one prompt: the optional system message, then the templated user turn."""
    messages = [{"role": "system", "content": cfg.template.system}] if cfg.template.system else []
    user = cfg.template.user.format_map({**values, "prompt": prompt})
    return messages + [{"role": "user", "content": user}]


def row_to_record(row: object, index: int, cfg: DataConfig, where: str,
                  check_reference: ReferenceCheck | None = None) -> PromptRecord:
    """Map one parsed row to a ``PromptRecord`` (``where`` is "file:line" for errors)."""
    if isinstance(row, Exception):
        raise row
    if not isinstance(row, dict):
        raise MalformedRowError(f"{where}: row is a {type(row).__name__}, expected an object")
    fm = cfg.fields
    prompt = str(_column(row, fm.prompt, where))
    reference = str(_column(row, fm.reference, where)) if fm.reference else ""
    tests = []
    for column in (c for c in (fm.tests, fm.extra_tests) if c):
        try:
            tests += decode_cases(_column(row, column, where, column == fm.tests),
                                  cfg.tests_format == "livecodebench")
        except (ValueError, TypeError) as exc:  # json, base64, zlib and pickle errors included
            raise MalformedRowError(f"{where}: field {column!r}: {exc}") from exc
    if fm.tests and not tests:
        raise MalformedRowError(f"{where}: field {fm.tests!r} has no stdin/stdout test cases")
    if check_reference is not None and fm.reference:
        problem = check_reference(reference)
        if problem is not None:
            raise MalformedRowError(f"{where}: field {fm.reference!r}: {problem}")
    metadata = {name: row.get(name) for name in fm.metadata}
    metadata["source_id"] = row.get(fm.id, index) if fm.id else index
    if cfg.task == "humaneval":
        try:
            humaneval_setup(prompt, reference, metadata.get(ENTRY_POINT))
        except FunctionTestError as exc:
            column = {"prompt": fm.prompt, "test": fm.reference, "entry_point": ENTRY_POINT}[exc.part]
            raise MalformedRowError(f"{where}: field {column!r}: {exc}") from exc
    try:
        messages = build_messages(prompt, cfg, {k: v for k, v in row.items() if isinstance(k, str)})
    except (KeyError, IndexError) as exc:
        raise MalformedRowError(f"{where}: template field {exc} is not in the row") from exc
    return PromptRecord(index, prompt, messages, cfg.task, reference, tests, metadata, source=where)


def load_records(cfg: DataConfig, check_reference: ReferenceCheck | None = None) -> LoadResult:
    """All records of a ``source: file`` dataset (see the module docstring for malformed rows and
    ``check_reference``)."""
    if cfg.source != "file":
        raise ValueError(f"data {cfg.name}: load_records reads files; source is {cfg.source!r}")
    result = LoadResult(records=[])
    for line_no, row in iter_rows(cfg.path):
        if 0 <= cfg.max_records <= len(result.records):
            break
        try:
            record = row_to_record(row, len(result.records), cfg, f"{cfg.path}:{line_no}", check_reference)
        except MalformedRowError as exc:
            if not cfg.skip_malformed:
                raise
            logger.warning("skipping malformed row: %s", exc)
            result.skipped += 1
            result.skipped_lines.append(line_no)
            continue
        result.records.append(record)
    return result


def load_dataset(cfg: DataConfig, check_reference: ReferenceCheck | None = None) -> LoadResult:
    """Records of any dataset config: generated for ``source: builtin``, read for ``file`` (each
    reference checked by ``check_reference``, the task's verifier's check)."""
    if cfg.source == "builtin":
        if cfg.task == "countdown":
            return LoadResult(records=countdown_records(cfg.countdown))
        return LoadResult(records=builtin_records(cfg.builtin))
    return load_records(cfg, check_reference)
