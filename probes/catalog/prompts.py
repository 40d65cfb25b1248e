"""Probes of the prompt files: they exist, every row's shape, token lengths against the context.
"""
from __future__ import annotations

from typing import Any

from probes.catalog.output import (
    ScriptOutputError,
    script_error_verdict,
    script_json,
    size_text,
)
from probes.catalog.probe import Findings, JudgeInput, Verdict
from probes.context import (
    ProbeContext,
    prompt_input_limit,
)
from probes.host.candidates import candidate_words, describe, search_from_dict
from probes.model import CommandResult, Status

# ---------------------------------------------------------------------------------------------- prompts


def prompts_args(ctx: ProbeContext, mode: str) -> dict:
    args: dict[str, Any] = {"mode": mode, "patterns": list(ctx.prompts), "format": ctx.prompt_format}
    if mode in ("format", "tokens"):
        args["budget_s"] = ctx.scan_budget_s
    if mode == "tokens":
        args.update(tokenizer=ctx.tokenizer_path, enable_thinking=ctx.enable_thinking, turns=ctx.turns,
                    sample=ctx.sample_rows, ends=ctx.end_rows, longest=ctx.longest_rows)
    return args


def rows_read_words(files: list[dict], budget_s: float | None) -> tuple[str, bool]:
    """(`read 914,000 of 914,000 rows (every row)`, whether every row of every file was read)."""
    ok = [fr for fr in files if not fr.get("error")]
    read = sum(fr.get("read", 0) for fr in ok)
    rows = sum(fr.get("rows") or 0 for fr in ok)
    complete = all(fr.get("complete") for fr in ok)
    exact = all(fr.get("rows_exact") for fr in ok)
    if complete:
        return f"read {read:,} of {rows:,} rows (every row)", True
    why = sorted({fr.get("stopped") or "?" for fr in ok if not fr.get("complete")})
    budget = f" of {budget_s:g} s" if budget_s is not None and "time budget" in why else ""
    unknown = sum(1 for fr in ok if fr.get("rows") is None)
    total = f"{'' if exact else '~'}{rows:,} rows" + (f" and {unknown} file(s) of unknown rows" if unknown else "")
    return f"read {read:,} of {total} (stopped: {', '.join(why)}{budget})", False


def legacy_candidates(missing: list[dict]) -> dict:
    """The pre-finder `data.candidates` shape (files, searched, cut, ...), kept for readers of regen.probe/1."""
    searches = [m["candidates"] for m in missing if m.get("candidates")]
    files = [dict(c, similarity=c["closeness"], pattern=s["configured"]) for s in searches for c in s["candidates"]]
    return {"files": files, "total_found": sum(s["total"] for s in searches),
            "searched": list(dict.fromkeys(r for s in searches for r in s["roots"])),
            "unreadable": [u for s in searches for u in s["unlisted"]],
            "unreadable_count": sum(s["unlisted_count"] for s in searches),
            "unreadable_files": [u for s in searches for u in s["unreadable"]],
            "cut": next((s["cut"] for s in searches if s["cut"]), None)}


def missing_words(m: dict) -> str:
    """`work/chat.jsonl: cannot stat: [Errno 2] ...; best candidate: /x/work/data/prompts/chat.jsonl (...)`."""
    text = f"{m['pattern']}: {m['why']}: {m['error']}".rstrip(": ")
    search = m.get("candidates")
    if not search:
        return text
    best = search["candidates"][:1]
    if best:
        return text + "; best candidate: " + candidate_words(search_from_dict(search).candidates[0])
    return text + f"; no file named like {search['name']} found nearby"


def missing_remedy(missing: list[dict], config: str | None) -> str:
    where = f"`prompts` in {config}" if config else "`prompts` in the run config"
    best = [(m["pattern"], m["candidates"]["candidates"][0]["path"]) for m in missing
            if (m.get("candidates") or {}).get("candidates")]
    if best:
        return (f"set {where} to the best candidate (" + "; ".join(f"{p} -> {c}" for p, c in best)
                + "), or copy the files to those paths on the host")
    return f"fix {where} (the paths are read on the host), or copy the files to the host"


def judge_prompt_paths(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "prompt paths")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    files, missing = info.get("files", []), info.get("missing", [])
    expected = "every prompt path/glob names readable files: " + ", ".join(inp.ctx.prompts)
    total = sum(f.get("size") or 0 for f in files)
    if not missing:
        return Verdict(Status.PASS, f"{len(files)} file(s), {size_text(total)}: "
                       + ", ".join(f["path"] for f in files[:5]) + (" ..." if len(files) > 5 else ""),
                       expected, "\n".join(f"{f['path']} ({size_text(f.get('size'))})" for f in files),
                       data={"files": files})
    actual = []
    for m in missing:
        actual.append(f"{m['pattern']}: {m['why']}: {m['error']}".rstrip(": "))
        if m.get("candidates"):
            actual += ["  " + line for line in describe(m["candidates"])]
    return Verdict(Status.FAIL, "; ".join(missing_words(m) for m in missing), expected, "\n".join(actual),
                   remedy=missing_remedy(missing, inp.ctx.config_path),
                   data={"files": files, "missing": missing, "candidates": legacy_candidates(missing)})


def judge_prompt_format(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "prompt format")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    files = info.get("files", [])
    f = Findings()
    by_source: dict[str, int] = {}
    shapes: dict[str, int] = {}
    read = good = with_assistant = user_turns = rows = bytes_read = 0
    malformed: list[dict] = []
    malformed_total = 0
    for fr in files:
        if fr.get("error"):
            f.fail(f"{fr['path']}: {fr['error']}",
                   f"install pyarrow into {inp.ctx.python}" if fr.get("import_error") else "")
            continue
        read += fr["read"]
        good += fr["good"]
        with_assistant += fr["with_assistant"]
        user_turns += fr["user_turns"]
        rows += fr.get("rows") or 0
        bytes_read += fr.get("bytes_read") or 0
        malformed += fr["malformed"]
        malformed_total += fr["malformed_count"]
        for k, v in fr["by_source"].items():
            by_source[k] = by_source.get(k, 0) + v
        for k, v in fr["shapes"].items():
            shapes[k] = shapes.get(k, 0) + v
        if fr["read"] and not fr["good"]:
            f.fail(f"{fr['path']}: none of the {fr['read']:,} rows read is a usable conversation "
                   f"(first: {fr['malformed'][0]['where']}: {fr['malformed'][0]['reason']})",
                   "expected ShareGPT (conversations: [{from, value}]) or OpenAI (messages: [{role, content}]) rows")
        elif not fr["read"] and fr.get("complete"):
            f.warn(f"{fr['path']}: the file is empty ({fr.get('size')} bytes, no rows)")
    if files and not good and (read or all(fr.get("complete") for fr in files)) \
            and not any(fr.get("error") for fr in files):
        f.fail("no usable conversation in any prompt file")
    read_words, complete = rows_read_words(files, info.get("budget_s"))
    if malformed_total:
        f.warn(f"{malformed_total:,} malformed row(s) of the {read:,} read, e.g. "
               + "; ".join(f"{m['where']}: {m['reason']}" for m in malformed[:3]),
               "malformed rows are skipped and logged to rejects.jsonl; fix them at the source to keep them")
    if not complete and any(not fr.get("error") for fr in files):
        f.warn(f"not every row was checked: {read_words}",
               "the rows not read here are checked as the run reads them (each bad one to rejects.jsonl); "
               "`regen plan` reads every row")
    mixed = sum(v for k, v in shapes.items() if k.startswith("mixed"))
    if mixed:
        f.warn(f"{mixed} row(s) mix ShareGPT (from/value) and OpenAI (role/content) turns in one conversation")
    share = with_assistant / good if good else 0.0
    data = {"files": files, "read": read, "complete": complete, "good": good, "malformed_count": malformed_total,
            "malformed": malformed, "by_source": by_source, "shapes": shapes, "assistant_share": share,
            "rows": rows, "user_turns_mean": (user_turns / good) if good else None,
            "row_bytes_mean": (bytes_read / read) if read and bytes_read else None, "read_s": info.get("read_s")}
    actual = "\n".join(
        [f"{read_words} in " + (f"{info['read_s']:.1f} s" if info.get("read_s") is not None else "?")]
        + [f"{fr['path']}: {fr.get('format')}, "
           + (f"{fr['rows']:,} rows{'' if fr.get('rows_exact') else ' (estimated)'}" if fr.get("rows") is not None
              else "rows unknown") + ", "
         f"read {fr['read']:,}{'' if fr.get('complete') else ' (stopped: ' + str(fr.get('stopped')) + ')'}, "
         f"good {fr['good']:,}, malformed {fr['malformed_count']:,}"
         if not fr.get("error") else f"{fr['path']}: {fr['error']}" for fr in files]
        + [f"  {m['where']}: {m['reason']}" for m in malformed[:20]]
        + ([f"  ... {malformed_total - 20} more"] if malformed_total > 20 else []))
    summary = (f"{read_words} in {len(files)} file(s): {good:,} good; shapes "
               + ", ".join(f"{k} {v:,}" for k, v in shapes.items())
               + f"; {share:.0%} already have assistant answers; sources: "
               + ", ".join(f"{k} {v:,}" for k, v in sorted(by_source.items(), key=lambda kv: -kv[1])[:5]))
    return f.verdict(summary, expected=f"every row in a known shape (every row read, within {inp.ctx.scan_budget_s:g} s)",
                     actual=actual, data=data)


def judge_prompt_tokens(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "prompt tokens")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    tok = info.get("tokens") or {}
    ctx = inp.ctx
    model = inp.dep_data("model.dir")
    context = model.get("context_length") or ctx.context_length
    limit = prompt_input_limit(context) if context else None
    expected = (f"prompts under SGLang's input limit ({limit:,} tokens: context {context:,} - 6) with room for "
                f"max_new_tokens {ctx.max_new_tokens}" if limit else "prompt lengths (the context is unknown)")
    if tok.get("error"):
        remedy = f"install transformers into {ctx.python}" if tok.get("stage") == "import" else \
            "check the tokenizer files in the model dir"
        return Verdict(Status.FAIL, tok["error"], expected, tok["error"], remedy, data=tok)
    f = Findings()
    lengths = tok.pop("lengths", [])
    checked = tok.pop("checked_lengths", [])
    read_words, complete = rows_read_words(info.get("files", []), info.get("budget_s"))
    how = f"{read_words}; rendered {tok.get('checked', len(checked)):,}: {tok.get('how', '')}"
    if tok.get("template_failure_count"):
        f.warn(f"the chat template failed on {tok['template_failure_count']} rendered row(s), e.g. "
               + "; ".join(f"{x['where']}: {x['reason']}" for x in tok["template_failures"][:3]))
    if not lengths:
        f.fail("no row read could be rendered through the chat template")
        return f.verdict("", expected=expected, actual=how, data=tok)
    over = [t for t in tok.get("top", []) if limit and t["tokens"] >= limit]
    over_n = sum(1 for n in checked if limit and n >= limit)
    longest = tok.get("longest_lengths") or []
    # every one of the longest-by-characters rows is over the limit: more rows than those may be
    at_least = "at least " if limit and longest and len(longest) >= tok.get("longest_asked", 0) > 0 \
        and min(longest) >= limit else ""
    p50, p99 = tok["p50"], tok["p99"]
    if limit:
        if p50 >= limit:
            f.fail(f"half the prompts are over SGLang's input limit {limit:,} (context {context:,}; p50 {p50:,})",
                   "raise context_length (if the model allows it) or filter the prompts")
        elif over_n:
            rows_read = sum(fr.get("read", 0) for fr in info.get("files", []) if not fr.get("error"))
            f.warn(f"{at_least}{over_n:,} prompt(s) over SGLang's input limit of {limit:,} tokens (context "
                   f"{context:,}), found among {len(checked):,} rendered of {rows_read:,} rows read (the longest by "
                   "characters included): those turns are rejected, not generated, each to rejects.jsonl; e.g. "
                   + ", ".join(f"{t['where']} ({t['tokens']:,} tokens)" for t in over[:3]),
                   "filter those rows out of the prompt files to keep the counts true, or raise context_length (a "
                   "model whose context allows it)")
        elif ctx.max_new_tokens and p99 + ctx.max_new_tokens > context:
            f.warn(f"p99 prompt {p99} + max_new_tokens {ctx.max_new_tokens} > context {context}: long answers will be "
                   "cut at the context length (finish_reason length)")
    if not complete:
        f.warn(f"not every row was read: {read_words}",
               "the rows not read here are checked as the run reads them (an over-long prompt is a reject); "
               "`regen plan` reads every row")
    tok.update(context_length=context, input_limit=limit, over_context=over_n, over_examples=over[:10],
               read_words=read_words, complete=complete)
    return f.verdict(f"prompt tokens p50 {p50} / p90 {tok['p90']} / p99 {p99} / max {tok['max']} over {len(lengths)} "
                     f"rows spread over the file(s) and the {len(longest)} longest; {read_words}; context {context}",
                     expected=expected,
                     actual=f"p50 {p50}, p90 {tok['p90']}, p99 {p99}, max {tok['max']}, mean {tok['mean']:.0f}\n{how}"
                     + "".join(f"\n  {t['where']}: {t['tokens']:,} tokens" for t in tok.get("top", [])[:5]),
                     data=tok)
