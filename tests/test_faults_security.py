"""Security: host keys verified (unknown and changed keys refused with a clear message), no shell
injection through run dirs and prompt paths (local and over SSH), private modes on the run dir and
control socket, SGLang bound to loopback, and the SGLang API key never printed."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from engine.config.load import dump_toml
from tests.run_helpers import REPO, make_config, quick_state, read_rows, record_figures, wait_for
from tests.test_cli_run import cleanup_runs  # noqa: F401  (fixture)

API_KEY = "sk-FAULTS-0123456789-secret"
# every shell metacharacter that matters: a quoting bug would run `touch` and leave a file behind
NASTY = "run dir; touch INJECTED_A 'q' \"dq\" $(touch INJECTED_B) `touch INJECTED_C` & x|y"


def regen(*args: str, home: Path, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    full = dict(os.environ, HOME=str(home), PYTHONPATH=str(REPO), **(env or {}))
    full.pop("SSH_AUTH_SOCK", None)
    return subprocess.run([sys.executable, "-m", "console.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=str(home))


def _injected(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("INJECTED_*")) + sorted(
        str(p) for p in Path("/tmp").glob("INJECTED_*")) + sorted(str(p) for p in REPO.glob("INJECTED_*"))


def _config_with_nasty_paths(tmp_path: Path, tiny_model_dir: Path, **workers):
    base = tmp_path / NASTY
    run_dir = base / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=12, gpus=1)
    prompt_dir = base / "prompts; touch INJECTED_D"
    prompt_dir.mkdir(parents=True)
    moved = []
    for p in cfg.prompts:
        dst = prompt_dir / ("it's " + Path(p).name)
        Path(p).rename(dst)
        moved.append(str(dst))
    cfg = cfg.model_copy(update=dict(prompts=tuple(moved),
                                     workers=cfg.workers.model_copy(update=workers) if workers else cfg.workers))
    config_path = tmp_path / "run.toml"
    config_path.write_text(dump_toml(cfg))
    return cfg, run_dir, config_path


def _wait_gone(run_dir: Path, timeout: float = 150) -> None:
    wait_for(lambda: not (run_dir / "supervisor.pid").exists(), timeout, f"the supervisor of {run_dir} to exit")


@pytest.mark.slow
def test_local_start_with_nasty_paths_private_modes_loopback_and_no_key_leak(tmp_path, tiny_model_dir,
                                                                             cleanup_runs):
    cfg, run_dir, config_path = _config_with_nasty_paths(tmp_path, tiny_model_dir, api_key=API_KEY)
    cleanup_runs.append(run_dir)
    r = regen("start", "local", "--config", str(config_path), home=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_for(lambda: quick_state(run_dir) in ("running", "done"), 90, "running")
    sock_mode = stat.S_IMODE(os.stat(run_dir / "control.sock").st_mode)
    dir_mode = stat.S_IMODE(os.stat(run_dir).st_mode)
    st = regen("status", "local", "--run-dir", str(run_dir), "--json", home=tmp_path)
    human = regen("status", "local", "--run-dir", str(run_dir), home=tmp_path)
    server_pid = int((run_dir / "workers" / "gpu0" / "server.pid").read_text())
    try:
        proc = psutil.Process(server_pid)
        listening = {c.laddr.ip for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        listening = set()  # it finished: judged from the launch line below
    _wait_gone(run_dir)
    server_log = (run_dir / "workers" / "gpu0" / "server.log").read_text()
    regen_lines = [line for line in server_log.splitlines() if line.startswith("[regen ")]
    leaks = {name: API_KEY in text for name, text in {
        "server.log (regen lines)": "\n".join(regen_lines),
        "supervisor.log": (run_dir / "supervisor.log").read_text(),
        "telemetry.jsonl": (run_dir / "telemetry.jsonl").read_text(),
        "regen status --json": st.stdout + st.stderr,
        "regen status": human.stdout + human.stderr,
        "regen start": r.stdout + r.stderr,
    }.items()}
    injected = _injected(tmp_path)
    record_figures("security_local", control_sock_mode=oct(sock_mode), run_dir_mode=oct(dir_mode),
                   sglang_listen=sorted(listening), api_key_leaks=sum(leaks.values()), injected_files=len(injected),
                   rows=len(read_rows(run_dir)))
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["run_dir"] == str(run_dir)
    assert sock_mode == 0o600 and dir_mode == 0o700
    assert regen_lines and all("--host 127.0.0.1" in line for line in regen_lines if "launching:" in line)
    assert listening <= {"127.0.0.1"}
    assert "--api-key ***" in "\n".join(regen_lines)
    assert not any(leaks.values()), leaks
    assert injected == []
    assert read_rows(run_dir), "the run produced nothing"


@pytest.mark.sshd
@pytest.mark.slow
def test_start_over_ssh_with_nasty_paths_runs_no_injected_command(sshd, tmp_path, tiny_model_dir, cleanup_runs):
    cfg, run_dir, config_path = _config_with_nasty_paths(tmp_path, tiny_model_dir)
    cleanup_runs.append(run_dir)
    env = {"REGEN_SSH_CONFIG": str(sshd.ssh_config_path)}
    r = regen("start", sshd.alias, "--config", str(config_path), home=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    st = regen("status", sshd.alias, "--run-dir", str(run_dir), "--json", home=tmp_path, env=env)
    _wait_gone(run_dir)
    injected = _injected(tmp_path) + sorted(str(p) for p in Path(sshd.ssh_config_path).parent.rglob("INJECTED_*"))
    record_figures("security_ssh_injection", injected_files=len(injected), rows=len(read_rows(run_dir)))
    assert st.returncode in (0, 2), st.stderr  # 2: the run already finished
    assert injected == []
    assert read_rows(run_dir), "the run over SSH produced nothing"


@pytest.mark.sshd
def test_unknown_and_changed_host_keys_are_refused_by_status_and_probe(sshd, tmp_path):
    from tests.sshd_fixtures import known_hosts_line, write_client_config, write_keypair

    unknown = tmp_path / "known_hosts_empty"
    unknown.write_text("")
    impostor = write_keypair(tmp_path / "impostor_key", "impostor")
    changed = tmp_path / "known_hosts_changed"
    changed.write_text(known_hosts_line("127.0.0.1", sshd.port, impostor))
    outcomes = {}
    for label, known in (("unknown", unknown), ("changed", changed)):
        cfg = tmp_path / f"ssh_config_{label}"
        write_client_config(cfg, alias=sshd.alias, port=sshd.port, user=sshd.user, key=sshd.client_key_path,
                            known_hosts=known)
        env = {"REGEN_SSH_CONFIG": str(cfg)}
        st = regen("status", sshd.alias, "--run-dir", str(tmp_path / "no-run"), home=tmp_path, env=env, timeout=60)
        probe = regen("probe", sshd.alias, "--only", "connection", home=tmp_path, env=env, timeout=60)
        outcomes[label] = (st, probe)
    record_figures("security_host_keys", unknown_refused=int(outcomes["unknown"][0].returncode == 2),
                   changed_refused=int(outcomes["changed"][0].returncode == 2))
    st, probe = outcomes["unknown"]
    assert st.returncode == 2 and probe.returncode == 2
    assert f"host [127.0.0.1]:{sshd.port} is not in known_hosts" in st.stderr, st.stderr
    assert "Refusing to connect to an unknown host" in st.stderr and "--accept-new" in st.stderr
    assert "host key not verified" in probe.stdout + probe.stderr
    st, probe = outcomes["changed"]
    assert st.returncode == 2 and probe.returncode == 2
    assert f"host key for [127.0.0.1]:{sshd.port} has CHANGED" in st.stderr, st.stderr
    assert "CHANGED" in probe.stdout + probe.stderr
    assert changed.read_text() == known_hosts_line("127.0.0.1", sshd.port, impostor)
