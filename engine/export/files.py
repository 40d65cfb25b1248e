"""The export's data files: named in order, split every N rows, each hashed as it is written."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from engine.store.manifest import FileRecord, sha256_file

PARQUET_COMPRESSION = "zstd"


def prepare_out_dir(out: Path) -> None:
    """out must be new or an empty directory: an export never mixes with older files."""
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"--out {out}: exists and is not a directory; give a new directory")
        if any(out.iterdir()):
            raise FileExistsError(f"--out {out}: directory is not empty; give a new or empty directory "
                                  "(an export never mixes with older files)")
    out.mkdir(parents=True, exist_ok=True)


class JsonlFiles:
    """Lines into stem.jsonl, or stem-00000.jsonl, stem-00001.jsonl, ... with split_rows rows each."""

    def __init__(self, out: Path, stem: str, split_rows: int | None):
        self.out, self.stem, self.split_rows = out, stem, split_rows
        self.records: list[FileRecord] = []
        self._f: BinaryIO | None = None
        self._hash: hashlib._Hash | None = None  # the open file's
        self._rows = self._bytes = 0
        self._name = ""

    def write(self, line: bytes) -> None:
        """One row: `line` without its newline."""
        if self._f is None or (self.split_rows and self._rows >= self.split_rows):
            self._roll()
        f, digest = self._f, self._hash
        if f is None or digest is None:
            raise RuntimeError(f"{self.stem}.jsonl: no open file after _roll()")
        data = line + b"\n"
        f.write(data)
        digest.update(data)
        self._rows += 1
        self._bytes += len(data)

    def _roll(self) -> None:
        self._finish()
        name = f"{self.stem}.jsonl" if not self.split_rows else f"{self.stem}-{len(self.records):05d}.jsonl"
        self._f = open(self.out / name, "wb", buffering=1 << 20)
        self._hash, self._rows, self._bytes, self._name = hashlib.sha256(), 0, 0, name

    def _finish(self) -> None:
        if self._f is None:
            return
        if self._hash is None:
            raise RuntimeError(f"{self._name}: an open file without its hash")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self.records.append(FileRecord(self._name, self._rows, self._bytes, self._hash.hexdigest()))
        self._f = None

    def close(self) -> list[FileRecord]:
        if self._f is None and not self.records:
            self._roll()  # an export that kept nothing still has its (empty) file, so the trainer's path exists
        self._finish()
        return self.records


class ParquetFiles:
    """Record batches into stem-00000.parquet, ... with at most split_rows rows each (zstd)."""

    def __init__(self, out: Path, stem: str, schema: pa.Schema, split_rows: int):
        self.out, self.stem, self.schema, self.split_rows = out, stem, schema, split_rows
        self.records: list[FileRecord] = []
        self._writer: pq.ParquetWriter | None = None
        self._rows = 0
        self._name = ""

    def write(self, table: pa.Table) -> None:
        start = 0
        while start < table.num_rows:
            if self._writer is None or self._rows >= self.split_rows:
                self._roll()
            writer = self._writer
            if writer is None:
                raise RuntimeError(f"{self.stem}: no open Parquet file after _roll()")
            take = min(self.split_rows - self._rows, table.num_rows - start)
            writer.write_table(table.slice(start, take), row_group_size=max(take, 1))
            self._rows += take
            start += take

    def _roll(self) -> None:
        self._finish()
        self._name = f"{self.stem}-{len(self.records):05d}.parquet"
        self._writer = pq.ParquetWriter(self.out / self._name, self.schema, compression=PARQUET_COMPRESSION)
        self._rows = 0

    def _finish(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        path = self.out / self._name
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        self.records.append(FileRecord(self._name, self._rows, path.stat().st_size, sha256_file(path)))
        self._writer = None

    def close(self) -> list[FileRecord]:
        if self._writer is None and not self.records:
            self._roll()
        self._finish()
        return self.records
