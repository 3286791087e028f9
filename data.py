"""The data users bring, checked row by row: an embedded task, local .jsonl / .json / .parquet
files or hub ids, read with `datasets`; prompt-completion rows, preference pairs (with the
Anthropic HH format split into prompt and responses) and prompts; tokenised with the
truncation rules every script shares, and batched in the layout of common.py.
"""
import json
import os

import common

def _check_jsonl(path):
    """Find the first line of a .jsonl file that is not a JSON object, to name it in the error."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")


def load_data(name, split, columns, kind=None, n=None, seed=0):
    """A `datasets.Dataset` with string `columns`, from an embedded task (`sort`), a local
    .jsonl / .json / .parquet file, or a hub id. Every row is checked: a missing or non-string
    field is an error naming the file, the row (1-based) and the field. Nothing is dropped.

    kind ("sft", "preference", "prompt") and n pick the rows of an embedded task.
    """
    import datasets

    import tasks

    if name in tasks.TASKS:
        split = "test" if split in ("test", "validation", "eval") else split
        ds = datasets.Dataset.from_list(tasks.task_rows(name, kind, n, seed=seed, split=split))
    elif os.path.splitext(name)[1] in (".jsonl", ".json", ".parquet"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"data file {name} does not exist")
        builder = "parquet" if name.endswith(".parquet") else "json"
        if name.endswith(".jsonl"):
            _check_jsonl(name)
        try:
            ds = datasets.load_dataset(builder, data_files=name, split="train")
        except Exception as e:  # pyarrow's messages name neither the file nor the row
            raise ValueError(f"{name}: could not be read as {builder}: {e}") from None
    else:
        ds = datasets.load_dataset(name, split=split)
    if len(ds) == 0:
        raise ValueError(f"{name} ({split}): no rows")
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"{name} ({split}): missing column(s) {missing}; has {ds.column_names}")
    for c in columns:
        for i, v in enumerate(ds[c]):
            if not isinstance(v, str):
                what = "missing field" if v is None else f"field is {type(v).__name__}, not a string:"
                raise ValueError(f"{name} row {i + 1}: {what} {c!r}")
    return ds


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


def load_pairs(name, split, n=None, seed=0):
    """Preference pairs as a `datasets.Dataset` with string columns prompt, chosen, rejected (and
    any others the source has, such as a numeric `margin`). Rows without a prompt field are
    Anthropic HH dialogues, split by split_hh. Errors name the source and the row (1-based)."""
    ds = load_data(name, split, ["chosen", "rejected"], kind="preference", n=n, seed=seed)
    if "prompt" in ds.column_names:
        bad = next((i for i, p in enumerate(ds["prompt"]) if not isinstance(p, str)), None)
        if bad is not None:
            raise ValueError(f"{name} row {bad + 1}: field 'prompt' is not a string")
        return ds
    triples = []
    for i, (c, r) in enumerate(zip(ds["chosen"], ds["rejected"])):
        try:
            triples.append(split_hh(c, r))
        except ValueError as e:
            raise ValueError(f"{name} row {i + 1}: {e}") from None
    import datasets

    prompt, chosen, rejected = map(list, zip(*triples))
    other = {c: ds[c] for c in ds.column_names if c not in ("chosen", "rejected")}
    return datasets.Dataset.from_dict({"prompt": prompt, "chosen": chosen, "rejected": rejected, **other})


def encode_prompts(tokenizer, texts, max_len):
    """Token ids of each prompt; an over-long prompt keeps its last max_len tokens (the end
    of a prompt is what the response follows). Returns (ids, number truncated)."""
    ids = tokenizer(list(texts))["input_ids"]
    n_cut = sum(len(x) > max_len for x in ids)
    return [x[-max_len:] for x in ids], n_cut


def encode_responses(tokenizer, texts, max_len):
    """Token ids of each response followed by EOS; an over-long one keeps its first max_len
    tokens (and so loses its EOS). Returns (ids, number truncated)."""
    ids = [x + [tokenizer.eos_token_id] for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    n_cut = sum(len(x) > max_len for x in ids)
    return [x[:max_len] for x in ids], n_cut


def encode_pairs(ds, tokenizer, max_prompt_len, max_response_len, what):
    """Token ids (prompts, chosen, rejected) of a pairs Dataset: prompts cut from the left,
    responses + EOS from the right; the cuts are counted and printed, never silent."""
    prompts, p_cut = encode_prompts(tokenizer, ds["prompt"], max_prompt_len)
    chosen, c_cut = encode_responses(tokenizer, ds["chosen"], max_response_len)
    rejected, r_cut = encode_responses(tokenizer, ds["rejected"], max_response_len)
    if p_cut or c_cut or r_cut:
        common.print0(f"{what}: truncated {p_cut} prompts (left), {c_cut} chosen and {r_cut} rejected responses "
               f"(right) of {len(prompts)} pairs to {max_prompt_len}/{max_response_len} tokens")
    return prompts, chosen, rejected


def pair_batch(pairs, rows, pad_id, device):
    """The chosen then the rejected response of each row after the same prompt, in ONE batch (FSDP
    gathers each layer once for both): input_ids and attention_mask (2B, P+R), response_mask
    (2B, R); rows i and B + i are pair i."""
    prompts, chosen, rejected = pairs
    p = [prompts[i] for i in rows]
    batch = common.join_prompt_response(p + p, [chosen[i] for i in rows] + [rejected[i] for i in rows], pad_id)
    return [x.to(device) for x in batch]
