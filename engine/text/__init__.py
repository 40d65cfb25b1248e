"""From prompt rows to token ids and back: ingest, chat-template rendering, byte-level decoding, answer shape."""
