"""File-system helpers of the local backend: a size-limited tmpfs per session, and removing any tree without
recursion (a program can nest directories deeper than Python's recursion limit or than PATH_MAX)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import stat

_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return _libc


def mount_tmpfs(path: str | os.PathLike, size_bytes: int, inodes: int, mode: int = 0o700) -> None:
    """Mount a tmpfs of at most ``size_bytes`` and ``inodes`` files on ``path`` (nosuid, nodev); raises OSError."""
    opts = f"size={size_bytes},nr_inodes={inodes},mode={mode:o}".encode()
    if _c().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount tmpfs on {path}: {os.strerror(e)}")


def unmount(path: str | os.PathLike) -> None:
    """Detach the mount on ``path`` (its files go with it); raises OSError, EINVAL when nothing is mounted there."""
    if _c().umount2(os.fsencode(path), _MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {path}: {os.strerror(e)}")


def _open_dir(name: str, dir_fd: int) -> int:
    """Open a subdirectory, first making it searchable if the program took our permissions away (non-root)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=dir_fd, follow_symlinks=False)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _unlink(name: str, dir_fd: int, how) -> None:
    """``how(name, dir_fd=...)`` (unlink or rmdir), giving the directory back its write permission if needed."""
    try:
        how(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except PermissionError:
        os.chmod(dir_fd, 0o700)
        with contextlib.suppress(FileNotFoundError):
            how(name, dir_fd=dir_fd)


def remove_tree(path: str | os.PathLike) -> None:
    """Delete ``path`` and everything under it, iteratively; symlinks are removed, never followed.

    Descends with one open directory at a time (``openat`` relative to the parent, ``..`` to come back), so neither
    the depth nor the length of the paths inside matters. Raises OSError if something cannot be removed.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    try:
        fd = os.open(path, _DIR_FLAGS)
    except PermissionError:
        os.chmod(path, 0o700)
        fd = os.open(path, _DIR_FLAGS)
    names: list[str] = []  # the directories we are in, below ``path``
    try:
        while True:
            sub = None
            try:
                entries = list(os.scandir(fd))
            except PermissionError:
                os.chmod(fd, 0o700)
                entries = list(os.scandir(fd))
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    sub = entry.name
                    break
                _unlink(entry.name, fd, os.unlink)
            if sub is not None:
                child = _open_dir(sub, fd)
                os.close(fd)
                fd = child
                names.append(sub)
                continue
            if not names:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            _unlink(names.pop(), fd, os.rmdir)
    finally:
        os.close(fd)
    os.rmdir(path)
