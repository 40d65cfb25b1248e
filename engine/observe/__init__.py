"""Observation of a run: the status shape built live or offline, the Prometheus metrics server, the disk and rate watch."""
