"""Export a run's shards to the files drafter trainers read (SpecForge, speculators, NeMo Automodel, ModelOpt, HF).

One line through the modules: source (a consistent snapshot of the committed parts, shard by shard in
input order) -> filters (what a trainer should not see, counted per reason) -> one writer per format
(tokens_jsonl, hf, conversations) into files (split, hashed) -> a manifest beside them (engine.store.manifest);
verify re-checks an export against its manifest. run.export_run composes them.
"""
