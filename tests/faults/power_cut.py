"""Run ``neutrain`` recording what each fsync made durable, and kill it at a chosen point; then emulate a power cut.

    python -m tests.faults.power_cut <journal dir> <module>:<attribute path> <neutrain args...>

Every ``os.fsync`` of a regular file copies the file, as synced, into ``<journal dir>`` (keyed by its
device and inode); the process SIGKILLs itself as soon as the first call of the named function (e.g.
``neutrain.export:export_model``) returns. :func:`drop_unsynced` then leaves the run directory as a power
cut at that moment would on a file system that keeps names and renames but loses data not yet synced
(ext4's default ``data=ordered`` with delayed allocation: a file renamed into place whose blocks were never
written reads back empty): every file whose content is not its inode's last synced copy is put back to that
copy, or emptied when it was never synced. Directory entries are kept as they are (renames and deletions
survive), which is the harsher case for a run that deletes its previous checkpoint after a rename.

A kill point the run never reaches exits 3, so a test cannot pass by accident.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import stat
import sys
from pathlib import Path

from tests.faults.pause_at import attribute_at


def _key(st: os.stat_result) -> str:
    return f"{st.st_dev}-{st.st_ino}"


def record_fsyncs(journal: Path) -> None:
    """Make ``os.fsync`` copy each regular file it syncs into ``journal``."""
    original = os.fsync

    @functools.wraps(original)
    def fsync(fd):
        original(fd)
        st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
        if not stat.S_ISREG(st.st_mode):
            return  # a directory: renames are kept in any case (see the module doc)
        path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        shutil.copyfile(path, journal / _key(st))

    os.fsync = fsync


def drop_unsynced(root: Path, journal: Path) -> list[str]:
    """Put every file under ``root`` back to its last synced content (empty if never synced); returns the
    files that changed, relative to ``root``."""
    changed = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_symlink():
                continue
            synced = journal / _key(path.stat())
            content = synced.read_bytes() if synced.exists() else b""
            if path.read_bytes() != content:
                path.write_bytes(content)
                changed.append(str(path.relative_to(root)))
    return sorted(changed)


def main() -> int:
    journal, target, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    journal.mkdir(parents=True, exist_ok=True)
    record_fsyncs(journal)
    owner, name = attribute_at(target)
    original = getattr(owner, name)

    @functools.wraps(original)
    def then_die(*call_args, **kwargs):
        result = original(*call_args, **kwargs)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, then_die)
    from neutrain.cli import main as neutrain_main

    neutrain_main(args)
    print(f"the kill point {target} was never reached", file=sys.stderr)
    return 3


if __name__ == "__main__":
    raise SystemExit(main())
