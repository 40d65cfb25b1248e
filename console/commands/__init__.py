"""One module per `regen` command: its arguments, its run, its output and exit status."""
