"""The supervisor on the training host: main.py (the process), supervisor.py (the run) and its parts."""
