"""A real second process that holds an SSD table open (its lock), for the lock tests of every
backend."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

_HOLDER = """
import sys
import ssd_backend
store = getattr(ssd_backend, sys.argv[1])(sys.argv[2], None, lambda ids, out, rows=None: out.zero_() if rows is None else out.index_fill_(0, rows, 0.0), None)
print("open", flush=True)
sys.stdin.readline()
store.close()
"""


@contextlib.contextmanager
def held_by_another_process(store_class: str, path):
    """While the block runs, a child process has the table at path open with
    ssd_backend.<store_class>; it closes it, and exits 0, when the block ends."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, store_class, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "open"
        yield
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.returncode == 0
