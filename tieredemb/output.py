"""Files that the commands write (traces, exports, plans, plots): each is written beside its
destination and moved into place only once whole, so a command that fails leaves the destination
as it was (an existing file untouched, no partial file) and a reader never sees half a file.
A destination that is a stream (a pipe, a FIFO, a terminal, /dev/stdout however redirected) gets
the whole file copied into it once written: through the inherited descriptor for /dev/stdout,
/dev/fd/N and the like (so `>> file` appends), else by opening the path for writing."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import sys
import tempfile

_INHERITED = re.compile(r"/dev/(stdout|stderr|fd/(\d+))|/proc/self/fd/(\d+)")


def _inherited_fd(path: str) -> int | None:
    """The descriptor a path such as /dev/stdout names (the process's own), or None."""
    m = _INHERITED.fullmatch(os.path.abspath(path))
    if m is None:
        return None
    return {"stdout": 1, "stderr": 2}.get(m.group(1)) or int(m.group(2) or m.group(3))


def status_stream(*paths):
    """Where a command's own messages go: stderr when one of its outputs is its stdout (so the output
    stays whole, e.g. `--json /dev/stdout | jq`), else stdout."""
    return sys.stderr if any(p is not None and _inherited_fd(os.fspath(p)) == 1 for p in paths) else sys.stdout


class PendingFile:
    """A new file for `path`, written at `temp` (a hidden name in path's directory): commit()
    replaces path by it (os.replace), discard() removes it; as a context manager, leaving the
    block commits, leaving it by an exception discards. Raises OSError naming `path` when its
    directory cannot take a new file (missing, not writable) or path is a directory. A stream
    (see above) is written whole at temp in the temporary directory, then copied into it."""

    def __init__(self, path):
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            raise IsADirectoryError(21, "Is a directory", self.path)
        self._fd = _inherited_fd(self.path)
        self._stream = self._fd is not None or (
            os.path.exists(self.path) and not stat.S_ISREG(os.stat(self.path).st_mode))
        if self._stream:  # (written whole in a temporary file, then copied into the stream at commit)
            handle, self.temp = tempfile.mkstemp(prefix=".partial-", suffix="." + os.path.basename(self.path))
            os.close(handle)
            return
        # (through a symbolic link: the file it names is replaced, not the link)
        target = os.path.realpath(self.path) if os.path.islink(self.path) else self.path
        folder, name = os.path.split(target)
        # (ending in path's name: writers that go by the extension, savefig, np.save, write the same)
        self.temp = os.path.join(folder, f".partial-{secrets.token_hex(4)}.{name}")
        try:  # created here (mode 0666 less the umask, as open() would): the directory takes files
            os.close(os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except OSError as e:
            raise type(e)(e.errno, e.strerror, self.path) from None
        self._target = target
        if os.path.exists(target):  # the new file keeps the old one's permissions
            os.chmod(self.temp, stat.S_IMODE(os.stat(target).st_mode))

    def commit(self) -> None:
        """Moves the written file into place, or copies it into a stream (a no-op once done)."""
        if not os.path.exists(self.temp):
            return
        if not self._stream:
            os.replace(self.temp, self._target)
            return
        try:
            with open(self.temp, "rb") as src:
                if self._fd is not None:  # (the descriptor itself: its offset and O_APPEND hold)
                    with os.fdopen(os.dup(self._fd), "wb") as out:
                        shutil.copyfileobj(src, out)
                else:
                    with open(self.path, "wb") as out:
                        shutil.copyfileobj(src, out)
        finally:
            os.remove(self.temp)

    def discard(self) -> None:
        """Removes the written file; the destination stays as it was."""
        if os.path.exists(self.temp):
            os.remove(self.temp)

    def __enter__(self) -> PendingFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def png_path(path) -> str:
    """Where a plot asked for at `path` goes: path, with ".png" added when it has no extension
    (as matplotlib's savefig adds it); a directory as it is (refused when opened)."""
    path = os.fspath(path)
    if os.path.isdir(path):  # (not DIR.png beside it: PendingFile then names the directory)
        return path
    return path if os.path.splitext(path)[1] else path + ".png"
