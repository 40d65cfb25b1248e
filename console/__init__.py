"""The operator's side of regen: the CLI (commands), the TUI (tui), reaching a host (host), what is shown (view)."""
