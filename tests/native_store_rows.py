"""Rows and helpers shared by the native SSD store tests (test_ssd_slots.py, test_ssd_log.py,
test_ssd_read_to.py): a small table whose rows and initial values are easy to recognize."""

from __future__ import annotations

import os

import pytest
import torch

WIDTH = 12
N = 5000
META = {"num_embeddings": N, "embedding_dim": 4, "seed": 3, "optimizer": "adagrad"}


def init_rows(ids: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """The initializer contract: the initial rows of ids into out, or into out[rows]."""
    values = -(ids[:, None].float() + torch.arange(WIDTH) / 100)
    if rows is None:
        out.copy_(values)
    else:
        out[rows] = values


def rows_for(ids: torch.Tensor, tag: float = 0.0) -> torch.Tensor:
    return ids[:, None].float() + torch.arange(WIDTH) / 16 + tag


def read(store, ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty(len(ids), store.width)
    store.read(ids, out)
    return out


def o_direct_or_skip(path) -> None:
    """Skips the test when the filesystem of path (a directory) refuses O_DIRECT (e.g. tmpfs)."""
    probe = path / "o_direct_probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT")
    finally:
        probe.unlink()
