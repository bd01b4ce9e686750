"""Reading user files and writing results without tracebacks or half-written files.

Every command checks its output paths before any work starts (``check_output``), so a long run
never ends by failing to write; results are written to a temporary file beside the target and
renamed over it (``write_text``), so a failure or a kill leaves either the old file or the new one,
never a partial one. Unreadable inputs (missing, a directory, binary, a name too long) become one
``SpecError`` line naming the option or file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from coplan.errors import SpecError

#: Longest path accepted for any input or output: Linux's PATH_MAX. Longer names are refused
#: before the operating system is asked (which raises ENAMETOOLONG from calls that are not
#: expected to fail, such as ``Path.exists``).
MAX_PATH_CHARS = 4096


def _why(err: OSError) -> str:
    if err.errno == errno.ENAMETOOLONG:
        return "file name too long"
    return err.strerror or str(err)


def _check_length(label: str, path: Path) -> None:
    text = str(path)
    if len(text) > MAX_PATH_CHARS:
        raise SpecError(label, None, f"path of {len(text)} characters (at most {MAX_PATH_CHARS})")
    if any(len(part) > 255 for part in path.parts):
        raise SpecError(label, None, "a file or folder name longer than 255 characters")


def looks_like_file(name: str) -> bool:
    """True when ``name`` names an existing path (never raises, whatever the name)."""
    try:
        _check_length(name, Path(name))
        return Path(name).exists()
    except (OSError, SpecError, ValueError):
        return False


def read_text(path: str | Path, label: str | None = None) -> str:
    """The UTF-8 text of a user's file; every failure is a one-line ``SpecError`` naming ``label``
    (default: the path)."""
    p = Path(path)
    label = label or str(path)
    _check_length(label, p)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(label, None, "no such file") from None
    except IsADirectoryError:
        raise SpecError(label, None, "is a directory, not a file") from None
    except UnicodeDecodeError as err:
        raise SpecError(label, None, f"not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise SpecError(label, None, f"cannot read: {_why(err)}") from None
    except ValueError as err:  # e.g. an embedded NUL in the name
        raise SpecError(label, None, f"not a usable path: {err}") from None


def check_output(option: str, path: Path | None) -> Path | None:
    """Refuse, before any work, an output path that could not be written: a directory, a missing
    or read-only folder, a special file (``/proc/...``, a device), a name too long. An existing
    regular, writable file is fine: ``--out`` replaces it, ``--record`` appends to it."""
    if path is None:
        return None
    label = f"{option} {path}"
    try:
        p = Path(os.path.expanduser(str(path)))
        _check_length(label, p)
        if p.is_dir():
            raise SpecError(label, None, "is a directory; give a file name")
        parent = p.parent if str(p.parent) else Path(".")
        if not parent.exists():
            raise SpecError(label, None, f"folder {parent} does not exist")
        if not parent.is_dir():
            raise SpecError(label, None, f"{parent} is not a folder")
        if p.exists():
            if not p.is_file():
                raise SpecError(label, None, "is not a regular file")
            if not os.access(p, os.W_OK):
                raise SpecError(label, None, "is not writable")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise SpecError(label, None, f"folder {parent} is not writable")
        if _special(parent):
            raise SpecError(label, None, f"{parent} is a system folder, not a place for results")
    except OSError as err:
        raise SpecError(label, None, f"cannot write there: {_why(err)}") from None
    except ValueError as err:
        raise SpecError(label, None, f"not a usable path: {err}") from None
    return p


def _special(folder: Path) -> bool:
    """Folders of kernel pseudo-files: writing results there is never meant."""
    resolved = folder.resolve()
    return any(resolved == Path(root) or Path(root) in resolved.parents for root in ("/proc", "/sys", "/dev"))


def write_text(path: Path, text: str, option: str = "--out") -> None:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder, renamed over it."""
    path = Path(os.path.expanduser(str(path)))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, _mode(path))
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        raise SpecError(f"{option} {path}", None, f"cannot write: {_why(err)}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _mode(path: Path) -> int:
    """The permissions the result should have: the replaced file's, else what ``open`` would give
    (mkstemp makes its file private)."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def append_text(path: Path, text: str, option: str = "--record") -> None:
    """Append ``text`` (whole lines) to ``path`` in one write, so a killed writer leaves at most one
    line unfinished and every earlier line intact."""
    path = Path(os.path.expanduser(str(path)))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode("utf-8"))
        finally:
            os.close(fd)
    except OSError as err:
        raise SpecError(f"{option} {path}", None, f"cannot write: {_why(err)}") from None
