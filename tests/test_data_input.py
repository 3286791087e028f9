"""Data files, tokenizers and chat templates as users bring them: each refused with a message that
names the file, the row and the field, or read exactly as written. In-process and fast: no
model is built."""
import json
import os

import datasets
import pytest

import data
import environment
from helpers import chat, family_tokenizer, write_jsonl
from plumbing import models


def test_jsonl_lines_may_hold_unicode_line_separators(tmp_path):
    """U+2028, U+2029 and U+0085 are valid inside a JSON string and do not end a JSON Lines line;
    a CRLF file reads the same, and an error still names its line."""
    odd = "a\u2028b\u2029c\x85d"
    rows = [{"prompt": odd, "completion": " 1"}, {"prompt": "p", "completion": odd}]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    assert all(len(line.splitlines()) > 1 for line in lines)  # what str.splitlines() made of them
    ds = data.load_data(write_jsonl(tmp_path / "d.jsonl", lines), "train", ["prompt", "completion"])
    assert ds.to_list() == rows
    (tmp_path / "crlf.jsonl").write_bytes("\r\n".join(lines + ["{bad"]).encode())
    with pytest.raises(ValueError, match=r"crlf\.jsonl line 3: not valid JSON"):
        data.load_data(str(tmp_path / "crlf.jsonl"), "train", ["prompt", "completion"])
    (tmp_path / "crlf.jsonl").write_bytes("\r\n".join(lines).encode() + b"\r\n")
    assert data.load_data(str(tmp_path / "crlf.jsonl"), "train", ["prompt", "completion"]).to_list() == rows


def test_csv_cells_are_read_as_written_and_margin_as_a_number(tmp_path):
    """Digits stay text (" 19", "046" keep their space and zero); `margin` is a float, and an empty
    margin cell a missing value, named by the row checks like a bad margin."""
    path = tmp_path / "d.csv"
    path.write_text('prompt,chosen,rejected,margin\n12 + 7 =,19, 19,1.5\n40 + 6 =,046,46,2\n"a, b", 7 ,x,-0.25\n')
    ds = data.load_pairs(str(path), "train")
    assert ds["chosen"] == ["19", "046", " 7 "] and ds["rejected"] == [" 19", "46", "x"]
    assert ds["prompt"] == ["12 + 7 =", "40 + 6 =", "a, b"] and ds["margin"] == [1.5, 2.0, -0.25]
    path.write_text("prompt,chosen,rejected,margin\nq,1,2,0.5\nq,1,2,big\n")
    with pytest.raises(ValueError, match=r"d\.csv row 2: field 'margin' is 'big', not a number"):
        data.load_pairs(str(path), "train")
    path.write_text("prompt,chosen,rejected,margin\nq,1,2,0.5\nq,1,2,\n")
    with pytest.raises(ValueError, match=r"d\.csv row 2: field 'margin' is None, not a number"):
        data.load_pairs(str(path), "train")


def test_an_empty_csv_cell_is_empty_text_as_in_jsonl(tmp_path, capsys):
    """An empty cell of a text column was a missing field, while the same row in JSON Lines (`""`)
    was read as empty text: one file refused, the other trained. A CSV cell is text, and the
    format has no other way to write an empty completion, so it is "" in both, with a note that
    counts such rows (an empty completion trains the model to stop at once, as TRL does with "")."""
    rows = [{"prompt": "q", "completion": "1"}, {"prompt": "r", "completion": ""}, {"prompt": "s", "completion": ""}]
    (tmp_path / "d.csv").write_text('prompt,completion\nq,1\nr,\ns,""\n')
    from_csv = data.load_data(str(tmp_path / "d.csv"), "train", ["prompt", "completion"])
    from_jsonl = data.load_data(write_jsonl(tmp_path / "d.jsonl", rows), "train", ["prompt", "completion"])
    assert from_csv.to_list() == from_jsonl.to_list() == rows
    notes = capsys.readouterr().out.splitlines()
    assert notes == [f"note: {tmp_path / f'd.{x}'}: 2 of 3 rows have an empty 'completion' (rows 2, 3), read as empty "
                     f"text" for x in ("csv", "jsonl")]


def test_columns_of_mixed_nested_types(tmp_path, capsys):
    """A column no script reads whose rows cannot share one Arrow type is left out with one note;
    in a column the scripts read it is an error naming the file, the row and the field."""
    rows = [{"prompt": "p1", "completion": "c1", "meta": {"a": 1}, "tags": {"a": 1}, "id": 1},
            {"prompt": "p2", "completion": "c2", "meta": {"a": "x"}, "tags": [1], "id": "b"},
            {"prompt": "p3", "completion": "c3", "meta": {"a": 2}, "tags": {"a": 2}, "id": 3}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = data.load_data(path, "train", ["prompt", "completion"])
    assert ds.column_names == ["prompt", "completion"] and ds["completion"] == ["c1", "c2", "c3"]
    notes = capsys.readouterr().out.splitlines()
    assert len(notes) == 3 and all(n.startswith(f"{path}: left out column") for n in notes)
    assert [n.split("'")[1] for n in notes] == ["meta", "tags", "id"]
    bad = [{"prompt": chat(("user", "a")), "completion": "c"}, {"prompt": chat(("user", "b")), "completion": "c"},
           {"prompt": [{"role": "user", "content": 3}], "completion": "c"}]
    with pytest.raises(ValueError, match=r"p\.jsonl row 3: field 'prompt'"):
        data.load_data(write_jsonl(tmp_path / "p.jsonl", bad), "train", ["prompt", "completion"])


def test_an_unused_column_of_mixed_types_is_left_out(tmp_path, capsys):
    """An `answer` of 7 in one row and "3/4" in another stopped sft.py, which never reads it (it is
    one of the columns some script reads); a parquet column of a type `datasets` cannot hold (a map)
    crashed naming no file, and one of uint64 ids above 2**63 overflowed. A column the script does not
    read is left out with a note (uint64 ids are kept, as Arrow holds them); one it reads (grpo.py's
    `math` rule reads `answer`) is still an error naming the file, the row and the field."""
    import pyarrow
    import pyarrow.parquet

    import grpo

    rows = [{"prompt": "p1", "completion": "c1", "answer": 7}, {"prompt": "p2", "completion": "c2", "answer": [3, 4]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert data.load_data(path, "train", ["prompt", "completion"]).column_names == ["prompt", "completion"]
    assert capsys.readouterr().out == (f"{path}: left out column 'answer', which this script does not read: row 2: "
                                       f"field 'answer' is list, while earlier rows hold int\n")
    with pytest.raises(ValueError, match=rf"^{path} row 2: field 'answer' is list, while earlier rows hold int$"):
        environment.load_prompts(grpo.Config(dataset=path, reward_fn="math"), rules=True)
    assert environment.load_prompts(grpo.Config(dataset=path), rules=False)[0].column_names == ["prompt", "completion"]
    table = pyarrow.table({"prompt": ["p1", "p2"], "completion": ["c1", "c2"], "id": pyarrow.array([2**63 + 5, 1], pyarrow.uint64()),
                           "meta": pyarrow.array([[("k", 1)], [("j", 2)]], pyarrow.map_(pyarrow.string(), pyarrow.int64()))})
    pyarrow.parquet.write_table(table, tmp_path / "d.parquet")
    capsys.readouterr()
    ds = data.load_data(str(tmp_path / "d.parquet"), "train", ["prompt", "completion"])
    assert ds.column_names == ["prompt", "completion", "id"] and ds["id"] == [2**63 + 5, 1]
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'd.parquet'}: left out column 'meta', which this script "
                                              f"does not read: map<string, int64")
    pyarrow.parquet.write_table(table.rename_columns(["prompt", "completion", "id", "answer"]), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a\.parquet: column 'answer' is map<string, int64 \('answer'\)>, which "
                                         r"`datasets` cannot hold"):
        environment.load_prompts(grpo.Config(dataset=str(tmp_path / "a.parquet"), reward_fn="math"), rules=True)


def test_a_fifo_is_not_a_data_file(tmp_path):
    """Checked before anything opens it: reading a FIFO would block, and a file read once cannot
    give both the train and the held-out rows."""
    for name in ("rows.jsonl", "rows"):
        os.mkfifo(tmp_path / name)
        with pytest.raises(ValueError, match=rf"{name} is not a regular file \(a FIFO/device/socket\); pass a data"):
            data.load_data(str(tmp_path / name), "train", ["prompt"])


def test_a_tokenizer_without_eos_is_refused():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as token_models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(token_models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    no_eos = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    assert no_eos.eos_token_id is None and no_eos("a a")["input_ids"] == [1, 1]
    with pytest.raises(ValueError, match=r"^my-model: its tokenizer has no EOS token.*: responses could not end"):
        models.check_tokenizer(no_eos, "my-model")
    models.check_tokenizer(family_tokenizer("bpe"), "gpt2-like")


def test_read_chat_template(tmp_path):
    """The file's text, exactly; a missing or empty file and a template that does not compile as
    transformers compiles it (sandboxed, with {% break %} and {% generation %}) are refused."""
    good = ("{% for m in messages %}{% if loop.index > 8 %}{% break %}{% endif %}"
            "{% generation %}{{ m['content'] }}{% endgeneration %}\n{% endfor %}")
    (tmp_path / "t.jinja").write_text(good)
    assert models.read_chat_template(str(tmp_path / "t.jinja")) == good
    with pytest.raises(FileNotFoundError, match=r"--chat_template \S*nope\.jinja: no such file"):
        models.read_chat_template(str(tmp_path / "nope.jinja"))
    with pytest.raises(ValueError, match=r"--chat_template \S* is not a regular file"):
        models.read_chat_template(str(tmp_path))
    for text in ("", " \n\t\n"):
        (tmp_path / "t.jinja").write_text(text)
        with pytest.raises(ValueError, match=r"--chat_template \S*t\.jinja is empty"):
            models.read_chat_template(str(tmp_path / "t.jinja"))
    (tmp_path / "t.jinja").write_text("{% for m in messages %}\n{{ m['content'] }}\n{% if x %}\n{% endfor %}")
    with pytest.raises(ValueError, match=r"--chat_template \S*t\.jinja line 4: not a valid Jinja template \(.*endfor"):
        models.read_chat_template(str(tmp_path / "t.jinja"))


ALTERNATE = ("{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
             "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("prompt, completion", [
    (chat(("user", "a"), ("user", "b")), chat(("assistant", "c"))),  # the prompt fails
    (chat(("user", "a"), ("assistant", "b")), chat(("assistant", "c"))),  # the prompt and its completion fail
])
def test_a_template_error_names_the_row(prompt, completion):
    tok = family_tokenizer("bpe", chat=True)
    tok.chat_template = ALTERNATE
    ds = datasets.Dataset.from_list([{"prompt": chat(("user", "q")), "completion": chat(("assistant", "c"))},
                                     {"prompt": prompt, "completion": completion}])
    with pytest.raises(ValueError, match=r"rows\.jsonl row 2: the chat template cannot render this row "
                                         r"\(.*Conversation roles must alternate"):
        data.render_chat(ds, tok, "rows.jsonl")


def test_a_pair_without_a_numeric_margin_is_named(tmp_path):
    """reward.py reads `margin` as a number for every pair: a row without one is named at load."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c", "margin": 1.5},
                                             {"prompt": "d", "chosen": "e", "rejected": "f"}])
    with pytest.raises(ValueError, match=r"p.jsonl row 2: field 'margin' is None, not a number"):
        data.load_pairs(path, "train")
