"""A user's mistake, said as one message: what counts as one (user_error: a flag's value, a data
row, a file, a missing template; not a bug, whose traceback shows) and saying it once, under
torchrun too (say). cli.script and cli.parse_config end a run with it."""
import errno
import json
import linecache
import os
import sys
import time

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
    """A user's mistake, said once, after the script's name: printed by rank 0 (every rank of a
    torchrun sees the same flags and data), and under torchrun written as each rank's error record
    (TORCHELASTIC_ERROR_FILE), so that torchrun's closing summary shows it, naming the rank that
    failed first, where it would show a link to the docs on tracebacks."""
    message = f"{script or os.path.basename(sys.argv[0])}: {message}"
    common.print0(message, file=sys.stderr)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump({"message": message, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # torchrun's summary then links to its docs, as it would have
