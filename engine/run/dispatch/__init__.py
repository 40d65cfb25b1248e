"""Sends work items to the SGLang servers and turns each answer into one outcome (the Dispatcher is in loop.py)."""
