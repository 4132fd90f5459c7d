"""The help layout, argument checks and message wording shared by the project's command lines (data
stages, training, export)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def plural(count: int, noun: str) -> str:
    """"1 shard", "2 shards"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the module docstring as written and appends each option's default to its help.

    Like argparse.ArgumentDefaultsHelpFormatter, except that it leaves out defaults that say
    nothing (None, and the on/off state of a switch) and help that already names its default.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS)
                or "%(default)" in text):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _int_at_least(text: str, least: int) -> int:
    value = int(text)
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def given_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations of the options that `argv` names, whatever their values. A check that an option does
    not apply must refuse it given at its default value too ("--vocab_size 30522" beside a given vocab),
    which comparing the parsed value with the default lets through. argparse fills in a default only where
    the namespace lacks the attribute, so the options still holding the marker were not given."""
    unset = object()
    dests = vars(parser.parse_args(argv))
    probe = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, unset)))
    return {dest for dest, value in vars(probe).items() if value is not unset}


def file_in_the_way(path: Path) -> Path | None:
    """The file that stands where the directory `path`, or one above it, would be (None if there is none)."""
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity mask, which a cpuset cgroup, Slurm allocation or taskset narrows,
    not os.cpu_count()'s every CPU of the machine (128 workers on a node where the job was given 4)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def add_workers_argument(
    parser: argparse.ArgumentParser,
    help: str = "worker processes (default: the cores this process may use, %(default)s here); the output does "
                "not depend on it",
) -> None:
    parser.add_argument("--workers", type=positive_int, default=usable_cores(), help=help)
