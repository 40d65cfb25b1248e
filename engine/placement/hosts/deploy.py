"""What a remote host is given on each join: the engine's copy, its host.toml, and its servers' names and GPUs."""
from __future__ import annotations

import io
import tarfile
from pathlib import Path

from engine.config.load import Host, RunConfig, Workers, host_workers
from engine.servers.launch import WorkerSpec


def named_specs(workers: Workers, host_name: str) -> list[WorkerSpec]:
    """One server per GPU group, named <host>.gpu<ids> so names stay unique across hosts."""
    return [WorkerSpec(name=f"{host_name}.gpu" + "-".join(str(g) for g in group), gpus=group, host=workers.host,
                       port=workers.base_port + i)
            for i, group in enumerate(workers.groups())]


def host_specs(cfg: RunConfig, host: Host) -> list[WorkerSpec]:
    return named_specs(host_workers(cfg, host), host.name)


def host_config(cfg: RunConfig, host: Host) -> RunConfig:
    """The config a host agent runs with: this host's workers and nothing of the others."""
    return cfg.model_copy(update=dict(run_dir=host.work_dir, host_python=host.host_python,
                                      workers=host_workers(cfg, host), hosts=())).with_source(None)


def engine_tarball(engine_root: Path) -> bytes:
    """engine/ and probes/ (.py files) as an uncompressed tar, for `ssh host tar -x`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for pkg in ("engine", "probes"):
            for f in sorted((engine_root / pkg).rglob("*.py")):
                if "__pycache__" not in f.parts:
                    tar.add(f, arcname=str(f.relative_to(engine_root)))
    return buf.getvalue()
