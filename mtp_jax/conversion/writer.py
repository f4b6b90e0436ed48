"""Atomic writing of converted folders: a new folder is filled beside DST and swapped into place, so that DST is
never half-written; what killed runs leave beside it is locked while live and removed by the next run."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable

from mtp_jax.params.tree import CONFIG_FILE
from mtp_jax.runtime.errors import ConversionError
from mtp_jax.runtime.files import nearest_existing_ancestor

# Beside DST, while a conversion runs: `.DST.partial-*`, the folder being written (it holds LOCK_FILE, locked by
# its writer), and, where the file system cannot swap two folders in one step, `.DST.old-*`, the previous DST
# between the two renames that replace it.
PARTIAL, OLD = ".partial-", ".old-"
LOCK_FILE = ".converting"


def check_destination(dst: str, overwrite: bool) -> None:
    """Refuse a destination that cannot take a converted folder, before any work: one that exists (without
    `overwrite`), is not a folder, or holds something other than a converted checkpoint; or one under a file."""
    if os.path.lexists(dst):
        if not overwrite:
            raise ConversionError(f"{dst} already exists (use --overwrite)")
        if not os.path.isdir(dst) or os.path.islink(dst):
            raise ConversionError(f"{dst} exists and is not a folder: --overwrite replaces converted folders only")
        if os.listdir(dst) and not os.path.isfile(os.path.join(dst, CONFIG_FILE)):
            raise ConversionError(f"{dst} is not a converted checkpoint (no {CONFIG_FILE}): not overwriting it")
    ancestor = nearest_existing_ancestor(dst)
    if not os.path.isdir(ancestor):
        raise ConversionError(f"{dst}: {ancestor} is a file, not a folder")


def write_folder(dst: str, overwrite: bool, fill: Callable[[str], None]) -> None:
    """Call `fill(folder)` on a new folder beside `dst`, then swap it into place.

    At every instant `dst` is the old folder or the new one, whole: an existing one is exchanged with the new one in
    one atomic rename (Linux `renameat2`) and deleted afterwards. Where the file system cannot exchange (NFS, ...),
    the old one is renamed aside first; a conversion killed between the two renames leaves it as `.DST.old-*`, and
    the next conversion into `dst` puts it back. Each conversion also removes what killed earlier ones left.
    """
    dst = os.path.abspath(dst)
    check_destination(dst, overwrite)
    parent, name = os.path.split(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = _new_folder(parent, f".{name}{PARTIAL}")
    try:
        with open(os.path.join(tmp, LOCK_FILE), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held until the new folder is in place: no other run removes it
            remove_leftovers(dst)
            fill(tmp)
            replaced = _swap_into_place(tmp, dst)
            os.unlink(os.path.join(dst, LOCK_FILE))
        if replaced:
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the unfinished new folder, or the old one swapped out
        raise


def _new_folder(parent: str, prefix: str) -> str:
    """A new empty folder `parent/prefix<random>`, with the permissions the umask gives (mkdtemp's are 0700)."""
    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def _swap_into_place(tmp: str, dst: str) -> bool:
    """Put folder `tmp` at `dst`; a folder that was at `dst` ends up at `tmp` (returns whether there was one)."""
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return False
    if _exchange(tmp, dst):
        return True
    aside = _new_folder(os.path.dirname(dst), f".{os.path.basename(dst)}{OLD}")
    os.rename(dst, aside)  # replaces the empty folder just made
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(aside, dst)
        raise
    os.rename(aside, tmp)  # a `.DST.old-*` is only ever a whole DST: deleting it starts from another name
    return True


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 with RENAME_EXCHANGE); False where the C library, the
    kernel or the file system cannot."""
    rename_exchange, at_fdcwd = 2, -100
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def remove_leftovers(dst: str) -> None:
    """Remove what killed conversions into `dst` left beside it: `.DST.partial-*` folders no live conversion holds,
    and `.DST.old-*`, unless `dst` is missing: then the old folder goes back to `dst`."""
    parent, name = os.path.split(os.path.abspath(dst))
    ours = re.compile(rf"\.{re.escape(name)}({re.escape(PARTIAL)}|{re.escape(OLD)})[0-9a-f]{{8}}")
    for entry in sorted(os.listdir(parent)):
        path, match = os.path.join(parent, entry), ours.fullmatch(entry)
        if match is None:
            continue
        if match[1] == OLD and not os.path.lexists(dst):
            os.rename(path, dst)  # a swap cut short between its two renames: the old DST goes back
        elif match[1] == OLD:
            garbage = _new_folder(parent, f".{name}{PARTIAL}")  # a deletion cut short leaves no `.DST.old-*`
            os.rename(path, garbage)
            shutil.rmtree(garbage)
        elif not _held(path):
            shutil.rmtree(path)


def _held(folder: str) -> bool:
    """Whether a running conversion holds the lock in `folder`."""
    try:
        with open(os.path.join(folder, LOCK_FILE), "r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return False
    except BlockingIOError:
        return True
    return False
