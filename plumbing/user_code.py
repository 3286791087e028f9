"""A user's own code named on the command line as `module:function` (--reward_fn, --tools): the
module by name (a `name.py` or package in the working directory first, then the Python path), or a
.py file by its path (`path/to/rewards.py:accuracy`), as TRL users keep their reward functions
beside their data. It is imported in a worker process of its own (plumbing/workers.py), never in
the trainer, as Python imports a script: its folder first on the path, so a `helper.py` beside it
imports, and a file named like one of this project's modules (`tasks.py`, `data.py`) is the user's.
Imports nothing of the project: the workers import it alone."""
import importlib
import importlib.util
import os
import sys
import traceback


def split(spec):
    """`module:function` -> (module, function), at the last colon (a Windows path has one of its own);
    ("", "") parts where one is missing."""
    module, _, name = spec.rpartition(":")
    return module, name


def describe(e, where=False):
    """An exception as one line: its type, its message and, with where, the file and line it was
    raised at, outside importlib's and this file's frames (a SyntaxError's message has them)."""
    try:
        ours = (os.path.dirname(importlib.__file__), os.path.abspath(__file__), "<frozen")
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(ours)]
        frame = frames[-1] if where and frames else None
        at = f" ({frame.filename}:{frame.lineno})" if frame and not isinstance(e, SyntaxError) else ""
        return f"{type(e).__name__}: {e}{at}" if str(e) else f"{type(e).__name__}{at}"
    except BaseException:  # an exception whose str() raises
        return type(e).__name__


def import_module(module):
    """The module: a .py path loaded from its file, its folder put first on sys.path; a bare name
    with the working directory first on sys.path (`python -m` puts it there), so the user's
    `name.py` wins over a module of that name elsewhere. A file's module is registered under its
    name unless one is (pickle and dataclasses look modules up there). Whatever its import raises
    is raised. Changes sys.path for the process: call it in a worker."""
    if not module.endswith(".py"):
        sys.path.insert(0, os.getcwd())
        return importlib.import_module(module)
    sys.path.insert(0, os.path.dirname(os.path.abspath(module)))
    name = os.path.basename(module)[:-3]
    spec = importlib.util.spec_from_file_location(name, module)
    mod = importlib.util.module_from_spec(spec)
    mine = sys.modules.setdefault(name, mod) is mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        if mine:
            del sys.modules[name]
        raise
    return mod


def load_function(spec):
    """The function `module:function` names, imported (import_module); a ValueError saying why it
    cannot be used: its import failed (anything its code raises, SystemExit included), it has no
    such name, or the name is not callable."""
    module, name = split(spec)
    try:
        fn = getattr(import_module(module), name, None)
    except BaseException as e:  # SyntaxError, a missing dependency, SystemExit: anything the module's code does
        raise ValueError(f"importing module {module!r} failed: {describe(e, where=True)}") from None
    if fn is None:
        raise ValueError(f"module {module!r} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"{module}.{name} is not a function")
    return fn
