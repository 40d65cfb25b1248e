"""Disk full on the run dir (a small tmpfs): dispatch pauses with an alert before a partial write,
nothing committed is damaged, and the run resumes and completes when space returns.

Each case holds the run back while the fault is put in place: its last shard is paused as soon as the
run is running, so however fast the machine, the run cannot end before the disk is full (a run with
paused work left waits, state "paused"); the shard is resumed once space has returned. No case waits a
fixed time: "the supervisor lives on a full disk" is the supervisor answering, with its disk guard's
reading of the full disk, for FULL_DISK_S of its own ticks."""
from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from engine.api.control_socket import request
from tests.run_helpers import events, make_config, quick_state, record_figures, sample_accounting, wait_for
from tests.run_helpers import renderer_for, supervisors  # noqa: F401  (fixtures)

MOUNT_MB = 24
MIN_FREE_MB = 8  # alerts.disk_free_min_gb, in MiB: dispatch pauses under it
FULL_DISK_S = 5.0  # how long the supervisor must keep going on a full disk


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={MOUNT_MB}m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the disk-full case (needs root / CAP_SYS_ADMIN): "
                    f"mount exited {r.returncode}: {r.stderr.strip()}")
    yield mnt
    u = subprocess.run(["umount", "-l", str(mnt)], capture_output=True, text=True)
    assert u.returncode == 0, f"umount {mnt}: {u.stderr}"


def _free(path: Path) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


def _fill(path: Path, leave_bytes: int) -> int:
    """Write a filler file until only `leave_bytes` are free (0: until ENOSPC). Returns bytes written."""
    written = 0
    chunk = b"\0" * (256 * 1024)
    with open(path, "ab") as f:
        while True:
            room = _free(path.parent) - leave_bytes
            if room <= 0:
                break
            try:
                written += f.write(chunk[: min(len(chunk), room)])
                f.flush()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    return written


def _status(run_dir: Path) -> dict:
    try:
        return request(run_dir / "control.sock", {"op": "status"}, timeout=10).get("result") or {}
    except OSError:
        return {}


def _hold_last_shard(run_dir: Path, sup) -> str:
    """Pause the last shard as soon as the run is running: the run cannot end while it is paused."""
    wait_for(lambda: quick_state(run_dir) == "running", 90, "a running supervisor", sup)
    shards = _status(run_dir).get("shards") or []
    assert shards, "a running supervisor with no shards"
    held = shards[-1]["id"]
    reply = request(run_dir / "control.sock", {"op": "pause", "shards": [held]}, timeout=10)
    assert reply.get("ok"), reply
    shard = {s["id"]: s for s in _status(run_dir)["shards"]}[held]
    assert shard["state"] == "paused" and shard["done"] < shard["total"], shard
    return held


def _release(run_dir: Path, held: str) -> None:
    reply = request(run_dir / "control.sock", {"op": "resume", "shards": [held]}, timeout=10)
    assert reply.get("ok"), reply


def _run_disk(st: dict, run_dir: Path) -> dict | None:
    """The disk guard's last reading of the run dir's filesystem, from a status reply."""
    return next((d for d in st.get("disk") or [] if os.path.realpath(d.get("path", "")) == os.path.realpath(run_dir)),
                None)


def _lived_on_full_disk(run_dir: Path, sup, since: float, what: str) -> dict:
    """Wait until the supervisor has answered with its guard reading the full disk for FULL_DISK_S."""
    def seen():
        st = _status(run_dir)
        disk = _run_disk(st, run_dir)
        return st if (disk and disk["free_bytes"] < 2**20 and disk["ts"] >= since + FULL_DISK_S
                      and (st.get("dispatch") or {}).get("in_flight", 1) == 0) else None
    return wait_for(seen, 60 + FULL_DISK_S, what, sup)


def _parts_readable(run_dir: Path) -> tuple[int, int]:
    ok = bad = 0
    for f in (run_dir / "shards").rglob("*.parquet"):
        try:
            pq.read_table(f)
            ok += 1
        except Exception as exc:  # noqa: BLE001 - counted and shown
            print(f"unreadable {f}: {exc!r}")
            bad += 1
    return ok, bad


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_disk_full_pauses_dispatch_keeps_parts_whole_and_resumes(small_disk, tiny_model_dir, supervisors,
                                                                  renderer_for):
    run_dir = small_disk / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=100, gpus=1,
                      sim=("--sim-output-mean", "80", "--sim-step-ms", "6", "--max-running-requests", "8"))
    cfg = cfg.model_copy(update=dict(alerts=cfg.alerts.model_copy(update=dict(disk_free_min_gb=MIN_FREE_MB / 1024))))
    sup = supervisors(run_dir).start(cfg)
    held = _hold_last_shard(run_dir, sup)
    wait_for(lambda: (_status(run_dir).get("dispatch") or {}).get("done", 0) > 5, 90,
             "commits on the shards not held", sup)

    # 1. below the threshold: dispatch pauses with a critical alert
    filler = small_disk / "filler.bin"
    filled_at = time.time()
    _fill(filler, leave_bytes=3 * 2**20)
    st = wait_for(lambda: (lambda s: s if (s.get("dispatch") or {}).get("state") == "disk_full" else None)(
        _status(run_dir)), 30, "dispatch paused for the disk", sup)
    paused_after = time.time() - filled_at
    assert st["state"] == "paused"
    done_when_paused = st["dispatch"]["done"]
    wait_for(lambda: _status(run_dir).get("dispatch", {}).get("in_flight", 1) == 0, 60, "in-flight drained", sup)

    # 2. completely full (ENOSPC for any write): the supervisor lives on, nothing committed is damaged
    full_at = time.time()
    _fill(small_disk / "filler2.bin", leave_bytes=0)
    still = _lived_on_full_disk(run_dir, sup, full_at, f"{FULL_DISK_S:g} s of the supervisor on a full disk")
    assert still.get("state") == "paused", still.get("state")  # held: not ended, not failed
    assert sup.proc.poll() is None, sup.log_text()[-3000:] if _free(small_disk) else "supervisor died on a full disk"
    ok_full, bad_full = _parts_readable(run_dir)

    # 3. space returns: dispatch resumes and the run completes
    (small_disk / "filler2.bin").unlink()
    filler.unlink()
    _release(run_dir, held)
    assert sup.wait(150) == 0, sup.log_text()[-3000:]
    evs = events(run_dir)
    low = [e for e in evs if e["type"] == "alert" and e["key"] == "disk-low"]
    acc = sample_accounting(run_dir, cfg, renderer_for(cfg))
    ok_end, bad_end = _parts_readable(run_dir)
    record_figures("disk_full", faults_injected=2, survived=int(acc["lost"] == 0), pause_detected_s=round(paused_after, 2),
                   done_when_paused=done_when_paused, parts_readable_while_full=ok_full,
                   parts_unreadable=bad_full + bad_end, samples_lost=acc["lost"], samples_duplicated=acc["duplicated"],
                   alerts=[e["text"] for e in low])
    assert low and low[0]["severity"] == "critical" and "dispatch paused" in low[0]["text"]
    assert " MiB free under " in low[0]["text"], low[0]["text"]  # not "0.0 GiB"
    assert any(e["severity"] == "info" and e["text"].startswith("cleared") for e in low), "no resume alert"
    assert bad_full == bad_end == 0
    assert acc["lost"] == acc["duplicated"] == 0, acc["lost_ids"]
    assert [e for e in evs if e["type"] == "dispatch"][-1]["state"] == "done"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sudden_enospc_mid_commit_keeps_rows_and_parts_whole(small_disk, tiny_model_dir, supervisors, renderer_for):
    """The disk fills at once (no time for the free-space guard's tick): commits fail with ENOSPC,
    the rows stay in memory with an alert, no partial file is left, and all is committed once space returns."""
    run_dir = small_disk / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=100, gpus=1,
                      sim=("--sim-output-mean", "80", "--sim-step-ms", "6", "--max-running-requests", "8"))
    cfg = cfg.model_copy(update=dict(alerts=cfg.alerts.model_copy(update=dict(disk_free_min_gb=MIN_FREE_MB / 1024))))
    sup = supervisors(run_dir).start(cfg)
    held = _hold_last_shard(run_dir, sup)
    wait_for(lambda: (_status(run_dir).get("dispatch") or {}).get("done", 0) > 5, 90,
             "commits on the shards not held", sup)
    filler = small_disk / "filler.bin"
    full_at = time.time()
    _fill(filler, leave_bytes=0)
    # the held shard keeps the run from ending; the answers in flight when the disk filled have come back
    still = _lived_on_full_disk(run_dir, sup, full_at, f"{FULL_DISK_S:g} s of the supervisor on a full disk")
    alive = sup.proc.poll() is None
    ok_full, bad_full = _parts_readable(run_dir)
    leftovers = [str(p) for p in (run_dir / "shards").rglob("*.tmp")]
    filler.unlink()
    assert alive, "the supervisor died when the disk filled up"
    assert still.get("state") == "paused", still.get("state")  # held: not ended, not failed
    _release(run_dir, held)
    assert sup.wait(150) == 0, sup.log_text()[-3000:]
    evs = events(run_dir)
    commit_alerts = [e for e in evs if e["type"] == "alert" and e["key"].startswith("commit:")]
    acc = sample_accounting(run_dir, cfg, renderer_for(cfg))
    ok_end, bad_end = _parts_readable(run_dir)
    record_figures("disk_enospc", faults_injected=1, survived=int(acc["lost"] == 0 and alive),
                   commit_failures_alerted=len(commit_alerts), parts_readable_while_full=ok_full,
                   tmp_files_left_while_full=len(leftovers), parts_unreadable=bad_full + bad_end,
                   samples_lost=acc["lost"], samples_duplicated=acc["duplicated"])
    assert bad_full == bad_end == 0
    assert acc["lost"] == acc["duplicated"] == 0, acc["lost_ids"]
    assert [e for e in evs if e["type"] == "dispatch"][-1]["state"] == "done"
    # the full disk is on screen: a failed commit's alert, or the free-space guard's when it saw it first
    disk_low = [e for e in evs if e["type"] == "alert" and e["key"] == "disk-low" and e["severity"] != "info"]
    assert commit_alerts or disk_low, "the disk filled up and no alert said so"
    for alert in commit_alerts:  # the disk runs out at the part's write (ENOSPC) or at sqlite's (its own words)
        assert ("No space left on device" in alert["text"] or "database or disk is full" in alert["text"]) \
            and "rows kept in memory" in alert["evidence"], alert
    assert not list((run_dir / "shards").rglob("*.tmp")), "a partial part file was left behind"
