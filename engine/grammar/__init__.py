"""Structured output: constraints (user side), grammar backends, and the scheduler's part."""
