"""The detokenizer process: token ids in, incremental UTF-8-safe text out, one batch decode per message."""
