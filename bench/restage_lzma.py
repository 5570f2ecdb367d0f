"""Shrinks wheels staged by ../shared/tools/stage_wheels.sh for the GPU machine, so that fewer
transfers carry them: each wheel cut into pieces is joined, its members recompressed with LZMA
(zipfile's ZIP_LZMA, which pip reads as it reads deflate: the installed files, and the hashes in
the wheel's RECORD, are the same), and cut again. FBGEMM's GPU wheel holds one library per
backward variant, each with the same kernels for several GPU generations; LZMA's long window
finds those repeats, which deflate's 32 KiB window cannot (fbgemm-gpu 1.6.0: 465 MB in 9 pieces
before, see the figure this prints after). The folders, SHA256SUMS and assemble.sh keep
stage_wheels.sh's layout, so the GPU session assembles them as before.

    ../shared/tools/stage_wheels.sh .wheels rocksdict lz4 fbgemm-gpu==1.6.0
    python bench/restage_lzma.py .wheels
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import zipfile

LIMIT = 56 * 1000 * 1000  # stage_wheels.sh's piece size


def recompress(src: str, dst: str) -> None:
    """src's members, in order, written to dst with ZIP_LZMA (one member in memory at a time: the
    largest is about 1.1 GB)."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for info in z.infolist():
            out.writestr(info, z.read(info.filename), compress_type=zipfile.ZIP_LZMA)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", help="the folder stage_wheels.sh wrote (w0, w1, ..., SHA256SUMS, assemble.sh)")
    a = p.parse_args(argv)
    folders = sorted((d for d in os.listdir(a.dest) if d.startswith("w") and d[1:].isdigit()), key=lambda d: int(d[1:]))
    work = os.path.join(a.dest, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    wheels, pieces = [], {}
    for d in folders:
        for name in sorted(os.listdir(os.path.join(a.dest, d))):
            path = os.path.join(a.dest, d, name)
            if name.endswith(".whl"):
                wheels.append(path)
            elif ".whl.part" in name:
                pieces.setdefault(name.split(".part")[0], []).append(path)
    for name, parts in pieces.items():
        joined = os.path.join(work, name)
        with open(joined, "wb") as out:
            for part in sorted(parts, key=os.path.basename):  # (NAME.whl.part00, 01, ...: not by folder)
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out)
        small = joined + ".lzma"
        recompress(joined, small)
        print(f"{name}: {os.path.getsize(joined) / 1e6:.0f} MB -> {os.path.getsize(small) / 1e6:.0f} MB", flush=True)
        os.replace(small, joined)
        wheels.append(joined)
    with zipfile.ZipFile(wheels[-1]) as z:
        if z.testzip() is not None:
            raise SystemExit(f"{wheels[-1]}: a member reads back wrong")
    new = os.path.join(a.dest, "new")
    shutil.rmtree(new, ignore_errors=True)
    os.makedirs(os.path.join(new, "w0"))
    sums, k, used = [], 0, 0
    for w in sorted(wheels, key=os.path.getsize):
        name = os.path.basename(w)
        with open(w, "rb") as f:
            sums.append(f"{hashlib.sha256(f.read()).hexdigest()}  {name}\n")
        size = os.path.getsize(w)
        if size <= LIMIT - used:
            shutil.copy(w, os.path.join(new, f"w{k}", name))
            used += size
            continue
        with open(w, "rb") as f:
            n = 0
            while chunk := f.read(LIMIT):
                k += 1
                os.makedirs(os.path.join(new, f"w{k}"))
                with open(os.path.join(new, f"w{k}", f"{name}.part{n:02d}"), "wb") as out:
                    out.write(chunk)
                n += 1
        k, used = k + 1, 0
        os.makedirs(os.path.join(new, f"w{k}"))
    if not os.listdir(os.path.join(new, f"w{k}")):
        os.rmdir(os.path.join(new, f"w{k}"))
    for target in (os.path.join(new, "SHA256SUMS"), os.path.join(new, "w0", "SHA256SUMS")):
        with open(target, "w") as f:
            f.writelines(sums)
    shutil.copy(os.path.join(a.dest, "assemble.sh"), os.path.join(new, "assemble.sh"))
    shutil.copy(os.path.join(a.dest, "assemble.sh"), os.path.join(new, "w0", "assemble.sh"))
    for d in folders:
        shutil.rmtree(os.path.join(a.dest, d))
    for name in ("SHA256SUMS", "assemble.sh"):
        os.remove(os.path.join(a.dest, name))
    for name in os.listdir(new):
        os.replace(os.path.join(new, name), os.path.join(a.dest, name))
    shutil.rmtree(new)
    shutil.rmtree(work)
    print(f"{a.dest}: {len([d for d in os.listdir(a.dest) if d.startswith('w')])} folders "
          f"({', '.join(f'{d} {sum(os.path.getsize(os.path.join(a.dest, d, f)) for f in os.listdir(os.path.join(a.dest, d))) / 1e6:.0f} MB' for d in sorted(os.listdir(a.dest)) if d.startswith('w'))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
