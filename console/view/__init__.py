"""What the operator sees, without Textual: the view model the TUI and the CLI both read, and the text of each figure."""
