"""Files that the commands write (traces, exports, plans, plots): each is written beside its
destination and moved into place only once whole, so a command that fails leaves the destination
as it was (an existing file untouched, no partial file) and a reader never sees half a file."""

from __future__ import annotations

import os
import secrets
import stat


class PendingFile:
    """A new file for `path`, written at `temp` (a hidden name in path's directory): commit()
    replaces path by it (os.replace), discard() removes it; as a context manager, leaving the
    block commits, leaving it by an exception discards. Raises OSError naming `path` when its
    directory cannot take a new file (missing, not writable) or path is a directory. A destination
    that is not a regular file (a pipe, a FIFO, /dev/stdout) is written directly: temp is path."""

    def __init__(self, path):
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            raise IsADirectoryError(21, "Is a directory", self.path)
        self._direct = os.path.exists(self.path) and not stat.S_ISREG(os.stat(self.path).st_mode)
        if self._direct:  # (a pipe, a FIFO, /dev/stdout: written as it is; there is nothing to keep)
            self.temp = self.path
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
        """Moves the written file into place (a no-op once done)."""
        if not self._direct and os.path.exists(self.temp):
            os.replace(self.temp, self._target)

    def discard(self) -> None:
        """Removes the written file; the destination stays as it was."""
        if not self._direct and os.path.exists(self.temp):
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
    (as matplotlib's savefig adds it)."""
    path = os.fspath(path)
    return path if os.path.splitext(path)[1] else path + ".png"
