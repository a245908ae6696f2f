"""Output files of the ``hybrimoe`` commands: one check before any work starts (an existing file is replaced only
with ``--force``; a command's own input is never replaced) and atomic writes (a temporary file beside the output,
renamed over it at the end, so that an interrupted write never leaves half a file)."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Optional


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file (the same inode when both exist, else the same resolved path)."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def check_output(path, flag: str, *, force: bool = False, inputs: Iterable[tuple[str, object]] = ()) -> Path:
    """Checks that ``path`` (given by the option ``flag``, e.g. ``"--json"``) may be written, before any long work.

    Args:
        path: the output file.
        flag: the option that named it, for the messages.
        force: replace an existing file.
        inputs: ``(option, path or None)`` pairs of the command's input files; an output that is one of them is
            refused even with ``force``.

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: the output is one of the inputs, is a directory, exists without ``force``, or its folder is
            missing or not writable (probed with a real temporary file, as the write will make one).
    """
    p = Path(path)
    for opt, inp in inputs:
        if inp is not None and str(inp) != "" and _same_file(p, Path(os.fspath(inp))):
            raise ValueError(f"{flag} {p}: is the command's input ({opt} {inp}); choose another output file")
    if p.is_dir():
        raise ValueError(f"{flag} {p}: is a directory")
    if p.exists() and not force:
        raise ValueError(f"{flag} {p}: exists (give --force to replace it)")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {p}: cannot write there: the folder {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {p}: cannot write in {parent} ({e.strerror})") from None
    return p


def new_file_mode(path: Optional[Path] = None) -> int:
    """The permission bits a written file gets: those of the file it replaces, else 0666 less the umask."""
    if path is not None and Path(path).exists():
        return Path(path).stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path) -> Iterator[Path]:
    """Yields a temporary path beside ``path`` to write; on success it gets the mode of :func:`new_file_mode` and
    is renamed over ``path``; on any error or interrupt it is removed and ``path`` is left as it was."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, new_file_mode(path))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", **kw) -> Iterator:
    """``open(path, mode)`` through :func:`atomic_path`: the data reach ``path`` whole (flushed and synced) when
    the block ends without an error, else not at all. ``mode``: ``"w"`` or ``"wb"``; ``kw`` go to ``open``."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, **kw) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())


def write_text(path, text: str) -> None:
    """Writes ``text`` to ``path`` atomically (:func:`atomic_open`)."""
    with atomic_open(path, "w") as fh:
        fh.write(text)


def savefig(fig, path, **kw) -> None:
    """``fig.savefig`` atomically; the format comes from ``path``'s suffix."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format=fmt, **kw)
