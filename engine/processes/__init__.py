"""Spawning the scheduler and detokenizer, readiness over a pipe, and dying with the parent."""
