"""Export a run's shards to the files drafter trainers read (SpecForge, speculators, NeMo Automodel, ModelOpt, HF).

One line: source (committed parts, in input order) -> filters (counted per reason) -> one writer per format
-> a manifest beside the files; verify re-checks an export against its manifest; run.export_run composes them.
"""
