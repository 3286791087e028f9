"""The data users bring, checked row by row: an embedded task, local .jsonl / .json / .csv /
.parquet files (read in memory, split by prompt hash when no held-out file is given) or hub ids
(read with `datasets`); prompt-completion rows, preference pairs (with the Anthropic HH format
split into prompt and responses) and prompts; the tokenizer (its chat template, its stop ids);
tokenised with the truncation rules every script shares, and batched in the layout of common.py.
GRPO's Env (what a rollout samples and what scores it) is built here too.
"""
import csv
import hashlib
import io
import json
import os

import torch

import common
import sampling
import tasks

FILE_TYPES = (".jsonl", ".json", ".csv", ".parquet")
HOLDOUT = 0.05  # share of a local file's prompts held out for evaluation when no --eval_dataset is given
# the columns some script reads (read_file's default): one a script reads that cannot be stored is an
# error, any other is left out
COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages", "text", "reward_fn", "answer", "margin")


def decode_utf8(path, raw):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line}: not UTF-8 text (byte {raw[e.start]:#04x}); save the file as "
                         f"UTF-8") from None


def _json_rows(path, text):
    """The rows of a .jsonl (one object per line) or .json (a list of objects) file; a line
    that is not a JSON object is named."""
    if path.endswith(".json"):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {e.lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path}: expected a JSON list of objects (one per row)")
        return rows
    rows = []
    # not splitlines(): U+2028, U+2029 and U+0085 may sit inside a JSON string; CRLF's "\r" is JSON whitespace
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _csv_rows(path, text):
    """The rows of a .csv file, every cell text exactly as written (pyarrow would read a column of
    " 19" and "046" as the numbers 19 and 46): an empty cell is the empty text, as `""` is in a
    JSON row (CSV has no other way to write it, nor a missing value); `margin` is a float, and an
    empty margin None (missing)."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, [])
    twice = next((name for i, name in enumerate(header) if name in header[:i]), None)
    if twice is not None:  # dict(zip(...)) would keep the last of them and drop the others without a word
        columns = [str(i + 1) for i, name in enumerate(header) if name == twice]
        raise ValueError(f"{path}: the header names column {twice!r} more than once (columns {', '.join(columns)}); "
                         f"give each column its own name")
    rows = []
    for n, cells in enumerate((c for c in reader if c), 1):  # blank lines skipped
        if len(cells) != len(header):
            raise ValueError(f"{path} row {n}: {len(cells)} fields, while the header names {len(header)}; quote "
                             f"each field that holds a comma")
        row = dict(zip(header, cells))
        if "margin" in row:  # a number, or missing (an empty cell)
            try:
                row["margin"] = float(row["margin"]) if row["margin"] else None
            except ValueError:
                raise ValueError(f"{path} row {n}: field 'margin' is {row['margin']!r}, not a number") from None
        rows.append(row)
    return rows


def _arrow_column(values, column):
    """values as one Arrow array; ValueError naming the first row (1-based) whose value cannot share
    a type with the rows before it."""
    import pyarrow

    kinds = {type(v) for v in values if v is not None}
    if len(kinds - {int, float}) + bool(kinds & {int, float}) > 1:  # ints and floats mix as floats
        first = next(type(v) for v in values if v is not None)
        i = next(i for i, v in enumerate(values) if v is not None and type(v) is not first
                 and not {type(v), first} <= {int, float})
        raise ValueError(f"row {i + 1}: field {column!r} is {type(values[i]).__name__}, while earlier rows hold "
                         f"{first.__name__}")
    try:
        return pyarrow.array(values)
    except (pyarrow.ArrowException, OverflowError) as e:  # nested values of different types
        lo, hi = 1, len(values)  # the shortest prefix that fails ends at the row to name
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                pyarrow.array(values[:mid])
                lo = mid + 1
            except (pyarrow.ArrowException, OverflowError):
                hi = mid
        raise ValueError(f"row {lo}: field {column!r} does not match the types of the rows before it ({e}); give "
                         f"it the same structure in every row") from None


def read_file(path, reads=COLUMNS):
    """A local .jsonl / .json / .csv / .parquet file as an in-memory `datasets.Dataset`: nothing
    is copied into the datasets cache (~/.cache/huggingface/datasets), which a
    `load_dataset("json", data_files=...)` would fill with an Arrow copy on every new file.
    Every column any row has is kept (missing values are None, for the row checks to name), but one
    the script does not read (not in `reads`) that a Dataset cannot hold (rows that do not share
    one type; a parquet type `datasets` has none for, such as a map) is left out, with a note; in
    a column it reads, that is an error naming the row or the type. A parquet file's columns keep
    their Arrow types (uint64 ids above 2**63 included). A reference column the script reads
    (`answer`, `solution`, --answer_column's) whose rows mix numbers and text is read as text,
    with a note: answers 4 and "4" are one answer to the rules. The file is checked
    before it is opened: a FIFO would block, and load_data reads it twice."""
    import datasets

    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory; pass one data file ({', '.join(FILE_TYPES)})")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{path} is not a regular file (a FIFO/device/socket); pass a data file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} does not exist")
    if not path.endswith(FILE_TYPES):
        raise ValueError(f"{path}: unknown file type; data files are {', '.join(FILE_TYPES)}")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path} is empty")
    if path.endswith(".parquet"):
        import pyarrow.parquet

        try:
            table = pyarrow.parquet.read_table(path)
        except Exception as e:  # pyarrow's messages do not name the file
            raise ValueError(f"{path}: could not be read as parquet: {e}") from None
        keep = []
        for field in table.schema:
            try:
                datasets.Features.from_arrow_schema(pyarrow.schema([field]))
                keep.append(field.name)
            except (ValueError, TypeError, NotImplementedError):
                if field.name in reads:
                    raise ValueError(f"{path}: column {field.name!r} is {field.type}, which `datasets` cannot "
                                     f"hold: give it a plain type (text, numbers, lists, structs)") from None
                common.print0(f"{path}: left out column {field.name!r}, which this script does not read: "
                              f"{field.type}, which `datasets` cannot hold")
        return datasets.Dataset(datasets.table.InMemoryTable(table.select(keep).replace_schema_metadata()))
    with open(path, "rb") as f:
        text = decode_utf8(path, f.read()).removeprefix("\ufeff")  # a byte-order mark (Excel) is no part of a name
    rows = _csv_rows(path, text) if path.endswith(".csv") else _json_rows(path, text)
    data = {}
    for c in dict.fromkeys(k for r in rows for k in r):
        values = [r.get(c) for r in rows]
        kinds = {type(v) for v in values if v is not None}
        mixed = str in kinds and kinds - {str} and kinds <= {str, int, float}
        if mixed and c in reads and (c == "answer" or c not in COLUMNS):  # 4 and "4": one answer to the rules
            values = [v if v is None or isinstance(v, str) else json.dumps(v) for v in values]
            common.print0(f"note: {path}: column {c!r} holds both numbers and text; its numbers are read as text "
                          f"(4 as \"4\")")
        try:
            data[c] = _arrow_column(values, c)
        except ValueError as e:
            if c in reads:
                raise ValueError(f"{path} {e}") from None
            common.print0(f"{path}: left out column {c!r}, which this script does not read: {e}")
    return datasets.Dataset.from_dict(data)


def _hash(prompt):
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)  # a conversation
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def held_out(prompt):
    """Whether a prompt belongs to the held-out share of a local file: a hash of its text, so the
    split is the same on every run and every rank, and rows sharing a prompt stay together."""
    return _hash(prompt) < HOLDOUT * 16**8


MIN_EVAL = 25  # held-out rows below which eval/* is noise: an accuracy over n has a standard error up to 0.5/sqrt(n)


def holdout_rows(prompts, name, split, what="rows", eval_on_train=True):
    """The rows (indices) of split "train" or "test" of a local file without a held-out file of its
    own. The held-out rows are those whose prompt hashes into HOLDOUT (held_out); where none does (a
    small file: 64 distinct prompts hold none out 4% of the time, 20 prompts 36%), or all do, those
    of its prompt of lowest hash, so that no file is refused for its size. A file that cannot be
    split so (one prompt; or fewer than 1 / HOLDOUT rows, whose share is under one row, holding none
    out by hash) trains on every row: its "test" rows are all of them (eval/* measures the training
    rows) or, where not eval_on_train, None (no evaluation), said. The "train" call prints how many
    rows each split has, and warns where the held-out ones are too few to read (small_eval)."""
    hashes = [_hash(p) for p in prompts]
    test = [h < HOLDOUT * 16**8 for h in hashes]
    fallback = "none" if not any(test) else "all" if all(test) else ""
    if fallback:
        test = [h == min(hashes) for h in hashes]
    if all(test) or (fallback and len(prompts) * HOLDOUT < 1):
        if split == "train":
            why = "one prompt" if all(test) else f"under {1 / HOLDOUT:.0f}, {fallback} hashing into the held-out share"
            then = (f"eval/* is measured on the training {what}" if eval_on_train else "no evaluation")
            common.print0(f"warning: {name}: no --eval_dataset, and its {len(prompts)} {what} are too few to split "
                          f"({why}): training on all of them, {then}; pass --eval_dataset with held-out {what}")
        return list(range(len(prompts))) if split == "train" or eval_on_train else None
    rows = [i for i, t in enumerate(test) if t == (split == "test")]
    if split == "train":
        n, k = len(prompts), len(prompts) - len(rows)
        which = (f"and {fallback} of its {n} {what} hash into the held-out {HOLDOUT:.0%}, so the {k} {what} of its "
                 f"prompt of lowest hash" if fallback else
                 f"so the {k} of {n} {what} whose prompt hashes into the held-out {HOLDOUT:.0%}")
        common.print0(f"{name}: no --eval_dataset, {which} are kept for evaluation, not trained on; {n - k} {what} to "
                      f"train on")
        small_eval(k, name, what)
    return rows


def small_eval(n, name, what="rows"):
    """Warn where a held-out set of n rows is too small to read (fewer than MIN_EVAL): an accuracy
    over n pairs moves by up to 0.5/sqrt(n) from one draw of them to another (one standard error),
    and a loss over n rows as much as its rows differ."""
    if n < MIN_EVAL:
        common.print0(f"warning: {name}: {n} held-out {what}: too few to read eval/* (an accuracy over {n} has a "
                      f"standard error up to {0.5 / n ** 0.5:.2f}); pass --eval_dataset with {MIN_EVAL} or more")


def hold_out(ds, name, split):
    """The rows of split "train" or "test" of a local file that has no splits of its own (holdout_rows)."""
    return ds.select(holdout_rows(ds["prompt" if "prompt" in ds.column_names else "text"][:], name, split))


def looks_local(name):
    """A name that can only be a local path, never a hub id ("org/name" or "name"): it starts
    with . / ~, has two or more slashes, ends with a slash, or its first folder exists here
    (runs/sftt when runs/ exists)."""
    return (name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/")
            or ("/" in name and os.path.isdir(name.split("/")[0])))


def load_data(name, split, columns, kind=None, n=None, seed=0, holdout=False, optional=()):
    """A `datasets.Dataset` with string `columns`, from an embedded task (`sort`), a local
    .jsonl / .json / .csv / .parquet file (read_file), or a hub id. Every row is checked: a
    missing or non-string field is an error naming the file, the row (1-based) and the field; an
    empty one is read as empty text, with a note counting such rows. No row is dropped; a column
    neither in `columns` nor `optional` (those the caller reads where present) that cannot be
    stored is left out with a note (read_file).

    kind ("sft", "preference", "prompt") and n pick the rows of an embedded task. holdout: a
    local file is split by prompt hash (hold_out) into `split` "train" or "test".
    """
    import datasets

    if name in tasks.TASKS:
        split = "test" if split in ("test", "validation", "eval") else split
        ds = datasets.Dataset.from_list(tasks.task_rows(name, kind, n, seed=seed, split=split))
    elif name.endswith(FILE_TYPES) or (os.path.exists(name) and not os.path.isdir(name)):
        ds = read_file(name, reads={*columns, *optional, *(["messages"] if "prompt" in columns else [])})
    elif looks_local(name) and not os.path.isdir(name):
        raise FileNotFoundError(f"{name}: no such file or folder (a local path, not a hub id)")
    else:  # a hub id, or a local dataset folder with its own split files
        try:
            ds = datasets.load_dataset(name, split=split)
        except ValueError as e:  # "Unknown split", "no data files" (a folder)
            raise ValueError(f"{name} ({split}): {e}") from None
    if len(ds) == 0:
        raise ValueError(f"{name} ({split}): no rows")
    if "completion" in columns and "text" in ds.column_names and not {"prompt", "completion", "messages"} & {
            *ds.column_names}:
        columns = ["text"]  # TRL's language-modelling rows: SFT trains on every token of the text
    if "messages" in ds.column_names and "prompt" in columns and "prompt" not in ds.column_names:
        ds = split_messages(ds, name, every_turn="completion" in columns)
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"{name} ({split}): missing column(s) {missing}; has {ds.column_names}")
    for c in columns:
        values = ds[c][:]  # the whole column, a list: iterating a datasets Column formats each row, 100x slower
        check_field(values, c, name)
        if c == "text" and is_conversation(values[0]):
            raise ValueError(f"{name}: column 'text' holds conversations; name it `messages`, TRL's column for them")
        empty = [i + 1 for i, v in enumerate(values) if v == ""]
        if empty:  # legitimate (an empty completion trains the model to stop at once), and worth a look
            common.print0(f"note: {name}: {len(empty)} of {len(ds)} rows have an empty {c!r} (row"
                          f"{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty[:5]))}"
                          f"{', ...' if len(empty) > 5 else ''}), read as empty text")
    if holdout and os.path.isfile(name):
        ds = hold_out(ds, name, split)
    elif split != "train" and name not in tasks.TASKS:  # a held-out set of its own (a hub split, --eval_dataset)
        small_eval(len(ds), name if os.path.isfile(name) else f"{name} ({split})")
    return ds


class DataOrder:
    """The rows of each global batch: one seeded permutation per epoch, the same on every rank
    (each then takes its slice, shard_batch). Its state goes into checkpoints, so a resumed run
    draws exactly the rows the uninterrupted one would have. A data set of fewer rows than one
    batch is refused (`source` names it, `flag` the batch's size): the batch would be short, and
    every loss divided by the full batch's size."""

    def __init__(self, n, seed, batch=1, source="the data set", flag="--batch_size"):
        if n < batch:
            raise ValueError(f"{source} has {n} training rows, fewer than one batch ({flag} {batch}): give it more "
                             f"rows or pass a smaller {flag}")
        self.n, self.gen = n, torch.Generator().manual_seed(seed)
        self.order, self.pos = torch.randperm(n, generator=self.gen), 0

    def next(self, k):
        """The next k row indices (a list); a new permutation when the epoch has fewer left."""
        if self.pos + k > self.n:
            self.order, self.pos = torch.randperm(self.n, generator=self.gen), 0
        rows = self.order[self.pos:self.pos + k].tolist()
        self.pos += k
        return rows

    def state_dict(self):
        return {"order": self.order, "pos": self.pos, "order_gen": self.gen.get_state()}

    def load_state_dict(self, state):
        self.order, self.pos = state["order"], state["pos"]
        self.gen.set_state(state["order_gen"])


# -----------------------------------------------------------------------------
# conversational rows (TRL's formats): lists of {"role", "content"} messages, rendered to text
# with the tokenizer's own chat template


def is_conversation(v):
    """A non-empty list of {"role": str, "content": str} messages."""
    return isinstance(v, list) and len(v) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v)


def check_field(values, column, source):
    """Every row's `column` is a string, or every row's is a conversation; anything else (a
    missing field, a number, a bad message, a mix of the two) is named with its row."""
    chat = is_conversation(values[0])
    kind = "a conversation (a list of messages)" if chat else "a string"
    for i, v in enumerate(values):
        if is_conversation(v) if chat else isinstance(v, str):
            continue
        if v is None:
            raise ValueError(f"{source} row {i + 1}: missing field {column!r}")
        if isinstance(v, str) or is_conversation(v):
            raise ValueError(f"{source} row {i + 1}: field {column!r} is {'a string' if isinstance(v, str) else 'a conversation'}, "
                             f"while row 1's is {kind}: a column is all text or all conversations")
        if isinstance(v, list):
            raise ValueError(f"{source} row {i + 1}: field {column!r} is a list but not of {{\"role\", \"content\"}} "
                             f"messages with string values")
        raise ValueError(f"{source} row {i + 1}: field is {type(v).__name__}, not a string: {column!r}")


def split_messages(ds, source, every_turn=False):
    """Conversational language-modelling rows (`messages`) as prompt-completion rows. The last
    message must be the assistant's. every_turn (SFT, as TRL's assistant-only loss): the prompt is
    the turns before the first assistant message and the completion all the rest, each of its
    assistant turns trained on (assistant_turns); else (GRPO's prompts) the last message is the
    completion and every turn before it the prompt."""
    import datasets

    conversations = ds["messages"][:]
    check_field(conversations, "messages", source)
    prompts, completions = [], []
    for i, msgs in enumerate(conversations):
        if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
            raise ValueError(f"{source} row {i + 1}: `messages` must end with an assistant message after at least "
                             f"one other (it ends with {msgs[-1]['role']!r}, {len(msgs)} message(s))")
        k = next(k for k, m in enumerate(msgs) if m["role"] == "assistant") if every_turn else len(msgs) - 1
        if k == 0:
            raise ValueError(f"{source} row {i + 1}: `messages` starts with an assistant message, which has no turn "
                             f"before it to answer: begin the conversation with a system or user message")
        prompts.append(msgs[:k])
        completions.append(msgs[k:])
    other = {c: ds[c][:] for c in ds.column_names if c != "messages"}
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions, **other})


def shared_turns(chosen, rejected):
    """The implicit-prompt preference format: two conversations that share their first turns.
    Returns (prompt, chosen, rejected) as message lists; ValueError when they share none, or
    one is a prefix of the other."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if k == 0 or k == len(chosen) or k == len(rejected):
        raise ValueError("the chosen and rejected conversations must share their first turn(s) and then differ")
    return chosen[:k], chosen[k:], rejected[k:]


def chat_columns(ds, tokenizer, source):
    """The text columns of ds that some script renders (prompt, completion, chosen, rejected) if
    they are conversations, else []; a mix of text and conversations, or conversations without a
    chat template, is refused."""
    columns = [c for c in ("prompt", "completion", "chosen", "rejected") if c in ds.column_names]
    chat = [c for c in columns if is_conversation(ds[0][c])]
    if chat and chat != columns:
        raise ValueError(f"{source}: columns {chat} are conversations but {sorted(set(columns) - set(chat))} are text: "
                         f"give all of them as messages, or all as text")
    if chat and not tokenizer.chat_template:
        raise ValueError(f"{source}: conversational rows need a chat template, and this tokenizer has none: pass "
                         f"--chat_template FILE (a Jinja template), or give the rows as plain text")
    return chat


def apply_template(tokenizer, source, i, msgs, **kw):
    """Row i's messages rendered to text by the tokenizer's chat template; a template that
    cannot render them (its own raise_exception("Conversation roles must alternate ...")) is
    named with the row."""
    try:
        return tokenizer.apply_chat_template(list(msgs), tokenize=False, **kw)
    except Exception as e:
        raise ValueError(f"{source} row {i + 1}: the chat template cannot render this row "
                         f"({type(e).__name__}: {e})") from None


def render_chat(ds, tokenizer, source):
    """Conversational rows rendered to text with the tokenizer's chat template, as TRL does:
    the prompt with the generation prompt (`add_generation_prompt=True`), each completion
    (chosen, rejected) as the text the template adds after it for the assistant's turn, ending
    with the template's end-of-turn tokens. Returns (ds with text columns, chat): chat says the
    rows were conversational, so no EOS is appended to their completions. Plain-text rows
    come back unchanged."""
    import datasets

    columns = chat_columns(ds, tokenizer, source)
    if not columns:
        return ds, False
    given = ds["prompt"][:]
    prompts = [apply_template(tokenizer, source, i, p, add_generation_prompt=True) for i, p in enumerate(given)]
    out = {"prompt": prompts}
    for c in columns[1:]:
        texts = []
        for i, (p, p_text, msgs) in enumerate(zip(given, prompts, ds[c][:])):
            full = apply_template(tokenizer, source, i, list(p) + list(msgs))
            if not full.startswith(p_text):
                raise ValueError(f"{source} row {i + 1}: the chat template renders the prompt differently once the "
                                 f"{c} follows it, so the {c} cannot be cut off as the text after the prompt")
            texts.append(full[len(p_text):])
        out[c] = texts
    other = {c: ds[c][:] for c in ds.column_names if c not in out}
    return datasets.Dataset.from_dict({**out, **other}), True


def assistant_turns(ds, tokenizer, source):
    """SFT's prompt-completion rows as text: (prompts, pieces, chat). pieces[i] is row i's
    completion as [(text, trained), ...] in order. A plain-text row's completion is one trained
    piece. A conversation's pieces are its assistant turns, each as the template writes it (its
    end-of-turn tokens included, as render_chat's completion), trained on, and the text between
    them (a user's turn, the next generation prompt), context only: TRL's assistant-only loss.
    Turn k is what msgs[:k+1] adds to msgs[:k] rendered with the generation prompt, which holds
    where each render is a prefix of the whole conversation's; a template that renders an
    earlier turn differently once later turns follow (one that strips the reasoning of earlier
    turns) is refused, naming the row and the turn, since its turns have no place in the text
    the model is trained on."""
    if not chat_columns(ds, tokenizer, source):
        return ds["prompt"][:], [[(c, True)] for c in ds["completion"][:]], False
    prompts, pieces = [], []
    for i, (prompt, completion) in enumerate(zip(ds["prompt"][:], ds["completion"][:])):
        msgs = list(prompt) + list(completion)
        full = apply_template(tokenizer, source, i, msgs)
        pos, row = None, []
        for k in range(len(prompt), len(msgs)):
            if msgs[k]["role"] != "assistant":
                continue
            before = apply_template(tokenizer, source, i, msgs[:k], add_generation_prompt=True)
            after = full if k == len(msgs) - 1 else apply_template(tokenizer, source, i, msgs[:k + 1])
            if pos is None:
                prompts.append(before)
                pos = len(before)
            if not (after.startswith(before) and full.startswith(after) and len(before) >= pos):
                raise ValueError(f"{source} row {i + 1}: the chat template renders message {k + 1} (an assistant turn) "
                                 f"differently once later turns follow it (as templates that drop the reasoning of "
                                 f"earlier turns do), so its tokens cannot be found in the conversation: give each "
                                 f"assistant turn a row of its own, or pass a --chat_template that renders every turn "
                                 f"as it renders the last")
            row += [(full[pos:len(before)], False)] * (len(before) > pos) + [(full[len(before):len(after)], True)]
            pos = len(after)
        if pos is None:
            raise ValueError(f"{source} row {i + 1}: the completion holds no assistant message, so nothing in it is "
                             f"trained on")
        row += [(full[pos:], False)] * (len(full) > pos)
        pieces.append(row)
    return prompts, pieces, True


def report_later_turns(turns, max_len, source):
    """SFT's completion of a `messages` row is everything after its first assistant turn begins, later
    user turns included, all counted by --max_response_len, which cuts it from the right. Where rows
    have several assistant turns (turns: each row's [(start, end), ...] of its assistant turns' tokens
    in the completion), prints a line saying so, with the later turns it cuts: in part, and wholly
    (none of their tokens trained on)."""
    later = [t for row in turns for t in row[1:]]
    if not later:
        return
    cut, gone = sum(end > max_len for _, end in later), sum(start >= max_len for start, _ in later)
    common.print0(f"{source}: --max_response_len {max_len} counts every token after a row's first assistant turn "
                  f"begins, later user turns included: it cuts {cut} of the {len(later)} later assistant turns of "
                  f"{sum(len(row) > 1 for row in turns)} multi-turn rows ({gone} of them wholly)")


HH_MARKER = "\n\nAssistant:"


def split_hh(chosen, rejected):
    """Split two Anthropic HH dialogues at their last "\\n\\nAssistant:" into
    (prompt, chosen response, rejected response); the prompt keeps the marker.

    The two dialogues must share that prompt, else ValueError (the caller adds the row number).
    """
    i, j = chosen.rfind(HH_MARKER), rejected.rfind(HH_MARKER)
    if i < 0 or j < 0:
        raise ValueError(f"the {'chosen' if i < 0 else 'rejected'} dialogue has no {HH_MARKER!r}")
    prompt, other = chosen[:i + len(HH_MARKER)], rejected[:j + len(HH_MARKER)]
    if prompt != other:
        at = next((k for k, (a, b) in enumerate(zip(prompt, other)) if a != b), min(len(prompt), len(other)))
        raise ValueError(f"chosen and rejected dialogues have different prompts before their last "
                         f"{HH_MARKER!r} (first difference at character {at})")
    return prompt, chosen[len(prompt):], rejected[len(other):]


def load_pairs(name, split, n=None, seed=0, holdout=False):
    """Preference pairs as a `datasets.Dataset` with string columns prompt, chosen, rejected (and
    any others the source has, such as a numeric `margin`). Rows without a prompt field are
    Anthropic HH dialogues, split by split_hh. Errors name the source and the row (1-based).
    holdout: as in load_data, by the hash of the (split) prompt."""
    whole = holdout and os.path.isfile(name)  # split below, by the hash of the prompt the rows have then
    ds = load_data(name, "train" if whole else split, ["chosen", "rejected"], kind="preference", n=n, seed=seed,
                   optional=("prompt", "margin"))
    if "prompt" in ds.column_names:
        check_field(ds["prompt"][:], "prompt", name)
    else:  # the implicit prompt: HH dialogues split at the last "Assistant:", or shared first turns
        split = shared_turns if is_conversation(ds[0]["chosen"]) else split_hh
        triples = []
        for i, (c, r) in enumerate(zip(ds["chosen"][:], ds["rejected"][:])):
            try:
                triples.append(split(c, r))
            except ValueError as e:
                raise ValueError(f"{name} row {i + 1}: {e}") from None
        import datasets

        prompt, chosen, rejected = map(list, zip(*triples))
        other = {c: ds[c][:] for c in ds.column_names if c not in ("chosen", "rejected")}
        ds = datasets.Dataset.from_dict({"prompt": prompt, "chosen": chosen, "rejected": rejected, **other})
    if "margin" in ds.column_names:  # reward.py's per-pair margin: a number in every row
        bad = next((i for i, m in enumerate(ds["margin"][:]) if isinstance(m, bool) or not isinstance(m, (int, float))), None)
        if bad is not None:
            raise ValueError(f"{name} row {bad + 1}: field 'margin' is {ds[bad]['margin']!r}, not a number")
    if whole:
        ds = hold_out(ds, name, split)
    return ds


def show_example(tokenizer, prompt, response, what, mask=None):
    """Print a training example as the model sees it: the prompt's tokens, then the tokens the
    loss is taken on, each token quoted, so a wrong template, a double BOS or a missing end of
    turn shows in the log before the first step. mask (0/1 per response token): the response's
    tokens the loss leaves out (the user turns between assistant turns) are shown in [brackets]."""
    quote = lambda ids: " ".join(repr(t) for t in tokenizer.convert_ids_to_tokens(ids))  # noqa: E731
    if response is None:
        loss = "the sampled completion"
    elif mask is None or all(mask):
        loss = f"({len(response)} tokens) {quote(response)}"
    else:
        parts, start = [], 0
        for j in range(1, len(response) + 1):  # runs of trained and of context tokens
            if j == len(response) or mask[j] != mask[start]:
                text = quote(response[start:j])
                parts.append(text if mask[start] else f"[{text}]")
                start = j
        loss = f"({sum(mask)} of {len(response)} tokens; [context]) {' '.join(parts)}"
    common.print0(f"{what}, first example: prompt ({len(prompt)} tokens) {quote(prompt)}\n  loss on {loss}")


def encode_pairs(ds, tokenizer, max_prompt_len, max_response_len, what, eos=True):
    """Token ids (prompts, chosen, rejected) of a pairs Dataset of text (render_chat): prompts
    cut from the left, responses (+ EOS for plain text) from the right; the cuts are counted and
    printed, never silent."""
    prompts, cut = sampling.encode_prompts(tokenizer, ds["prompt"][:], max_prompt_len, what)
    chosen, c_cut = sampling.encode_responses(tokenizer, ds["chosen"][:], max_response_len, eos)
    rejected, r_cut = sampling.encode_responses(tokenizer, ds["rejected"][:], max_response_len, eos)
    p_cut = sum(cut)
    if p_cut or c_cut or r_cut:
        common.print0(f"{what}: truncated {p_cut} prompts (left), {c_cut} chosen and {r_cut} rejected responses "
               f"(right) of {len(prompts)} pairs to {max_prompt_len}/{max_response_len} tokens")
    return prompts, chosen, rejected


def load_preferences(cfg):
    """reward.py's and dpo.py's train and held-out pairs: --eval_dataset, or --eval_split of
    --dataset, or (a local file without a held-out one) its prompt-hash split; n_eval rows."""
    split = cfg.eval_dataset is None
    train = load_pairs(cfg.dataset, "train", cfg.n_train, cfg.seed, holdout=split)
    test = load_pairs(cfg.eval_dataset or cfg.dataset, cfg.eval_split, cfg.n_eval, cfg.seed, holdout=split)
    return train, test.select(range(min(cfg.n_eval, len(test))))


def encode_preferences(train, test, tokenizer, cfg):
    """reward.py's and dpo.py's pairs: each set rendered (render_chat: conversations as their
    template writes them) and encoded (encode_pairs, + EOS for plain text), the first training
    example shown. Returns (train, test, train_pairs, test_pairs), the sets as text."""
    train, chat = render_chat(train, tokenizer, cfg.dataset)
    test, test_chat = render_chat(test, tokenizer, cfg.eval_dataset or cfg.dataset)
    train_pairs = encode_pairs(train, tokenizer, cfg.max_prompt_len, cfg.max_response_len, f"{cfg.dataset} (train)",
                               eos=not chat)
    test_pairs = encode_pairs(test, tokenizer, cfg.max_prompt_len, cfg.max_response_len,
                              f"{cfg.eval_dataset or cfg.dataset} (held out)", eos=not test_chat)
    show_example(tokenizer, train_pairs[0][0], train_pairs[1][0], f"{cfg.dataset} (chosen)")
    return train, test, train_pairs, test_pairs


def pair_batch(pairs, rows, pad_id, device):
    """The chosen then the rejected response of each row after the same prompt, in ONE batch (FSDP
    gathers each layer once for both): input_ids and attention_mask (2B, P+R), response_mask
    (2B, R); rows i and B + i are pair i."""
    prompts, chosen, rejected = pairs
    p = [prompts[i] for i in rows]
    batch = common.join_prompt_response(p + p, [chosen[i] for i in rows] + [rejected[i] for i in rows], pad_id)
    return [x.to(device) for x in batch]


def pair_logits(pairs, model):
    """The logits one pair's forward makes at most: chosen and rejected, the longest response each."""
    return 2 * max(map(len, pairs[1] + pairs[2])) * model.config.vocab_size

