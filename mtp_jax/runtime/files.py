"""Output files written whole or not at all."""

from __future__ import annotations

import os
import tempfile


def write_atomically(path: str, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a file beside it renamed into place: `path` holds its old content or
    the new, never part of either, and gets the permissions the umask gives."""
    write_file_atomically(path, lambda f: f.write(text.encode("utf-8")))


def write_file_atomically(path: str, write) -> None:
    """`write_atomically` for any content: `write(f)` fills a binary file beside `path`, then renamed into place."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".partial-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes owner-only files; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def nearest_existing_ancestor(path: str) -> str:
    """The closest ancestor of `path` that exists (a folder where `path` could be created, or a file it would lie
    under)."""
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    return ancestor
