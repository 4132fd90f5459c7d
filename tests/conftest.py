"""Shared fixtures: the real inputs in ../shared/data and a distributed environment for in-process DeepSpeed."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# DeepSpeed picks the CPU accelerator here; say so, so it does not warn on every import.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: the tests read real inputs from ../shared/data beside the checkout")
    return path


@pytest.fixture(scope="session")
def sample_dump() -> Path:
    """A real, shortened English Wikipedia dump (206 pages)."""
    return _shared_file("enwiki-sample-pages-articles.xml.bz2")


@pytest.fixture(scope="session")
def bert_vocab() -> Path:
    """The standard 30,522-token BERT uncased vocabulary."""
    return _shared_file("bert-base-uncased-vocab.txt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
