"""A user's mistake, said as one message: what counts as one (user_error: a flag's value, a data
row, a file, a missing template; not a bug, whose traceback shows) and saying it once, under
torchrun too (say). cli.script and cli.parse_config end a run with it."""
import errno
import hashlib
import linecache
import os
import sys

import common


# What a user can fix, said by the message of the exception the project raises for it (each names the flag, file or
# row): a flag's value, data, a file, a missing optional package, a loss gone NaN (rundir.Run.check)
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               ModuleNotFoundError, FloatingPointError)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's folder


def user_error(e, out_dir):
    """The message of an error the user can fix, or None for any other (a bug: its traceback shows).
    Such an error is a refusal (rundir.refusal); or one of USER_ERRORS that this project raised on
    purpose: the innermost frame of its traceback is a `raise` statement in one of the repository's
    own files (not an installed package's; a ValueError of the interpreter's, `a, b = x`, is a bug);
    or the OS's refusal to write a path (permission, a read-only file system), naming the path, and
    --out_dir where the path is on its way. Notes added to it (add_note) follow its message."""
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and e.filename:
        path, there = os.path.abspath(str(e.filename)), os.path.abspath(out_dir or ".")
        on_way = (there + os.sep).startswith(path.rstrip(os.sep) + os.sep) or path.startswith(there + os.sep)
        return f"{e.filename}: {e.strerror}" + (f" (--out_dir {out_dir}): pass a folder you can write" if on_way else "")
    if not getattr(e, "refusal", False):
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if not isinstance(e, USER_ERRORS) or tb is None:
            return None
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not path.startswith(ROOT + os.sep) or "site-packages" in path or \
                not linecache.getline(path, tb.tb_lineno).lstrip().startswith("raise "):
            return None
    return "\n".join([str(e), *getattr(e, "__notes__", [])])


def say(message, script=None):
    """A user's mistake, said once, after the script's name. Every rank of a torchrun meets it alike
    (the same flags and data) or alone (a rank's own rows): the first rank of a node to say a
    message prints it, the others see its mark in torchrun's folder of this launch (the one above
    each rank's TORCHELASTIC_ERROR_FILE) and print nothing. Without torchrun's folder, rank 0 says it."""
    message = f"{script or os.path.basename(sys.argv[0])}: {message}"
    if "LOCAL_WORLD_SIZE" in os.environ:
        message += "\n(the report of torchrun's that follows is of this exit)"
    attempt = os.path.dirname(os.path.dirname(os.environ.get("TORCHELASTIC_ERROR_FILE", "")))
    if not os.path.basename(attempt).startswith("attempt_"):  # not torchrun's layout: .../attempt_N/LOCAL_RANK/
        common.print0(message, file=sys.stderr)
        return
    try:
        os.close(os.open(os.path.join(attempt, f"said-{hashlib.sha256(message.encode()).hexdigest()[:16]}"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # another rank said it
        return
    except OSError:
        pass  # no mark: said by each rank that meets it
    print(message, file=sys.stderr, flush=True)
