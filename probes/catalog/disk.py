"""Probes of free disk: $HOME, the run dir (against the run's estimated output), /dev/shm.
"""
from __future__ import annotations

from typing import Any, Callable

from probes.catalog.output import (
    gib,
    shell_failure,
    size_text,
)
from probes.catalog.probe import Findings, JudgeInput, Verdict
from probes.model import CommandResult, Status
from probes.shell import shell_path

OUTPUT_TOKENS_GUESS = 2048  # per sample, for the disk estimate (Qwen3 thinking answers average ~1.4K)
BYTES_PER_TOKEN = 6  # input_ids int32 + loss_mask uint8 + the decoded text, after zstd


# ---------------------------------------------------------------------------------------------- disk


def df_command(path: str) -> str:
    """df of the nearest existing parent of `path` (the run dir need not exist yet)."""
    return (
        f"p={shell_path(path)}; while [ ! -e \"$p\" ]; do p=$(dirname -- \"$p\"); done; "
        "printf 'path=%s\\n' \"$p\"; if [ -w \"$p\" ]; then echo writable=yes; else echo writable=no; fi; "
        "df -Pk -- \"$p\""
    )


def parse_df(res: CommandResult) -> dict:
    info: dict[str, Any] = {}
    lines = res.stdout.splitlines()
    for line in lines:
        if line.startswith("path="):
            info["path"] = line[5:]
        elif line.startswith("writable="):
            info["writable"] = line.endswith("yes")
    table = [ln for ln in lines if not ln.startswith(("path=", "writable="))]
    if len(table) >= 2:
        cells = table[-1].split()
        if len(cells) >= 6:
            info.update(filesystem=cells[0], total=int(cells[1]) * 1024, used=int(cells[2]) * 1024,
                        free=int(cells[3]) * 1024, mount=" ".join(cells[5:]))
    return info


def estimate_run_bytes(inp: JudgeInput) -> tuple[int | None, str]:
    """Projected shard bytes from the prompt count (prompts.format) and prompt lengths (prompts.tokens)."""
    if inp.ctx.disk_need_bytes is not None:
        return inp.ctx.disk_need_bytes, "from the caller's projection"
    fmt = inp.dep_data("prompts.format")
    if not fmt.get("rows"):
        return None, "unknown: prompts.format reported no row count"
    rows = fmt["rows"]
    turns = fmt.get("user_turns_mean") or 1.0 if inp.ctx.turns == "all" else 1.0
    prompt_tokens = inp.dep_data("prompts.tokens").get("mean") or (fmt.get("row_bytes_mean") or 2000) / 4
    out_tokens = min(inp.ctx.max_new_tokens or OUTPUT_TOKENS_GUESS, OUTPUT_TOKENS_GUESS)
    samples = rows * turns
    need = int(samples * (prompt_tokens + out_tokens) * BYTES_PER_TOKEN)
    return need, (f"estimate: {rows} rows x {turns:.2f} turns x ({prompt_tokens:.0f} prompt + {out_tokens} output tokens) "
                  f"x {BYTES_PER_TOKEN} B/token")


def disk_judge(kind: str) -> Callable[[CommandResult, JudgeInput], Verdict]:
    def judge(res: CommandResult, inp: JudgeInput) -> Verdict:
        if res.exit_status != 0:
            return Verdict(Status.FAIL, shell_failure(res, "df"), actual=res.stderr.strip(),
                           remedy="check the path and that df exists on the host")
        info = parse_df(res)
        if "free" not in info:
            return Verdict(Status.ERROR, "could not parse df output", actual=res.stdout)
        ctx = inp.ctx
        if kind == "shm":
            need, how = ctx.shm_need_bytes, f"{gib(ctx.shm_need_bytes)} (1 GiB per GPU for NCCL and torch shared memory)"
            remedy = "enlarge /dev/shm: docker run --shm-size=32g, or mount -o remount,size=32G /dev/shm"
        else:
            projected, how = estimate_run_bytes(inp) if kind == "run_dir" else (None, "no run configured")
            need = ctx.disk_floor_bytes + (projected or 0)
            how = f"{size_text(need)} = the {size_text(ctx.disk_floor_bytes)} alert floor + projected shards " \
                  f"{size_text(projected)} ({how})"
            remedy = "free space on that filesystem or choose a run_dir on a bigger one"
        f = Findings()
        where = f"{info['path']} ({info['filesystem']} on {info['mount']})"
        if kind != "shm" and info.get("writable") is False:
            f.fail(f"{info['path']} is not writable by this user", "choose a run_dir the SSH user can write")
        if info["free"] < need:
            f.fail(f"{size_text(info['free'])} free at {where}, below the need of {size_text(need)}", remedy)
        elif info["free"] < 2 * need:
            f.warn(f"{size_text(info['free'])} free at {where}, less than 2x the need of {size_text(need)}", remedy)
        return f.verdict(f"{size_text(info['free'])} free of {size_text(info['total'])} at {where}; need {size_text(need)}",
                         expected=f"free >= {how}", actual=f"{size_text(info['free'])} free",
                         data=dict(info, need=need, need_basis=how))

    return judge
