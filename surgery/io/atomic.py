"""Replace a folder's checkpoint atomically: write everything into a temporary sibling, then swap it into place.

One mechanism for every writer (`surgery convert` and `surgery.save_pretrained`), written here because neither Python
nor safetensors offers an atomic folder replace:

- the destination is resolved and checked first (`destination`): a file, a pipeline's root folder (it holds
  `model_index.json`: the model goes into its `transformer/`) or a path with no name are refused;
- one writer at a time: a lock on a sibling file (`.<name>.surgery-lock`, `fcntl.flock`), so a second save or
  convert to the same folder is refused with the first one's process id instead of interleaving with it;
- the new checkpoint goes into a temporary sibling with a unique name (`.<name>.surgery-tmp-<pid>@<host>-<random>`),
  every file fsynced, and appears under the destination's name in one `renameat2(RENAME_EXCHANGE)` on Linux (the
  destination is never absent, never half-written); elsewhere two renames (the old folder stays whole under a
  temporary name in between). A crash or kill before the swap leaves the destination as it was plus a temporary
  folder that the next run removes;
- the writer owns only the files it writes (`owned(name)`: for a diffusers model, `config.json` and
  `diffusion_pytorch_model*`); every other entry of the destination (a README, LoRA files, a `samples/` folder) is
  carried into the new folder as hard links before the swap, and anything added meanwhile is moved over after it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from surgery.core.errors import SurgeryError

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


def destination(folder: str | os.PathLike, verb: str) -> Path:
    """`folder` resolved (`.`, `..`, symlinks), refused where a model checkpoint must not be written."""
    given = folder
    try:
        target = Path(folder).resolve()
    except (OSError, RuntimeError) as error:
        raise SurgeryError(f"{verb}: cannot resolve '{given}': {error}.") from None
    if not target.name:
        raise SurgeryError(f"{verb}: '{given}' is the file system's root; pass a folder for the checkpoint.")
    if target.exists() and not target.is_dir():
        raise SurgeryError(f"{verb}: destination '{given}' is a file, not a folder: pass a folder path.")
    if (target / "model_index.json").is_file():
        raise SurgeryError(
            f"{verb}: '{given}' is a pipeline folder (it holds model_index.json); a model checkpoint there would mix "
            f"with the pipeline's files. Pass its model folder, e.g. '{Path(given) / 'transformer'}', or save the "
            "whole pipeline with pipe.save_pretrained."
        )
    return target


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str | os.PathLike, text: str) -> str:
    """Write one text file atomically: a temporary sibling, fsynced, then one rename; returns the path."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


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
    return old / target.name


class _Lock:
    """One writer per destination: `fcntl.flock` on a sibling file, refused (not waited for) when held elsewhere.

    The file is removed on release; a writer that opened it just before checks, after locking, that the path still
    names the file it locked (else it locks the new one), so two writers never both hold a lock.
    """

    def __init__(self, target: Path, verb: str):
        self.path = target.parent / f".{target.name}.surgery-lock"
        while True:
            fd = self._open(verb)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise SurgeryError(
                    f"{verb}: '{target}' is being written by {holder} right now (a save or convert to the same "
                    "folder); wait for it to finish, or write to another folder. Nothing was written."
                ) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # removed by the writer that held it: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()}".encode())
        self.fd = fd

    def _open(self, verb: str) -> int:
        """The lock file, opened without following a link: a link or a second name planted there would have the
        lock truncate and write the file it leads to (a user's file)."""
        planted = f"{verb}: '{self.path}' is not surgery's lock file"
        fix = ("; surgery locks only a plain file of its own there. Remove it and write again. Nothing was written, "
               "and the file it leads to is as it was.")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as error:
            if os.path.islink(self.path):
                raise SurgeryError(f"{planted} but a link to '{os.readlink(self.path)}'{fix}") from None
            raise
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
            os.close(fd)
            what = "a file with other names (hard links)" if stat.S_ISREG(found.st_mode) else "not a plain file"
            raise SurgeryError(f"{planted} but {what}{fix}")
        return fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


class Staged:
    """A temporary sibling of `target` to write a checkpoint into, then `commit()` (swap) or `discard()`.

    `owned(name)`: the entries of an existing `target` that the new folder replaces; the others are kept.
    OSErrors become a `SurgeryError` naming the path; nothing under `target` changes before the swap.
    """

    def __init__(self, target: Path, owned: Callable[[str], bool], verb: str = "surgery"):
        self.target, self.owned, self.verb = target, owned, verb
        self.lock = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self.lock = _Lock(target, verb)
            clean_stale(target)
            self.path = Path(tempfile.mkdtemp(prefix=_prefix(target), dir=target.parent))
        except OSError as error:
            self._unlock()
            raise SurgeryError(f"cannot write beside '{target}': {_reason(error)}. Nothing was written.") from None
        except BaseException:
            self._unlock()
            raise

    def _unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._unlock()

    def failed(self, error: OSError) -> SurgeryError:
        """The error to raise for an OSError while writing or swapping (after `discard`)."""
        where = error.filename or self.target
        return SurgeryError(f"cannot write '{where}': {_reason(error)}. '{self.target}' is as it was; the temporary "
                            "folder was removed.")

    def commit(self) -> None:
        """Swap the complete temporary folder into place; on any error it is removed and `target` is as it was."""
        target, staged = self.target, self.path
        try:
            os.chmod(staged, (target.stat().st_mode & 0o7777) if target.exists() else 0o777 & ~_umask())
            for entry in staged.iterdir():
                if entry.is_file() and not entry.is_symlink():
                    _fsync(entry)
            if target.exists():
                for entry in target.iterdir():
                    if not self.owned(entry.name):
                        _carry(entry, staged)
            _fsync(staged)
            cwd = _cwd()
            old = _swap_in(staged, target)
        except BaseException as error:
            self.discard()
            if isinstance(error, OSError):
                raise self.failed(error) from None
            raise
        try:
            if old is not None:
                for entry in old.iterdir():  # added to the destination while this writer carried the others over
                    if not self.owned(entry.name) and not os.path.lexists(target / entry.name):
                        os.rename(entry, target / entry.name)
                shutil.rmtree(old if old == staged else old.parent, ignore_errors=True)
            _fsync(target.parent)
            if cwd is not None and (cwd == target or target in cwd.parents):
                # this process worked inside the old folder: follow the checkpoint into the new one
                inside = target / cwd.relative_to(target)
                os.chdir(inside if inside.is_dir() else target)
        finally:
            self._unlock()


def _cwd() -> Path | None:
    try:
        return Path.cwd()
    except OSError:
        return None


@contextmanager
def staged_folder(target: Path, owned: Callable[[str], bool], verb: str = "surgery") -> Iterator[Path]:
    """Yield an empty temporary sibling of `target`; on success it replaces `target`, on any error it is removed."""
    staged = Staged(target, owned, verb)
    try:
        yield staged.path
    except BaseException as error:
        staged.discard()
        if isinstance(error, OSError):
            raise staged.failed(error) from None
        raise
    staged.commit()


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
