"""A user's own code named on the command line as `module:function` (--reward_fn, --tools): the
module by name (a `name.py` or package in the working directory first, then the Python path), or a
.py file by its path (`path/to/rewards.py:accuracy`), as TRL users keep their reward functions
beside their data. It is imported in a worker process (plumbing/workers.py; one for the functions
of one module), never in the trainer, as Python imports a script: its folder first on the path, so
a `helper.py` beside it imports, and a file named like one of this project's modules (`tasks.py`,
`data.py`) is the user's. Imports nothing of the project: the workers import it alone."""
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


class LoadError(ValueError):
    """A function that cannot be used, and its name (None: its module's import failed)."""

    def __init__(self, message, name=None):
        super().__init__(message)
        self.name = name


def shadowed(mod, module, name):
    """Where a file or package named `module` is in the working directory but `import module` found
    another (a module of the standard library, or one imported before it: the workers use json,
    socket, pickle...): ": that is the standard library's json, not json.py in the working
    directory, which it shadows; ..." ("" otherwise)."""
    if module.endswith(".py"):
        return ""
    here = os.path.join(os.getcwd(), *module.split("."))
    mine = next((p for p in (here + ".py", os.path.join(here, "__init__.py")) if os.path.isfile(p)), None)
    if not mine or os.path.realpath(mine) == os.path.realpath(getattr(mod, "__file__", None) or ""):
        return ""
    what = "the standard library's" if module.split(".")[0] in sys.stdlib_module_names else "another module"
    return (f": that is {what} {module}, not {os.path.relpath(mine)} in the working directory, which it shadows; "
            f"rename your file, or name it by its path: {os.path.relpath(mine)}:{name}")


def load_functions(module, names):
    """{name: function} of the functions `names` of `module` (import_module, once); a LoadError
    saying why one cannot be used: the module's import failed (anything its code raises, SystemExit
    included), it has no such name (naming the file it imported, and a file of the user's it shadows),
    or the name is not callable."""
    try:
        mod = import_module(module)
    except BaseException as e:  # SyntaxError, a missing dependency, SystemExit: anything the module's code does
        raise LoadError(f"importing module {module!r} failed: {describe(e, where=True)}") from None
    fns = {}
    for name in names:
        fns[name] = getattr(mod, name, None)
        if fns[name] is None:
            where = "" if module.endswith(".py") else f" ({getattr(mod, '__file__', None) or 'built in'})"  # the file
            raise LoadError(f"module {module!r}{where} has no {name!r}{shadowed(mod, module, name)}", name)
        if not callable(fns[name]):
            raise LoadError(f"{module}.{name} is not a function", name)
    return fns
