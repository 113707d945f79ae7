"""Checks the workloads share on their arguments: p.error (exit code 2) before anything runs."""

from __future__ import annotations

import argparse

TORCH_DTYPES = ("float32", "bfloat16")  # the dtypes the transformers baselines run in


def at_least_one(p: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Refuse any of the named integer arguments below 1."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")


def torch_dtype(p: argparse.ArgumentParser, flag: str, value: str) -> None:
    """Refuse a dtype the transformers baselines do not run in."""
    if value not in TORCH_DTYPES:
        p.error(f"{flag} must be one of {sorted(TORCH_DTYPES)}, got {value!r}")


def batch_sizes(p: argparse.ArgumentParser, flag: str, value: str) -> None:
    """Refuse a comma-separated list that is not all positive integers."""
    if not all(b.strip().isdigit() and int(b) >= 1 for b in value.split(",")):
        p.error(f"{flag} must list positive integers, got {value!r}")
