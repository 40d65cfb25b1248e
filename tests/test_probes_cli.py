"""`regen probe` end to end: through the installed CLI (subprocess), locally and over a real sshd."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from console.commands.probe import context_from_config
from console.host.connect import open_transport
from engine.config.load import load_config
from probes.model import Status
from probes.runner import run_probes
from tests.sshd_fixtures import free_port, free_port_base
from tests.test_probes_fakes import REPO, add_weights, gpu_env, probe_local, sharegpt, write_jsonl, write_run_toml

REGEN = str(REPO / ".venv" / "bin" / "regen") if (REPO / ".venv" / "bin" / "regen").exists() else None


def regen(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [REGEN, *args] if REGEN else [sys.executable, "-m", "console.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ), cwd=REPO)


@pytest.fixture
def run_toml(model_copy, tmp_path) -> Path:
    add_weights(model_copy, 8 << 20)
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [sharegpt(i, turns=2) for i in range(30)])
    return write_run_toml(tmp_path / "run.toml", run_dir=tmp_path / "runs" / "r1", model=model_copy,
                          prompts=[str(data / "*.jsonl")], base_port=free_port_base(2))


def statuses(report: dict) -> dict[str, str]:
    return {p["id"]: p["status"] for p in report["probes"]}


def test_cli_local_on_this_machine_fails_with_reasons(run_toml):
    proc = regen("probe", "local", "--config", str(run_toml), "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["schema"] == "regen.probe/1"
    st = statuses(report)
    assert list(st) == ["config", "connection", "host.python", "packages", "gpu.nvidia_smi", "gpu.nvml", "cuda.torch",
                        "disk.run_dir", "disk.shm", "model.dir", "model.weights", "prompts.paths", "prompts.format",
                        "prompts.tokens", "ports", "run_dir.resume"]
    assert st["config"] == st["connection"] == st["host.python"] == st["prompts.paths"] == st["ports"] == "PASS"
    assert st["packages"] == st["gpu.nvidia_smi"] == st["gpu.nvml"] == st["cuda.torch"] == "FAIL"
    assert st["model.dir"] == "PASS"
    assert st["model.weights"] == "WARN"  # fit unknown without GPUs
    assert report["rehearsal"] is False
    by_id = {p["id"]: p for p in report["probes"]}
    assert "sglang: ModuleNotFoundError: No module named 'sglang'" in by_id["packages"]["summary"]
    assert by_id["gpu.nvidia_smi"]["exit_status"] == 127
    assert by_id["run_dir.resume"]["summary"].startswith("new run:")
    assert report["summary"]["FAIL"] == 4
    assert set(by_id["connection"]) >= {"id", "title", "status", "summary", "expected", "actual", "command",
                                       "exit_status", "stdout", "stderr", "duration_s", "remedy", "data"}


def test_cli_local_all_pass_with_gpu_fakes(run_toml, monkeypatch, tmp_path):
    gpu_env(monkeypatch, tmp_path, torch_version="2.5.1")  # < 2.6: transformers leaves the fake torch alone
    proc = regen("probe", "local", "--config", str(run_toml), "--json")
    report = json.loads(proc.stdout)
    bad = {k: v for k, v in statuses(report).items() if v not in ("PASS", "WARN")}
    assert bad == {}, [p["summary"] for p in report["probes"] if p["id"] in bad]
    assert proc.returncode == 0


def test_cli_human_report_and_only(run_toml):
    proc = regen("probe", "local", "--config", str(run_toml), "--only", "gpu.nvidia_smi,prompts.paths")
    assert proc.returncode == 1
    out = proc.stdout
    assert "regen probe local" in out
    assert "nvidia-smi not found (exit 127)" in out
    assert "prompts.paths" in out and "packages" not in out
    assert "PASS 4  FAIL 1" in out  # config, connection, host.python, prompts.paths; gpu.nvidia_smi


def test_cli_bad_config_and_unknown_probe(tmp_path, run_toml):
    def config_probe(path: Path) -> dict:
        """A config that cannot be used: the `config` probe FAILs (exit 1) and no host probe runs."""
        proc = regen("probe", "local", "--config", str(path), "--json")
        assert proc.returncode == 1, proc.stderr
        probes = json.loads(proc.stdout)["probes"]
        assert [(p["id"], p["status"]) for p in probes] == [("config", "FAIL")]
        assert probes[0]["summary"].startswith(f"{path}: 1 error")
        return probes[0]

    bad = tmp_path / "bad.toml"
    bad.write_text("run_dir = \n")
    assert config_probe(bad)["stdout"].startswith("(file): is not valid TOML: Invalid value (at line 1")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text(run_toml.read_text() + "gpu_count = 3\n")
    assert config_probe(unknown)["stdout"].startswith("[workers] gpu_count: unknown key")  # appended: in [workers]
    missing = config_probe(tmp_path / "missing.toml")["stdout"]
    assert "No such file or directory" in missing and "missing.toml" in missing
    proc = regen("probe", "local", "--config", str(run_toml), "--only", "gpus")
    assert proc.returncode == 2 and "unknown probe 'gpus'" in proc.stderr


def test_cli_unreachable_host_exit_2(tmp_path):
    empty_cfg = tmp_path / "ssh_config"
    empty_cfg.write_text("")
    env = dict(os.environ, REGEN_SSH_CONFIG=str(empty_cfg))
    port = free_port()  # nothing listens there
    proc = regen("probe", f"127.0.0.1:{port}", "--json", "--timeout", "5", env=env)
    assert proc.returncode == 2, proc.stderr
    report = json.loads(proc.stdout)
    conn = report["probes"][0]
    assert conn["id"] == "connection" and conn["status"] == "ERROR"
    assert conn["summary"].startswith("unreachable: cannot reach 127.0.0.1")
    assert "Connection refused" in conn["summary"]
    assert conn["data"]["kind"] == "unreachable"
    assert all(p["status"] == "SKIP" for p in report["probes"][1:])


# ---------------------------------------------------------------------------------------------- over SSH


@pytest.mark.sshd
def test_same_verdicts_over_ssh_as_local(sshd, run_toml):
    ctx = context_from_config(load_config(run_toml))

    async def over_ssh():
        transport = await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path))
        try:
            return await run_probes(transport, sshd.alias, ctx)
        finally:
            await transport.close()

    async def both():
        return await asyncio.gather(probe_local(ctx), over_ssh())

    local, remote = asyncio.run(both())
    loc = {r.id: r for r in local.results}
    rem = {r.id: r for r in remote.results}
    assert {k: v.status for k, v in rem.items()} == {k: v.status for k, v in loc.items()}
    assert rem["connection"].status is Status.PASS
    assert rem["gpu.nvidia_smi"].summary == loc["gpu.nvidia_smi"].summary
    assert rem["packages"].summary == loc["packages"].summary
    assert rem["prompts.format"].data["rows"] == loc["prompts.format"].data["rows"] == 30
    assert rem["prompts.tokens"].data["p99"] == loc["prompts.tokens"].data["p99"]


@pytest.mark.sshd
def test_cli_over_ssh(sshd, run_toml):
    env = dict(os.environ, REGEN_SSH_CONFIG=str(sshd.ssh_config_path))
    proc = regen("probe", sshd.alias, "--config", str(run_toml), "--json", env=env)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    st = statuses(report)
    assert st["connection"] == "PASS" and st["gpu.nvidia_smi"] == "FAIL" and st["prompts.paths"] == "PASS"
    assert report["host"] == sshd.alias


def _client_config(sshd, tmp_path: Path, *, known_hosts: Path, key: Path | None = None) -> Path:
    from tests.sshd_fixtures import write_client_config

    cfg = tmp_path / "client_config"
    write_client_config(cfg, alias=sshd.alias, port=sshd.port, user=sshd.user, key=key or sshd.client_key_path,
                        known_hosts=known_hosts)
    return cfg


@pytest.mark.sshd
def test_cli_unknown_host_key_fails_then_accept_new(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    env = dict(os.environ, REGEN_SSH_CONFIG=str(_client_config(sshd, tmp_path, known_hosts=known)))
    env.pop("SSH_AUTH_SOCK", None)
    proc = regen("probe", sshd.alias, "--json", "--only", "connection", env=env)
    assert proc.returncode == 2
    conn = json.loads(proc.stdout)["probes"][0]
    assert conn["status"] == "FAIL" and conn["data"]["kind"] == "host_key"
    assert conn["summary"].startswith("host key not verified: ")
    assert "--accept-new" in conn["remedy"]
    proc = regen("probe", sshd.alias, "--json", "--only", "connection", "--accept-new", env=env)
    assert proc.returncode == 0, proc.stdout
    assert json.loads(proc.stdout)["probes"][0]["status"] == "PASS"
    assert f"[127.0.0.1]:{sshd.port}" in known.read_text()


@pytest.mark.sshd
def test_cli_wrong_key_is_auth_failure_not_unreachable(sshd, tmp_path):
    from tests.sshd_fixtures import write_keypair

    stranger = tmp_path / "stranger_key"
    write_keypair(stranger, "not authorized")
    env = dict(os.environ, REGEN_SSH_CONFIG=str(_client_config(sshd, tmp_path, known_hosts=sshd.known_hosts_path,
                                                               key=stranger)))
    env.pop("SSH_AUTH_SOCK", None)
    proc = regen("probe", sshd.alias, "--json", env=env)
    assert proc.returncode == 2
    conn = json.loads(proc.stdout)["probes"][0]
    assert conn["status"] == "FAIL" and conn["data"]["kind"] == "auth"
    assert conn["summary"].startswith("authentication failed: ")
    assert conn["data"]["reachable"] is True
