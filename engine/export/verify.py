"""`regen export --verify`: re-check an export's files against its manifest (presence, bytes, rows, sha256, no extras)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.store.manifest import MANIFEST, ManifestError, read, sha256_file

SCHEMA = "regen.export.verify/1"


@dataclass
class VerifyResult:
    path: str
    files: int
    rows: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "ok": self.ok, **asdict(self)}


def verify_export(path: Path) -> VerifyResult:
    """Raises ManifestError when there is no readable manifest at path (a directory or its manifest.json)."""
    path = Path(path).expanduser()
    directory = path if path.is_dir() else path.parent
    manifest = read(path)
    result = VerifyResult(str(directory), len(manifest.files), sum(f.rows for f in manifest.files))
    if manifest.kind != "export":
        raise ManifestError(f"{path}: a {manifest.kind} manifest, not an export's; --verify checks an export "
                            "directory written by `regen export`")
    listed = {f.path for f in manifest.files}
    for rec in manifest.files:
        file = directory / rec.path
        try:
            size = file.stat().st_size
        except OSError as exc:
            result.problems.append(f"{rec.path}: listed in the manifest but cannot be read ({type(exc).__name__}: "
                                   f"{exc.strerror})")
            continue
        if size != rec.bytes:
            result.problems.append(f"{rec.path}: {size} bytes, the manifest says {rec.bytes}")
        digest = sha256_file(file)
        if digest != rec.sha256:
            result.problems.append(f"{rec.path}: sha256 {digest[:16]}..., the manifest says {rec.sha256[:16]}... "
                                   "(the file changed after the export)")
            continue
        rows = _rows(file)
        if rows != rec.rows:
            result.problems.append(f"{rec.path}: {rows} rows, the manifest says {rec.rows}")
    for extra in sorted(p.name for p in directory.iterdir() if p.is_file()):
        if extra != MANIFEST and extra not in listed and not extra.endswith(".tmp"):
            result.problems.append(f"{extra}: in the export directory but not in its manifest (a trainer reading "
                                   "the directory would take it too)")
    return result


def _rows(file: Path) -> int:
    if file.suffix == ".parquet":
        try:
            return pq.ParquetFile(file).metadata.num_rows
        except (OSError, pa.ArrowException):
            return -1
    with open(file, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))
