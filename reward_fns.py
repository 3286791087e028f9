"""GRPO's reward functions: the rules of tasks.py by name and your own `module:function`s, loaded
once and called as TRL calls its reward_funcs (fn(prompts=, completions=, completion_ids=,
**columns) -> a float or None per completion), all of a batch at once, each of yours in a worker
process of its own (plumbing/workers.py, as tools.py's tools); their weights, and the column the
rules read as each row's reference (environment.score calls them)."""
import array
import dataclasses
import math
import os
import sys

import tasks
from plumbing import user_code, workers


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
    fn: object  # a rule's function, or the workers.Pool that runs the user's functions of its module
    builtin: bool  # a rule of tasks.REWARD_FNS: fn(prompt, completion, answer) -> float, one row at a time


def load_reward_fns(spec):
    """--reward_fn's functions, each a rule's name or a `module:function` (a module, a `name.py` in
    the working directory, or a .py file: `path/to/rewards.py:fn`; plumbing/user_code.py). A rule
    is called in the trainer (tasks.py's own code); a user's functions are imported here, those of
    one module (one file) together in a worker process of their own (plumbing/workers.py), sharing
    its state as in TRL's one process (a cache one fills, another reads), the modules side by side;
    a bad one (an import that fails, exits or hangs; no such function) is refused naming the flag
    before anything is written. One rule alone ([] here) is every row's `rule`, a row's own
    `reward_fn` column winning."""
    entries = [e.strip() for e in spec.split(",")] if spec else []
    if len(entries) <= 1 and all(e in tasks.REWARD_FNS for e in entries):
        return []
    modules = {}  # each file's (or module's) functions: {key: (module, [names])}
    for e in entries:
        module, name = user_code.split(e)
        if e not in tasks.REWARD_FNS and not (module and name):
            raise ValueError(f"--reward_fn {spec!r}: {e!r} is neither a rule ({', '.join(sorted(tasks.REWARD_FNS))}) "
                             f"nor a `module:function`")
        if e not in tasks.REWARD_FNS:  # rf.py and ./rf.py: one file
            modules.setdefault(os.path.realpath(module) if module.endswith(".py") else module, (module, []))[1].append(name)
    names = [e if e in tasks.REWARD_FNS else user_code.split(e)[1] for e in entries]
    for taken in sorted({n for n in names if names.count(n) > 1} | ({"rule", "model"} & set(names))):
        raise ValueError(f"--reward_fn {spec!r}: two rewards are named {taken!r} (`rule` is each row's own rule and "
                         f"`model` the --reward_model): give each function its own name")
    pools = [workers.Pool(module, fn_names) for module, fn_names in modules.values()]
    of = {name: pool for pool in pools for name in pool.names}
    fns = [RewardFn(e, tasks.REWARD_FNS[e], builtin=True) if e in tasks.REWARD_FNS else RewardFn(n, of[n], builtin=False)
           for e, n in zip(entries, names)]
    for pool in pools:
        pool.start()  # their imports side by side
    for pool in pools:
        failure = pool.idle[0].ready()
        if failure:
            who = pool.idle[0].failed or ",".join(pool.names)  # the function to blame, or all (the import failed)
            raise ValueError(f"--reward_fn {pool.spec}:{who}: cannot load it: {failure}")
    return fns


def check_columns(columns, source, fns):
    """A data column named like an argument TRL passes a reward function itself (prompts,
    completions, completion_ids) would reach it twice: refused, naming the column and the file,
    where a user's function is called."""
    clash = [c for c in columns if c in ("prompts", "completions", "completion_ids")]
    if clash and any(not f.builtin for f in fns):
        raise ValueError(f"{source}: the column {clash[0]!r} has the name of an argument every --reward_fn function "
                         f"is given (prompts, completions, completion_ids), and every other column is passed by its "
                         f"name too: rename the column")


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


FLOAT32_LIMIT = 2.0 ** 128 - 2.0 ** 103  # the least number that float32 rounds to inf (the rewards' dtype)
FAILED = {"raised", "ended", "timeout", "unstarted", "garbled"}  # what a failed call's reply holds (workers.call_all)


class RewardCaller:
    """Calls a run's reward functions on a batch of rows, all at once, as TRL calls its reward_funcs:
    fn(prompts=, completions=, completion_ids=, **columns), sync or `async def`, each in its own
    worker process (workers.call_all), so that slow ones (a judge behind an API) overlap, every call
    gets objects of its own, and nothing a function does can hang or end the run without a word.
    A call that fails (raises anything, ends its process) is run again row by row to find the row
    to name; one that runs past timeout_s seconds (--reward_fn_timeout) stops the run naming its
    rows. rank: named in the errors under torchrun (None: one process)."""

    def __init__(self, fns, timeout_s=600.0, rank=None):
        self.fns = [f for f in fns if not f.builtin]
        self.timeout_s, self.where = timeout_s, "" if rank is None else f" (rank {rank})"
        self.said = set()  # the functions whose all-None batch was reported

    def _calls(self, fns, kw, n):
        """Each function's reply (workers.call_all) on the rows of kw (n of them), in the order of fns
        (those of one module one after the other, as TRL calls its reward_funcs)."""
        return workers.call_all([(f.fn, workers.request(f.name, (), kw, ["rewards", n])) for f in fns],  # objects
                                self.timeout_s)  # of their own in each row, as TRL's

    def __call__(self, prompts, completions, completion_ids, columns, rows, source):
        """{name: [float, NaN for None]} of each function on these rows. rows: each row's number
        in the data set (1-based), for the errors; columns: every other column, as lists."""
        kw = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        replies = self._calls(self.fns, kw, len(rows))
        for f, (header, _) in zip(self.fns, replies):
            if "timeout" in header:
                what = _failure(header, f"on {source} rows {_rows(rows)}")
                raise failed(f"--reward_fn {f.name}{self.where} {what}: raise the flag for a slow function; one that "
                             f"can hang on a row can bound itself (signal.alarm) and return None for it")
            if FAILED & set(header):
                raise failed(*self._culprit(f, kw, rows, source, header))
        out = {f.name: check_rewards(header, data, f.name + self.where, rows, source)
               for f, (header, data) in zip(self.fns, replies)}
        for name, values in out.items():
            if name not in self.said and values and all(math.isnan(v) for v in values):
                self.said.add(name)
                print(f"warning: --reward_fn {name}{self.where} returned None (or NaN) for every completion of a batch "
                      f"({source} rows {_rows(rows)}): they are left out of every mean, and a completion that no "
                      f"reward scores has advantage 0 (TRL warns alike; said once)", file=sys.stderr, flush=True)
        return out

    def _culprit(self, f, kw, rows, source, header):
        """(`--reward_fn NAME raised on SOURCE row K: WHAT`, its traceback), K the first row whose call
        alone fails (none: the rows together)."""
        for i, row in enumerate(rows):
            alone, _ = self._calls([f], {k: v[i:i + 1] for k, v in kw.items()}, 1)[0]
            if FAILED & set(alone):
                return f"--reward_fn {f.name}{self.where} {_failure(alone, f'on {source} row {row}')}", alone.get("frames")
        return (f"--reward_fn {f.name}{self.where} {_failure(header, f'on {source} rows {_rows(rows)} together')}",
                header.get("frames"))


def failed(message, frames=""):
    """The ValueError that stops a run whose reward function failed, with `frames`, the function's own
    traceback (workers._frames): cli.script prints them and the message, not the trainer's frames,
    which say nothing of the function."""
    e = ValueError(message)
    e.frames = frames or ""
    return e


def _failure(header, where):
    """What a failed call did (workers.call_all's reply), in words: `raised on SOURCE row K:
    RuntimeError: ...`, `ended its worker process (exit status 0) on SOURCE row K`."""
    if "raised" in header:
        return f"raised {where}: {header['raised']}"
    if "timeout" in header:
        return f"ran past --reward_fn_timeout {header['timeout']:g} s {where} (its worker was killed)"
    if "unstarted" in header:
        return f"could not be started again {where}: {header['unstarted']}"
    if "garbled" in header:
        return (f"wrote {header['garbled']} onto its worker's channel to the trainer {where} (its worker was killed): "
                f"a function must write only to files and descriptors it opened")
    return f"ended its worker process ({header['ended']}) {where}"


def check_weighted_sum(parts, weights, rows, source):
    """Each row's weighted rewards (environment.combine sums weight x reward, None left out) must sum
    inside float32's range, the rewards' dtype, in any order: their magnitudes sum below
    FLOAT32_LIMIT, which bounds every partial sum. Each reward alone is checked (check_rewards); a
    reward of 1e38 with weight 10 is not, and its row's advantages and the loss would be NaN. A
    ValueError naming the row, each reward, its value and its weight. parts: {name: (N,) floats, None or
    NaN where a function has no reward}, the rewards computed on the host (no device read)."""
    names = [k for k in weights if k in parts]
    for row, values in zip(rows, zip(*[[math.nan if v is None else float(v) for v in parts[k]] for k in names])):
        terms = [(k, v, weights[k]) for k, v in zip(names, values) if v == v]  # NaN (None) is left out
        if math.fsum(abs(v * w) for _, v, w in terms) >= FLOAT32_LIMIT:
            raise failed(f"the rewards of {source} row {row}, weighted (--reward_weights) and summed in float32, leave "
                         f"its range (|x| < 3.4e38): {', '.join(f'{k} {v:.3g} x weight {w:g}' for k, v, w in terms)}; "
                         f"scale the rewards or their weights down")


def _rows(rows):
    """The rows of a call, for a message: `3, 7, 12` (each once), the first 8 of many."""
    distinct = sorted(set(rows))
    return ", ".join(map(str, distinct[:8])) + (f", ... ({len(distinct)} rows)" if len(distinct) > 8 else "")


def check_rewards(header, data, name, rows, source):
    """A function's reply (workers._rewards: float64s, NaN for None) as floats, as TRL reads its
    return: one real number or None per completion, finite in float32 (the rewards' dtype: 1e39 is
    inf there, and the loss NaN); anything else is an error naming the row."""
    if "not" in header:
        length = f" of length {header['length']}" if header["length"] is not None else ""
        raise ValueError(f"--reward_fn {name} returned {header['not']}{length} for {len(rows)} completions: return a "
                         f"list of one float (or None) per completion")
    values, bad = array.array("d", data).tolist(), header.get("bad", {})  # JSON's keys: the indices as text
    for i, v in enumerate(values):
        if str(i) in bad or abs(v) >= FLOAT32_LIMIT:  # NaN (None) passes: left out of the sums
            what = bad.get(str(i), repr(v))
            raise ValueError(f"--reward_fn {name} returned {what} for {source} row {rows[i]}: a reward is a number "
                             f"finite in float32 (|x| < 3.4e38), or None where it does not apply")
    return values
