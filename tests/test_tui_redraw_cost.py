"""What the Workers tab's cheaper redraws rest on: a log tail that continues the one shown is appended, and a
table cell's render is keyed on what it shows."""
from rich.text import Text

from console.tui.panel_workers import appended
from console.tui.widgets import content_key


def test_a_tail_that_continues_the_shown_one_appends_only_its_new_lines():
    assert appended(["a", "b", "c"], ["b", "c", "d", "e"]) == ["d", "e"]
    assert appended(["a", "b"], ["a", "b"]) == []  # unchanged: nothing to write


def test_a_tail_that_does_not_continue_the_shown_one_is_written_again():
    assert appended(["a", "b"], ["x", "y"]) is None  # rotated or truncated
    assert appended([], ["x"]) is None


def test_a_cells_key_follows_its_text_and_style():
    assert content_key(Text("ready", style="green")) == content_key(Text("ready", style="green"))
    assert content_key(Text("ready", style="green")) != content_key(Text("ready", style="red"))
    assert content_key("1,379") != content_key("1,378")
