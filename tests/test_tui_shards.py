"""The Shards tab at 10,000 shards under Pilot: filter, sort, jump, pause/resume a selection and a filter."""
from __future__ import annotations

from rich.console import Console

from console.tui.app import RegenApp
from console.tui.app_control import CONTROL_CHUNK
from console.tui.app_follow import FULL_STATUS_EVERY_S
from console.view.shard_list import has_problem
from console.tui.shard_table import COLUMNS, ShardTable, tokens_text
from tests.shard_fixtures import SHARDS, T0, ShardsSource
from tests.test_tui_app import wait_until

SIZE = (120, 40)


def make_app() -> tuple[RegenApp, ShardsSource]:
    source = ShardsSource()
    return RegenApp(source, clock=lambda: T0 + 5, monotonic=lambda: 1000.0, live=False,
                    run_probes_on_start=False), source


def rows_on_screen(table: ShardTable) -> list[dict[str, str]]:
    """The rows as drawn (the table's own lines), cut into their columns."""
    rows = []
    for y in range(1, table.size.height):
        text, pos, row = table.render_line(y).text, 0, {}
        for title, width, _ in COLUMNS:
            row[title or "mark"] = text[pos:pos + width].strip()
            pos += width + 1
        if row["shard"]:
            rows.append(row)
    return rows


def summary(app: RegenApp) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    console.print(app.query_one("#shards-summary").content)
    return " ".join(console.export_text().split())


async def shards_tab(pilot, app: RegenApp) -> ShardTable:
    await pilot.press("3")
    table = app.query_one("#shards-table", ShardTable)
    await wait_until(pilot, lambda: table.row_count == SHARDS and rows_on_screen(table)[0]["mark"] == "!",
                     "10,000 shard rows drawn")
    return table


async def test_filter_cycles_through_states_and_the_summary_counts_them():
    app, source = make_app()
    running = sorted(s.id for s in source.shards.values() if s.state == "running")
    async with app.run_test(size=SIZE) as pilot:
        table = await shards_tab(pilot, app)
        assert "10,000 shards: 1,000 done · 93 running · 8,880 pending · 27 paused" in summary(app)
        assert "⚑ 28 with problems" in summary(app) and "showing all (10,000), sorted by id" in summary(app)
        await pilot.press("f")
        await wait_until(pilot, lambda: table.row_count == len(running), "only the running shards listed")
        assert [r["shard"] for r in rows_on_screen(table)] == running[:len(rows_on_screen(table))]
        assert all(r["state"] == "running" for r in rows_on_screen(table))
        assert f"showing running ({len(running)})" in summary(app)
        await pilot.press("f", "f", "f", "f")  # paused, pending, done, problems
        problems = sorted(s.id for s in app.model.shards.values() if has_problem(s, app.model.levels))
        await wait_until(pilot, lambda: table.row_count == len(problems) == 28, "the shards with problems")
        assert [r["shard"] for r in rows_on_screen(table)] == problems
        await pilot.press("f")
        await wait_until(pilot, lambda: table.row_count == SHARDS, "all shards again")


async def test_sort_by_empty_share_puts_the_worst_on_top():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        table = await shards_tab(pilot, app)
        await pilot.press("s")
        await wait_until(pilot, lambda: "sorted by progress" in summary(app), "sorted by progress")
        assert rows_on_screen(table)[0]["progress"] == "░░░░░░░░░░░░   0.0%"
        await pilot.press("s")
        await wait_until(pilot, lambda: "sorted by empty share" in summary(app), "sorted by empty share")
        rows = rows_on_screen(table)
        assert rows[0]["empty %"] == "50.0%"  # 1 of 2 empty: the most there is
        shares = [app.model.shards[r["shard"]].empty_share for r in rows]
        assert shares == sorted(shares, reverse=True)


async def test_n_jumps_to_the_next_shard_with_a_problem_and_wraps():
    app, _ = make_app()
    async with app.run_test(size=SIZE) as pilot:
        table = await shards_tab(pilot, app)
        problems = sorted(s.id for s in app.model.shards.values() if has_problem(s, app.model.levels))
        seen = []
        for _ in range(len(problems) + 1):
            await pilot.press("n")
            seen.append(app.panel("shards").selected_shard)
        assert seen == [*problems[1:], problems[0], problems[1]]  # the cursor starts on s00000, a problem
        # the cursor's row is scrolled into view
        row = table.cursor_row
        assert table.scroll_offset.y <= row < table.scroll_offset.y + table.size.height - 1
        assert rows_on_screen(table)[row - table.scroll_offset.y]["shard"] == problems[1]


async def test_pause_and_resume_a_selection_then_a_whole_filter():
    app, source = make_app()
    async with app.run_test(size=SIZE) as pilot:
        table = await shards_tab(pilot, app)
        await pilot.press("f")  # running
        await wait_until(pilot, lambda: table.row_count == 93, "the running shards")
        picked = [table.shards.id_at(0), table.shards.id_at(1)]
        await pilot.press("space", "space")  # space toggles in place: selected, then not
        assert [r["mark"] for r in rows_on_screen(table)[:3]] == ["", "", ""]
        await pilot.press("space", "down", "space")
        assert table.cursor_row == 1
        assert [r["mark"] for r in rows_on_screen(table)[:3]] == ["●", "●", ""]
        assert "2 selected" in summary(app)
        await pilot.press("p")
        await wait_until(pilot, lambda: source.requests == [("pause", picked)], "the pause of the selection sent")
        # the status reply says they are paused: they leave the running filter, and show paused under "paused"
        await wait_until(pilot, lambda: table.row_count == 91, "the paused shards gone from the running list")
        assert all(table.cells(sid)["state"] == "⏸ paused" for sid in picked)
        await pilot.press("f")
        await wait_until(pilot, lambda: "showing paused (29)" in summary(app), "29 paused")
        on_screen = {r["shard"]: r for r in rows_on_screen(table)}
        assert all(on_screen[sid]["mark"] == "●" and on_screen[sid]["state"] == "⏸ paused" for sid in picked)
        await pilot.press("r")
        await wait_until(pilot, lambda: source.requests[-1] == ("resume", picked), "the resume of the selection sent")
        await wait_until(pilot, lambda: "showing paused (27)" in summary(app), "27 paused again")
        await pilot.press("c", "f")  # clear the selection; paused -> pending
        await wait_until(pilot, lambda: "showing pending" in summary(app), "the pending filter")
        pending = table.shards.ids()
        await pilot.press("a", "p")  # every shard the filter lists: more than one control command's worth
        await wait_until(pilot, lambda: len(source.requests) == 2 + -(-len(pending) // CONTROL_CHUNK),
                         "the pause of the whole filter sent in chunks")
        sent = [sid for op, ids in source.requests[2:] for sid in ids]
        assert sent == pending and all(op == "pause" for op, _ in source.requests[2:])
        await wait_until(pilot, lambda: table.row_count == 0 and "running · 0 pending ·" in summary(app), "no pending shard left")


async def test_the_command_palette_actions_reach_the_shards_tab():
    app, source = make_app()
    async with app.run_test(size=SIZE) as pilot:
        table = await shards_tab(pilot, app)
        await pilot.press("2")
        await app.run_action("shards('cycle_filter')")
        await wait_until(pilot, lambda: app.active_tab == "shards" and table.row_count == 93, "running, shown")
        running = table.shards.ids()
        await app.run_action("shards('select_listed')")
        await app.run_action("pause_shard")
        await wait_until(pilot, lambda: source.requests == [("pause", running)], "the pause of the 93 running shards")
        await app.run_action("shards('clear_selection')")
        await wait_until(pilot, lambda: "selected" not in summary(app), "the selection cleared")


async def test_the_periodic_status_leaves_the_shard_list_out_but_a_full_one_comes_every_five_minutes():
    source = ShardsSource()
    now = [1000.0]
    app = RegenApp(source, clock=lambda: T0 + 5, monotonic=lambda: now[0], live=False, run_probes_on_start=False)
    async with app.run_test(size=SIZE) as pilot:
        table = await shards_tab(pilot, app)  # the follower's status at connect: the whole of it
        assert source.status_asked == [True]
        app.poll_status()
        await wait_until(pilot, lambda: len(source.status_asked) == 2, "a periodic status")
        assert source.status_asked[1] is False
        await pilot.pause()
        assert table.row_count == SHARDS and app.model.shards["s00000"].state == "done"  # the list stays as it was
        now[0] += FULL_STATUS_EVERY_S
        app.poll_status()
        await wait_until(pilot, lambda: len(source.status_asked) == 3, "the next periodic status")
        assert source.status_asked[2] is True


async def test_at_80_columns_the_bar_goes_and_every_figure_stays_whole():
    app, source = make_app()
    async with app.run_test(size=(80, 30)) as pilot:
        await pilot.press("3")
        table = app.query_one("#shards-table", ShardTable)
        await wait_until(pilot, lambda: table.row_count == SHARDS and table.narrow, "the narrow table drawn")
        assert table.render_line(0).text.split() == ["shard", "state", "done", "samples", "tokens", "empty", "%",
                                                     "trunc", "%", "loops"]
        lines = [table.render_line(y).text for y in range(1, table.size.height)]
        assert len(lines[0].rstrip()) <= 80 and not any("…" in ln for ln in lines)
        first = next(s for s in source.shards.values() if s.id in lines[0])
        assert f"{first.done}/{first.total}" in lines[0] and f"{first.output_tokens:,}" in lines[0]


def test_a_token_count_that_does_not_fit_its_column_is_abbreviated_not_cut():
    assert tokens_text(987_654, 9) == "987,654" and tokens_text(12_345_678, 9) == "12.3M"
    assert tokens_text(12_345_678, 13) == "12,345,678" and len(tokens_text(98_765_432_100, 9)) <= 9
