"""One SGLang server: its launch and supervision, identity proof, capacity, readings and ports."""
