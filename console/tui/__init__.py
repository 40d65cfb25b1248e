"""The operations console (Textual): app.py has RegenApp (its parts in app_*.py) and run_tui; one module per panel."""
