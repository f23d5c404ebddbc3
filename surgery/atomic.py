"""Replace a folder's checkpoint atomically: write everything into a temporary sibling, then swap it into place.

Neither Python nor safetensors offers an atomic folder replace, so this is written here: the new folder is complete
(files fsynced) before it appears under the destination's name; a crash or kill before that leaves the destination
as it was plus a temporary folder that the next run removes. On Linux an existing destination is swapped in one
`renameat2(RENAME_EXCHANGE)`; elsewhere two renames (the old folder stays whole under a temporary name in between).
Files in the destination that the writer does not own are carried into the new folder as hard links, never deleted.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .checks import SurgeryError

_TAG = ".surgery-tmp-"
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2


def _prefix(target: Path) -> str:
    return f".{target.name}{_TAG}{os.getpid()}@{socket.gethostname()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(target: Path) -> list[Path]:
    """Remove temporary siblings of `target` left by killed runs on this host (their process is gone)."""
    pattern = re.compile(rf"\.{re.escape(target.name)}{re.escape(_TAG)}(\d+)@(.+)-[A-Za-z0-9_]+$")
    removed = []
    if not target.parent.is_dir():
        return removed
    for entry in target.parent.iterdir():
        match = pattern.match(entry.name)
        if match and match[2] == socket.gethostname() and not _alive(int(match[1])) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2; False where the C library or the file system does not offer it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if call(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(dst))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _carry(entry: Path, into: Path) -> None:
    """Hard-link (or copy, where links are not allowed) a file or folder the writer does not own into `into`."""
    def link(source, dest):
        try:
            os.link(source, dest, follow_symlinks=False)
        except OSError:
            shutil.copy2(source, dest, follow_symlinks=False)

    if entry.is_dir() and not entry.is_symlink():
        shutil.copytree(entry, into / entry.name, symlinks=True, copy_function=link)
    else:
        link(entry, into / entry.name)


def _swap_in(staged: Path, target: Path) -> Path | None:
    """Put `staged` at `target`; returns where the old folder now is (to be removed), or None."""
    if not target.exists():
        if not _renameat2(staged, target, _RENAME_NOREPLACE):
            os.rename(staged, target)
        return None
    if _renameat2(staged, target, _RENAME_EXCHANGE):
        return staged
    old = Path(tempfile.mkdtemp(prefix=_prefix(target), dir=target.parent))
    os.rename(target, old / target.name)
    os.rename(staged, target)
    return old


@contextmanager
def staged_folder(target: Path, owned: Callable[[str], bool]) -> Iterator[Path]:
    """Yield an empty temporary sibling of `target`; on success it replaces `target`, on any error it is removed.

    Entries of an existing `target` for which `owned(name)` is false are carried over; owned ones are replaced.
    OSErrors become a `SurgeryError` naming the path; nothing under `target` changes before the swap.
    """
    try:
        clean_stale(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=_prefix(target), dir=target.parent))
    except OSError as error:
        raise SurgeryError(f"cannot write beside '{target}': {_reason(error)}. Nothing was written.") from None
    try:
        yield staged
        os.chmod(staged, (target.stat().st_mode & 0o7777) if target.exists() else 0o777 & ~_umask())
        if target.exists():
            for entry in target.iterdir():
                if not owned(entry.name):
                    _carry(entry, staged)
        _fsync_dir(staged)
        old = _swap_in(staged, target)
    except BaseException as error:
        shutil.rmtree(staged, ignore_errors=True)
        if isinstance(error, OSError):
            where = error.filename or target
            raise SurgeryError(
                f"cannot write '{where}': {_reason(error)}. '{target}' is as it was; the temporary folder was removed."
            ) from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(target.parent)


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
