"""The operations console (Textual): app.py has RegenApp and run_tui; model.py the data model."""
