"""A user's own code named on the command line as `module:function` (--reward_fn, --tools): the
module by name on the Python path, a `name.py` in the working directory, or a .py file by its
path (`path/to/rewards.py:accuracy`), as TRL users keep their reward functions beside their data.
Imports nothing of the project: tools.py's worker processes import it alone."""
import importlib
import importlib.util
import os


def split(spec):
    """`module:function` -> (module, function), at the last colon (a Windows path has one of its own);
    ("", "") parts where one is missing."""
    module, _, name = spec.rpartition(":")
    return module, name


def import_module(module):
    """The module: a .py path loaded from its file; a bare name from the Python path, or from
    `name.py` in the working directory where no module of that name is on the path. Whatever its
    import raises is raised."""
    path = module if module.endswith(".py") else f"{module}.py"
    if module.endswith(".py") or (os.path.isfile(path) and importlib.util.find_spec(module) is None):
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module(module)
