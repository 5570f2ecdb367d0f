"""A process that exits with writes still queued for the SSD tier exits cleanly (RocksDB's
write queue; the slot file, whose writes are synchronous, must exit cleanly too).

Regression: the writer was a daemon thread; when the interpreter finalized while it was inside a
native write, its forced exit aborted the process ("terminate called without an active
exception"). Writers are now stopped at exit, before finalization."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch, ssd_backend
    meta = {"num_embeddings": 1_000_000, "embedding_dim": 128, "width": 129, "dtype": "float32",
            "seed": 0, "optimizer": None, "init": None}
    opts = {"write_queue_rows": 1 << 20} if sys.argv[2] == "rocksdb" else {}
    store = ssd_backend.open_store(sys.argv[1], 129, lambda ids, out, rows=None: out.zero_(), meta,
                                   {"backend": sys.argv[2], **opts})
    for k in range(8):
        ids = torch.arange(k * 100_000, (k + 1) * 100_000)
        store.write(ids, torch.ones(len(ids), 129))
    print("exiting with a full queue", flush=True)
""")


@pytest.mark.parametrize("backend", ["slots", "log", "rocksdb"])
def test_exit_with_queued_writes_is_clean(tmp_path, backend):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "t"), backend], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "terminate" not in r.stderr
    assert "exiting with a full queue" in r.stdout
