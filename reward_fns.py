"""GRPO's reward functions: the rules of tasks.py by name and your own `module:function`s, loaded
once and called as TRL calls its reward_funcs (fn(prompts=, completions=, completion_ids=,
**columns) -> a float or None per completion), all of a batch at once; their weights, and the
column the rules read as each row's reference (environment.score calls them)."""
import asyncio
import concurrent.futures
import dataclasses
import inspect
import math
import numbers
import threading

import tasks
from plumbing import user_code


def answer_column(ds, cfg, source, needed):
    """The column the rules read as a row's reference: --answer_column, else `answer`, else TRL's
    `solution` (its math sets and accuracy_reward); refused, naming the file and its columns, when
    a rule that needs one (`needed`) finds none."""
    name = cfg.answer_column or next((c for c in ("answer", "solution") if c in ds.column_names), None)
    if (needed or cfg.answer_column) and name not in ds.column_names:
        asked = f"--answer_column {cfg.answer_column}" if cfg.answer_column else "an `answer` or `solution` column"
        raise ValueError(f"{source}: the reward needs {asked} (each row's reference); it has columns {ds.column_names}: "
                         f"name the column with --answer_column")
    return name


@dataclasses.dataclass
class RewardFn:
    name: str  # a rule's name, or the function's in `module:function` (its weight's and its metrics' name)
    fn: object
    builtin: bool  # a rule of tasks.REWARD_FNS: fn(prompt, completion, answer) -> float, one row at a time


def _import(module, flag):
    """plumbing.user_code.import_module, any failure at import (a missing file or dependency, an error
    in the module) a ValueError naming the flag."""
    try:
        return user_code.import_module(module)
    except Exception as e:
        raise ValueError(f"{flag}: cannot import {module!r}: {type(e).__name__}: {e}") from None


def load_reward_fns(spec):
    """--reward_fn's functions, each a rule's name or a `module:function` (a module on the Python
    path, a `name.py` in the working directory, or a .py file: `path/to/rewards.py:fn`), imported
    once here, so a bad one is refused naming the flag before anything is written. One rule alone
    ([] here) is every row's `rule`, a row's own `reward_fn` column winning."""
    entries = [e.strip() for e in spec.split(",")] if spec else []
    if len(entries) <= 1 and all(e in tasks.REWARD_FNS for e in entries):
        return []
    fns = []
    for e in entries:
        module, name = user_code.split(e)
        if e in tasks.REWARD_FNS:
            fns.append(RewardFn(e, tasks.REWARD_FNS[e], builtin=True))
            continue
        if not module or not name:
            raise ValueError(f"--reward_fn {spec!r}: {e!r} is neither a rule ({', '.join(sorted(tasks.REWARD_FNS))}) "
                             f"nor a `module:function`")
        fn = getattr(_import(module, f"--reward_fn {e}"), name, None)
        if not callable(fn):
            raise ValueError(f"--reward_fn {e}: {module!r} has no function {name!r}")
        fns.append(RewardFn(name, fn, builtin=False))
    names = [f.name for f in fns]
    for taken in sorted({n for n in names if names.count(n) > 1} | ({"rule", "model"} & set(names))):
        raise ValueError(f"--reward_fn {spec!r}: two rewards are named {taken!r} (`rule` is each row's own rule and "
                         f"`model` the --reward_model): give each function its own name")
    return fns


def parse_weights(spec, has_model, has_teacher=False, names=()):
    """`rule:1.0,model:0.5` -> {"rule": 1.0, "model": 0.5}: each reward by its name (`rule`, each
    row's rule; `model`, the reward model; each --reward_fn function's, `names`; the weight after
    the last colon). Empty: every --reward_fn function and the reward model at 1 (TRL's default),
    else the one reward there is. Each reward is named once, and some weight is not 0 unless a
    --teacher (has_teacher) gives the advantages: with all weights 0 they are all 0, and nothing is
    trained."""
    if not spec:
        return dict.fromkeys([*names, *(["model"] if has_model else [])], 1.0) if names else \
            ({"model": 1.0} if has_model else {"rule": 1.0})
    parts = [(name.strip(), w) for name, _, w in (part.rpartition(":") for part in spec.split(","))]
    twice = sorted({name for name, _ in parts if [n for n, _ in parts].count(name) > 1})
    if twice:
        raise ValueError(f"--reward_weights {spec!r} names {', '.join(twice)} twice: give each reward one weight")
    weights = dict(parts)
    for name, w in weights.items():
        try:
            weights[name] = float(w)
        except ValueError:
            weights[name] = math.nan
        if name not in ("rule", "model", *names) or not math.isfinite(weights[name]):
            known = ", ".join(f"{n}:1.0" for n in ("rule", "model", *names))
            raise ValueError(f"--reward_weights {spec!r}: expected parts like {known} (finite weights), one per reward")
    missing = [n for n in names if n not in weights]
    if missing:
        raise ValueError(f"--reward_weights {spec!r} gives no weight to --reward_fn's {', '.join(missing)}: name each "
                         f"(0 to log it without training on it)")
    if "model" in weights and not has_model:
        raise ValueError(f"--reward_weights {spec!r} uses `model` but no --reward_model is given")
    if not has_teacher and not any(weights.values()):
        raise ValueError(f"--reward_weights {spec!r} gives every reward weight 0 and there is no --teacher: nothing "
                         f"would be trained (every advantage is 0)")
    return weights


class RewardCaller:
    """Calls a run's reward functions on a batch of rows, all at once: each plain function in a
    thread of its own, the `async def` ones on one event loop (kept for the run, in a thread, as
    TRL keeps one) awaited together, so that slow ones (a judge behind an API) overlap. A function
    that raises is run again row by row to find the row to name."""

    def __init__(self, fns):
        self.fns = [f for f in fns if not f.builtin]
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, len(self.fns)))
        self.loop = None
        if any(inspect.iscoroutinefunction(f.fn) for f in self.fns):
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def _submit(self, f, kw):
        if inspect.iscoroutinefunction(f.fn):
            return asyncio.run_coroutine_threadsafe(f.fn(**kw), self.loop)
        return self.pool.submit(f.fn, **kw)

    def __call__(self, prompts, completions, completion_ids, columns, rows, source):
        """{name: [float, NaN for None]} of each function on these rows. rows: each row's number
        in the data set (1-based), for the errors; columns: every other column, as lists."""
        kw = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        futures = [self._submit(f, kw) for f in self.fns]
        out = {}
        for f, future in zip(self.fns, futures):
            try:
                values = future.result()
            except Exception as e:
                raise ValueError(self._culprit(f, kw, rows, source) + f"{type(e).__name__}: {e}") from e
            out[f.name] = check_rewards(values, f.name, rows, source)
        return out

    def _culprit(self, f, kw, rows, source):
        """`--reward_fn NAME raised on SOURCE row K: `, K the first row that raises alone (none: every row)."""
        for i, row in enumerate(rows):
            try:
                self._submit(f, {k: v[i:i + 1] for k, v in kw.items()}).result()
            except Exception:
                return f"--reward_fn {f.name} raised on {source} row {row}: "
        return f"--reward_fn {f.name} raised on {source} rows {rows[0]}..{rows[-1]} together: "


def check_rewards(values, name, rows, source):
    """A function's return value as floats, None (not applicable) as NaN, as TRL reads it: a list
    of one real number or None per completion; anything else is an error naming the row."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != len(rows):
        raise ValueError(f"--reward_fn {name} returned {type(values).__name__} "
                         f"{'of length ' + str(len(values)) if hasattr(values, '__len__') else ''} for {len(rows)} "
                         f"completions: return a list of one float (or None) per completion")
    out = []
    for v, row in zip(values, rows):
        if v is not None and not (isinstance(v, numbers.Real) and not math.isinf(v)):
            raise ValueError(f"--reward_fn {name} returned {v!r} for {source} row {row}: a reward is a finite "
                             f"number, or None where it does not apply")
        out.append(math.nan if v is None else float(v))
    return out
