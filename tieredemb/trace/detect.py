"""Opening a trace in any supported format, told from the file's content (the name only breaks ties).

    with open_any("cluster52.oracleGeneral.bin", batch_size=4096) as src:   # a TraceSource
        src.header.total_rows, [c.keys for c in src.chunks()]

Formats and what gives them away:
    trace   a tieredemb trace (format.py)          magic b"TEMBTRC\\0"
    npy     an integer .npy array (npyfile.py)     magic b"\\x93NUMPY"
    pt      an FBGEMM request file (fbgemm.py)     a torch zip archive (.../data.pkl) or torch's legacy pickle
    csv     batch,table,id lines (csvfile.py)      text whose first line is those column names or 3 integers
    oracle  libCacheSim oracleGeneral (oracle.py)  24-byte records whose next_access_vtime fields point
                                                   forward to requests for the same object, and whose
                                                   clock_time never goes back
When the content matches none of these, a file whose name has a known extension is read as that
format (whose reader then names what is wrong); otherwise TraceError names the file and what was
expected. UTF-16 text is refused as such. Destinations of a conversion have no content yet:
detect_format names them by extension.
"""

from __future__ import annotations

import os
import zipfile

from .format import MAGIC, TraceError, TraceReader, TraceSource

FORMATS = ("trace", "pt", "oracle", "csv", "npy", "log")
DESCRIPTIONS = {"trace": "a tieredemb trace", "pt": "an FBGEMM .pt request file",
                "oracle": "a libCacheSim oracleGeneral file", "csv": "a CSV of batch,table,id lines",
                "npy": "an integer .npy array", "log": "a DLRM locality log"}
_EXTENSIONS = {".trace": "trace", ".pt": "pt", ".oraclegeneral": "oracle", ".oraclegeneral.bin": "oracle",
               ".csv": "csv", ".npy": "npy", ".log": "log"}
# What each format's reader takes, and the command-line flag of each option.
READ_OPTIONS = {"trace": (), "csv": ("rows", "batch_size"), "npy": ("rows", "batch_size"),
                "oracle": ("rows", "batch_size", "remap"), "pt": ("rows", "batch_size", "num_tables")}
FLAGS = {"rows": "--rows", "batch_size": "--batch-size", "num_tables": "--tables", "remap": "--remap"}
_HEAD = 1 << 16  # bytes read to tell the format
UTF8_BOM = b"\xef\xbb\xbf"  # (Excel's "CSV UTF-8" starts with it)
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"
_TORCH_LEGACY = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")  # torch's pickled magic number
_COMPRESSED = {b"\x28\xb5\x2f\xfd": ("zstd", "zstd -d"), b"\x1f\x8b": ("gzip", "gunzip -k"),
               b"\xfd7zXZ\x00": ("xz", "unxz -k"), b"BZh": ("bzip2", "bunzip2 -k")}


def format_from_extension(path) -> str | None:
    """The format named by the file's extension (case-insensitive), None for an unknown one."""
    name = os.fspath(path).lower()
    for ext, fmt in sorted(_EXTENSIONS.items(), key=lambda e: -len(e[0])):
        if name.endswith(ext):
            return fmt
    return None


def detect_format(path, given: str | None = None) -> str:
    """The format `given`, or the one named by the file's extension (for files yet to be written)."""
    if given is not None:
        if given not in FORMATS:
            raise TraceError(f"unknown trace format {given!r} (known: {', '.join(FORMATS)})")
        return given
    fmt = format_from_extension(path)
    if fmt is None:
        raise TraceError(f"{path}: cannot tell the format from the extension (known: "
                         f"{', '.join(sorted(_EXTENSIONS))}); name it with --from/--to")
    return fmt


def sniff_format(path) -> str | None:
    """The format that the file's content shows (see the module docstring), None if none does.
    Raises TraceError for a compressed file (naming the command that decompresses it)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(_HEAD)
    if head.startswith(MAGIC):
        return "trace"
    if head.startswith(_NPY_MAGIC):
        return "npy"
    if head.startswith(_TORCH_LEGACY) or (head.startswith(_ZIP_MAGIC) and _is_torch_zip(path)):
        return "pt"
    for magic, (kind, command) in _COMPRESSED.items():
        if head.startswith(magic):
            raise TraceError(f"{path}: compressed with {kind}: decompress it first ({command} {path})")
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) and _utf16_text(head):
        raise TraceError(f"{path}: UTF-16 text (it starts with a byte-order mark): save it as UTF-8 or ASCII "
                         f"(PowerShell: Out-File -Encoding utf8)")
    if head and b"\0" not in head:
        return "csv" if _is_csv(path, head) else None
    from .oracle import looks_like_oracle  # imports numba: only for binary files without a magic

    return "oracle" if looks_like_oracle(head, size) else None


def _is_torch_zip(path: str) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _utf16_text(head: bytes) -> bool:
    """Whether head, after its UTF-16 byte-order mark, starts with a line of printable text (a
    binary trace may start with those two bytes too)."""
    text = head[2:len(head) - len(head) % 2].decode("utf-16-le" if head[0] == 0xFF else "utf-16-be", "replace")
    first = text.split("\n", 1)[0].rstrip("\r")
    return bool(first) and first.isprintable() and first.isascii()


def _is_csv(path: str, head: bytes) -> bool:
    from .csvfile import csv_columns

    first = head.removeprefix(UTF8_BOM).split(b"\n", 1)[0]
    try:
        csv_columns(path, first.decode("ascii"))
    except (UnicodeDecodeError, TraceError):
        return False
    return True


def source_format(path, given: str | None = None) -> str:
    """The format to read `path` as: `given`, else its content's (sniff_format), else its
    extension's. Raises TraceError for a missing file, a directory, or a file that matches no format."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise TraceError(f"{path}: " + ("is a directory, not a trace file" if os.path.isdir(path) else
                                        "no such file" if not os.path.exists(path) else "not a regular file"))
    if given is not None:
        return detect_format(path, given)
    fmt = sniff_format(path) or format_from_extension(path)
    if fmt is None:
        with open(path, "rb") as f:
            head = f.read(16)
        raise TraceError(f"{path}: not a trace in a format tieredemb reads (expected "
                         f"{', '.join(DESCRIPTIONS[f] for f in FORMATS if f != 'log')}); it starts with {head!r}")
    return fmt


def open_any(path, fmt: str | None = None, **options) -> TraceSource:
    """Opens a trace file of any supported format for streaming reads (a context manager).

    fmt: one of FORMATS, or None to tell it from the content (source_format). options: what the
    format's reader takes (READ_OPTIONS: rows, batch_size, num_tables, remap; see each reader);
    those left None or False are not given. An option the format does not take raises TraceError,
    as does a locality log (it holds no batches: `tieredemb trace synth --logs` makes a trace of it).
    """
    path = os.fspath(path)
    fmt = source_format(path, fmt)
    given = {k: v for k, v in options.items() if v is not None and v is not False}
    if fmt == "log":
        raise TraceError(f"{path}: {DESCRIPTIONS['log']} holds stack-distance statistics, not batches: make a trace "
                         f"of it with `tieredemb trace synth OUT --logs {path} --batches N --lookups L`")
    extra = [k for k in given if k not in READ_OPTIONS[fmt]]
    if extra:
        takes = ", ".join(FLAGS.get(k, k) for k in READ_OPTIONS[fmt]) or "none: it declares its batches and tables"
        raise TraceError(f"{path} is {DESCRIPTIONS[fmt]}: {', '.join(FLAGS.get(k, k) for k in extra)} does not apply "
                         f"to it (options it takes: {takes})")
    if fmt == "trace":
        return TraceReader(path)
    if fmt == "csv":
        from .csvfile import read_csv as read
    elif fmt == "npy":
        from .npyfile import read_npy as read
    elif fmt == "oracle":
        from .oracle import read_oracle as read
    else:
        from .fbgemm import read_pt as read
    return read(path, **given)
