"""TRL's flag names on this project's scripts: the ones that mean the same here (aliases of a flag
of ours), the ones that mean nothing here (accepted with a note), the ones that mean something
else (refused, saying what to pass instead), TRL's flags of another script (named as such), and a
"did you mean" for any other unknown flag. One table serves the parser (cli.parse_config), each
flag's --help line and the table in docs/usage.md ("Coming from TRL"; `python -m plumbing.trl_flags`
prints it)."""
import difflib
import sys

SCRIPTS = ("sft", "reward", "dpo", "grpo")
ALL, OFFLINE = SCRIPTS, ("sft", "reward", "dpo")  # OFFLINE: the scripts that train on a fixed data set
STEPS = ("a run here is counted in optimizer steps: pass --steps = epochs x training rows / --batch_size (3 epochs of "
         "10,000 rows at --batch_size 64: --steps 469)")
ONLY_THIS = ("always on here: every assistant turn of a `messages` row is trained on and the other turns are context; "
             "a prompt/completion row trains on its completion, a `text` row on all of its tokens")

PRECISION = ("precision is chosen here: bf16 autocast (FSDP's mixed precision under torchrun) on a GPU that has bf16, "
             "fp32 weights and optimizer; --save_dtype sets the exported weights' dtype")
LOGGED = "every step is logged here: one line and one metrics.jsonl row per step"

# (TRL's name, the scripts it holds for, the flag here, note). No note: an alias, the same meaning
# under another name. A note: TRL's flag means something else here (or nothing), and a command
# that uses it is refused with the note, which says what to pass instead; or, for a flag that has
# no counterpart here (None) given a value in ACCEPTED, run with the note printed.
TRL_FLAGS = [
    ("learning_rate", ALL, "lr", ""),
    ("output_dir", ALL, "out_dir", ""),
    ("model_name_or_path", ALL, "model", ""),
    ("dataset_name", ALL, "dataset", ""),
    ("dataset_test_split", OFFLINE, "eval_split", ""),
    ("gradient_accumulation_steps", ALL, "grad_accum", ""),
    ("gradient_checkpointing", ALL, "activation_checkpointing", ""),
    ("max_grad_norm", ALL, "grad_clip", ""),
    ("eval_steps", ALL, "eval_every", ""),
    ("save_steps", ALL, "save_every", ""),
    ("max_prompt_length", ALL, "max_prompt_len", ""),
    ("max_completion_length", OFFLINE, "max_response_len", ""),
    ("max_completion_length", ("grpo",), "max_new_tokens", ""),
    ("per_device_eval_batch_size", OFFLINE, "eval_batch_size", ""),
    ("max_steps", OFFLINE, "steps", ""),
    ("num_generations", ("grpo",), "group_size", ""),
    ("num_completions_to_print", ("grpo",), "log_completions", ""),
    ("use_peft", ALL, "lora", ""),
    ("center_rewards_coefficient", ("reward",), "center_coef", ""),
    ("precompute_ref_log_probs", ("dpo",), "precompute_ref", ""),
    ("per_device_train_batch_size", OFFLINE, "batch_size",
     "--batch_size here is the global batch, over all GPUs and micro-batches: pass --batch_size = per-device x GPUs x "
     "--grad_accum (8 per device on 4 GPUs with --grad_accum 2: --batch_size 64)"),
    ("per_device_train_batch_size", ("grpo",), "prompts_per_step",
     "a rollout here is --prompts_per_step prompts x --group_size completions over all GPUs, split into "
     "--num_mini_batches optimizer steps: pass --prompts_per_step = per-device x GPUs x --grad_accum x "
     "--num_mini_batches / --group_size"),
    ("max_steps", ("grpo",), "steps",
     "--steps here counts rollouts, each followed by --num_iterations x --num_mini_batches optimizer steps (TRL's "
     "max_steps counts optimizer steps): pass --steps = max_steps / (num_iterations x num_mini_batches)"),
    ("num_train_epochs", OFFLINE, "steps", STEPS),
    ("num_train_epochs", ("grpo",), "steps",
     "a run here is counted in rollouts: pass --steps = epochs x prompts / --prompts_per_step"),
    ("warmup_ratio", ALL, "warmup_steps",
     "warmup here is a number of steps: pass --warmup_steps = ceil(ratio x --steps) (0.1 of 700 steps: "
     "--warmup_steps 70)"),
    ("max_length", OFFLINE, "max_prompt_len",
     "the prompt and the completion each have a limit here: --max_prompt_len (cut from the left) and "
     "--max_response_len (cut from the right); TRL's 1024 is 512 + 512"),
    ("epsilon", ("grpo",), "epsilon_low",
     "TRL's --epsilon sets both clip bounds unless --epsilon_high is given; here each is a flag of its own (0.2 and "
     "0.2 for a model of your own, as TRL's; 0.2 and DAPO's 0.28 on the embedded task): pass --epsilon_low X "
     "--epsilon_high X"),
    ("dataset_test_split", ("grpo",), "eval_split",
     "held-out prompts here are --eval_dataset's (a hub one's split: --eval_split) or a local file's hash split: pass "
     "--eval_dataset DATASET --eval_split SPLIT"),
    ("logging_steps", ALL, None, LOGGED),
    ("logging_strategy", ALL, None, LOGGED),
    ("logging_first_step", ALL, None, LOGGED),
    ("lr_scheduler_type", ALL, None,
     "the schedule here is fixed: a linear warmup over --warmup_steps, then a cosine decay to 0"),
    ("bf16", ALL, None, PRECISION),
    ("fp16", ALL, None, PRECISION),
    ("save_strategy", ALL, None,
     "a resumable checkpoint is written every --save_minutes of training and every --save_every steps"),
    ("save_total_limit", ALL, None, "one checkpoint is kept: each replaces the one before"),
    ("eval_strategy", ALL, None, "evaluation runs every --eval_every steps and at the end"),
    ("dataset_train_split", ALL, None,
     "the training rows are a hub --dataset's `train` split, or a local file's rows but its held-out share"),
    ("dataset_text_field", ("sft",), None, "a `text` row's column is `text` (TRL's default): name yours so"),
    ("dataloader_num_workers", ALL, None, "the rows are read and tokenised once, in memory, before the first step"),
    ("push_to_hub", ALL, None, "nothing is uploaded here: upload out_dir/checkpoint yourself (huggingface-cli upload)"),
    ("use_vllm", ("grpo",), None, "the sampler is built in (sampling.py: KV cache, CUDA graphs); there is no vLLM here"),
    ("generation_batch_size", ("grpo",), "prompts_per_step",
     "TRL's generation_batch_size is a rollout's completions over all GPUs (per-device x GPUs x steps_per_generation): "
     "here --prompts_per_step x --group_size, one rollout a step; the completions each GPU samples at once (its KV "
     "cache's rows) are --generation_micro_batch_size"),
    ("assistant_only_loss", ("sft",), None, ONLY_THIS),
    ("completion_only_loss", ("sft",), None, ONLY_THIS),
    ("packing", ("sft",), None, "no bin-packing of rows into fixed-length blocks here; --padding_free trains with "
     "no padding computed, each row attending to itself alone"),
    ("lora_task_type", ALL, None, "set by the script here: a causal LM's adapters, and for reward.py peft's SEQ_CLS "
     "task (its score head trained whole)"),
    ("lora_modules_to_save", ALL, "lora", "no modules trained whole beside the adapters here, but reward.py's score "
     "head"),
    ("use_rslora", ALL, None, "LoRA's scale is --lora_alpha / --lora_r here: for rsLoRA's alpha / sqrt(r), pass "
     "--lora_alpha = alpha x sqrt(r) (alpha 16 at r 64: --lora_alpha 128)"),
    ("use_dora", ALL, None, "no DoRA here: LoRA's adapters alone (--lora)"),
]

# TRL's flags whose name and meaning are this project's too (listed in the docs' table)
SAME_NAME = [("seed", ALL), ("weight_decay", ALL), ("warmup_steps", ALL), ("trust_remote_code", ALL),
             ("beta", ("dpo", "grpo")), ("loss_type", ("dpo",)), ("label_smoothing", ("dpo",)),
             ("temperature", ("grpo",)), ("top_p", ("grpo",)), ("top_k", ("grpo",)), ("min_p", ("grpo",)),
             ("num_iterations", ("grpo",)),
             ("epsilon_high", ("grpo",)), ("scale_rewards", ("grpo",)), ("reward_weights", ("grpo",)),
             ("mask_truncated_completions", ("grpo",)), ("lora_r", ALL), ("lora_alpha", ALL), ("lora_dropout", ALL),
             ("lora_target_modules", ALL),
             ("padding_free", ("sft", "dpo")), ("report_to", ALL)]

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")  # how TRL's parser (HfArgumentParser) reads a bool's value

# The TRL flags without a counterpart here (None above) that a run accepts, printing their note, given one of
# these values (None: any value); another value (`--lr_scheduler_type linear`, `--packing`) is refused.
ACCEPTED = {"logging_steps": None, "logging_strategy": ("steps",), "logging_first_step": None,
            "lr_scheduler_type": ("cosine",), "bf16": None, "fp16": None, "save_strategy": ("steps",),
            "save_total_limit": None, "eval_strategy": ("steps",), "dataset_train_split": ("train",),
            "dataset_text_field": ("text",), "dataloader_num_workers": None, "push_to_hub": FALSE, "use_vllm": None,
            "assistant_only_loss": TRUE, "completion_only_loss": TRUE, "packing": FALSE,
            "lora_task_type": ("causal_lm", "seq_cls"), "use_rslora": FALSE, "use_dora": FALSE}
TRL_BOOLS = {"logging_first_step", "bf16", "fp16", "push_to_hub", "use_vllm", "assistant_only_loss",
             "completion_only_loss", "packing", "use_rslora", "use_dora"}  # TRL's bools among them: bare, `--bf16` is true

# Flags of ours named as TRL's whose TRL type is a bool: TRL's true and false, as its parser reads them, are
# these values (--log_completions 4 logs 4 completions a step here; TRL's --log_completions true logs them)
BOOL_VALUES = {("grpo", "log_completions"): ("8", "0"), ("grpo", "scale_rewards"): ("group", "none")}

LISTS = {"lora_target_modules", "report_to"}  # TRL's list flags (nargs="+": `--report_to wandb trackio`): comma-joined

# TRL's GRPO loss_type names the policy term and how it is averaged at once; here they are two flags, --loss_type (the
# term: grpo is PPO's clipped surrogate, as TRL's grpo, dapo, dr_grpo and bnpo are) and --loss_agg (the average).
# TRL's names of an average given to --loss_type: {script: {flag: {TRL's value: (the flags here, or None: refused,
# with what differs)}}}. TRL's grpo and sapo are values here too (the policy term): given, they bring TRL's average,
# --loss_agg seq_mean_token_mean, unless --loss_agg is given (tests/test_variants.py computes each of TRL's losses
# both ways).
TRL_VALUES = {"grpo": {"loss_type": {
    "grpo": ("--loss_type grpo --loss_agg seq_mean_token_mean", ", unless --loss_agg is given (the average given)"),
    "sapo": ("--loss_type sapo --loss_agg seq_mean_token_mean", ", unless --loss_agg is given (the average given)"),
    "dapo": ("--loss_agg token_mean", ""),
    "dr_grpo": ("--loss_agg constant", ""),
    "bnpo": (None, "it divides each micro-batch's sum by that micro-batch's own tokens, so its gradient depends on how a "
                   "step is split over GPUs and accumulation (trl #3021); every average here is over the global "
                   "mini-batch: --loss_agg token_mean (TRL's dapo) is bnpo exactly where a step is one micro-batch on "
                   "one process"),
    "luspo": (None, "LUSPO (arXiv:2602.05261) weighs each sequence's GSPO term by its length and averages over "
                    "sequences: here --importance_sampling_level sequence --loss_agg constant, whose loss is LUSPO's "
                    "divided by --max_new_tokens (AdamW's steps are nearly scale-free; --grad_clip sees the smaller "
                    "norm)"),
    "vespo": (None, "there is no VESPO (arXiv:2602.10693) here"),
}}}


def trl_value(script, name, value, argv):
    """The flags here that a TRL value of a flag of ours stands for (TRL_VALUES): `--loss_type dapo`
    -> ["--loss_agg", "token_mean"]. ValueError for a TRL value with no equal here (saying what
    differs and what is nearest), and for one whose flag argv also gives."""
    flags, note = TRL_VALUES[script][name][value]
    if flags is None:
        raise ValueError(f"{script}.py: --{name} {value} is TRL's, with no equal here: {note}")
    words = flags.split()
    kept = words[0] == f"--{name}"  # a value of ours too: the flags it brings, where not given
    ours = words[2 if kept else 0]
    if any(a == ours or a.startswith(ours + "=") for a in argv):
        if kept:
            return words[:2]
        raise ValueError(f"{script}.py: --{name} {value} is TRL's name for {flags} here, and {ours} is given too: "
                         f"pass one of them")
    return words


def rows(script):
    """{TRL's name: (the flag here, note)} of the rows that hold for `script` (a script's file
    name without .py; none for another, such as pipeline)."""
    return {trl: (ours, note) for trl, scripts, ours, note in TRL_FLAGS if script in scripts}


def help_note(script, flag):
    """What a flag's --help line says of TRL: "(TRL: --learning_rate)" for an alias of it, the note
    of each TRL flag that means something else here and names it, and the values TRL's true and
    false of a flag of TRL's name give here (BOOL_VALUES)."""
    table = rows(script)
    same = [f"--{trl}" for trl, (ours, note) in table.items() if ours == flag and not note]
    other = [f" (not TRL's --{trl}: {note})" for trl, (ours, note) in table.items() if ours == flag and note]
    yes_no = BOOL_VALUES.get((script, flag))
    bools = f" (TRL's bool: --{flag} true is {yes_no[0]} here, false {yes_no[1]})" if yes_no else ""
    return (f" (TRL: {', '.join(same)})" if same else "") + "".join(other) + bools


def elsewhere(script, name):
    """Where `name` is TRL's flag of other scripts only: "--num_generations is TRL's flag of
    grpo.py (--group_size there), not of sft.py"; None where it is none of TRL's names."""
    where = {s: ours for trl, scripts, ours, _ in TRL_FLAGS if trl == name for s in scripts}
    where |= {s: name for trl, scripts in SAME_NAME if trl == name for s in scripts}
    if not where or script in where:
        return None
    there = ", ".join(f"{s}.py" + (f" (--{ours} there)" if ours and ours != name else "") for s, ours in where.items())
    return f"--{name} is TRL's flag of {there}, not of {script}.py, which has no flag like it"


def translate(script, argv, flags, bools):
    """argv with TRL's names of `script` replaced by this project's: `--learning_rate 1e-5` ->
    `--lr 1e-5`, `--use_peft true` -> `--lora`, `--log_completions true` -> `--log_completions 8`
    (BOOL_VALUES), a list flag's values comma-joined (`--lora_target_modules q_proj v_proj`,
    `--report_to wandb tensorboard`), a TRL value of ours (`grpo.py --loss_type dapo` ->
    `--loss_agg token_mean`, TRL_VALUES). flags: every flag name the script has (bools too, and their
    `no-` forms); bools: those that take no value. Returns (argv, notes): the note of each TRL flag
    given that means nothing here and was accepted (ACCEPTED), one line each. ValueError, naming the
    script, with every flag refused, in one message: a TRL flag that means something else here (its
    note), a TRL flag of another script (elsewhere), a TRL value with no equal here, a bad true/false,
    and a flag that is none of these (with a "did you mean")."""
    table, out, last, notes, refused, i = rows(script), [], [], [], [], 0
    given = {a[2:].partition("=")[0] for a in argv if a.startswith("--")}
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            out, last = out + last, argv[i - 1:]
            break
        name, eq, value = arg[2:].partition("=")
        if arg.startswith("--") and (script, name) in BOOL_VALUES:  # TRL's `--log_completions true`
            word = value if eq else argv[i] if i < len(argv) else ""
            if word.lower() in ("true", "false", "yes", "no"):  # words only: --log_completions 1 is a number here
                i += 0 if eq else 1
                yes, no = BOOL_VALUES[(script, name)]
                if word.lower() in FALSE:
                    last.append(f"--{name}={no}")  # last: TRL's false logs nothing, whatever the number
                elif "num_completions_to_print" not in given:  # that one sets the number
                    out.append(f"--{name}={yes}")
                continue
        if arg.startswith("--") and name in bools and not name.startswith("no-") and (
                eq or (i < len(argv) and argv[i].lower() in TRUE + FALSE)):  # TRL's `--flag false` of a bool here
            value, i = (value, i) if eq else (argv[i], i + 1)
            if value.lower() not in TRUE + FALSE:
                refused.append(f"--{name}={value}: give true or false, or --{name} / --no-{name}")
                continue
            out.append(f"--{name}" if value.lower() in TRUE else f"--no-{name}")
            continue
        if arg.startswith("--") and name in LISTS:  # TRL's list: every value up to the next flag
            values = [value] if eq else []
            while not eq and i < len(argv) and not argv[i].startswith("--"):
                values, i = values + [argv[i]], i + 1
            out.append(f"--{name}={','.join(values)}")
            continue
        word = value if eq else argv[i] if i < len(argv) else None
        if arg.startswith("--") and word in TRL_VALUES.get(script, {}).get(name, {}):  # `--loss_type dapo`
            i += not eq
            try:
                out += trl_value(script, name, word, argv)
            except ValueError as e:
                refused.append(str(e).removeprefix(f"{script}.py: "))
            continue
        if not arg.startswith("--") or arg == "--help" or name in flags:
            out.append(arg)
            continue
        if name not in table:
            refused.append(elsewhere(script, name) or f"unknown flag --{name}{did_you_mean(name, flags, table)}")
            if not eq and i < len(argv) and not argv[i].startswith("--"):
                i += 1  # its value: not a flag of its own
            continue
        ours, note = table[name]
        if ours is None:  # TRL's flag has no counterpart here: accepted, with its note, where its value is ACCEPTED's
            if not eq and i < len(argv) and (not argv[i].startswith("--") if name not in TRL_BOOLS
                                              else argv[i].lower() in TRUE + FALSE):
                value, i = argv[i], i + 1
            value = value or ("true" if name in TRL_BOOLS else "")
            accepted = ACCEPTED.get(name, ())
            if accepted is None or value.lower() in accepted:
                notes.append(f"note: --{name} {value} (TRL's flag) has nothing to set here, and is ignored: {note}")
            else:
                refused.append(f"--{name} {value} is TRL's flag, and means something else here: {note}")
            continue
        if note:
            refused.append(f"--{name} is TRL's flag, and means something else here: {note}")
            if not eq and i < len(argv) and not argv[i].startswith("--"):
                i += 1
            continue
        if ours in bools:  # a bool takes its value, if any, as TRL's parser does
            if not eq and i < len(argv) and argv[i].lower() in TRUE + FALSE:
                value, i = argv[i], i + 1
            value = value.lower() or "true"
            if value not in TRUE + FALSE:
                refused.append(f"--{name} {value}: give true or false")
                continue
            out.append(f"--{ours}" if value in TRUE else f"--no-{ours}")
        else:
            out.append(f"--{ours}{eq}{value}")
    if len(refused) == 1:
        raise ValueError(f"{script}.py: {refused[0]}{' (--help lists every flag)' * refused[0].startswith('unknown')}")
    if refused:
        raise ValueError(f"{script}.py: {len(refused)} flags refused (--help lists every flag):\n"
                         + "\n".join(f"  {r}" for r in refused))
    return out + last, notes


def did_you_mean(name, flags, table):
    """"; did you mean --lr (TRL: --learning_rate)?": the closest of the script's flags and its TRL
    aliases (difflib), each shown as the flag here; "" when none is close. A TRL name of
    another script never comes here (elsewhere): its closest spelling here misled (sft.py's
    --max_completion_length was answered --max_length)."""
    def shown(n):
        if n in table and not table[n][1]:
            return f"--{table[n][0]} (TRL: --{n})"
        same = [trl for trl, (ours, note) in table.items() if ours == n and not note]
        return f"--{n}" + (f" (TRL: --{same[0]})" if same else "")

    aliases = [n for n, (ours, note) in table.items() if ours and not note]  # not the ones that set nothing here
    close = list(dict.fromkeys(map(shown, difflib.get_close_matches(name, [*flags, *aliases], n=3))))
    return f"; did you mean {' or '.join(close)}?" if close else ""


def docs_table():
    """The table of docs/usage.md's "Coming from TRL", in markdown."""
    scripts = lambda s: "all" if s == ALL else ", ".join(s)  # noqa: E731
    lines = ["| TRL's flag | here | scripts | what differs |", "|---|---|---|---|"]
    for trl, s, ours, note in TRL_FLAGS:
        if ours is None and trl in ACCEPTED:
            ok = ACCEPTED[trl]
            values = ok[:1] if ok in (TRUE, FALSE) else ok
            here = "ignored" if ok is None else f"ignored if {' or '.join(values or ())}, else refused"
        else:
            here = "refused" if note else f"`--{ours}`"
        lines.append(f"| `--{trl}` | {here} | {scripts(s)} | {note or 'nothing: the same meaning'} |")
    same = ", ".join(f"`--{n}`" + ("" if s == ALL else f" ({scripts(s)})") for n, s in SAME_NAME)
    bools = ", ".join(f"`--{flag} true` is `--{flag} {yes}` ({script}), false `{no}`"
                      for (script, flag), (yes, no) in BOOL_VALUES.items())
    values = "\n".join(f"- `{script}.py --{flag} {value}`: " + (f"`{ours}` here{note}" if ours else f"refused: {note}")
                       for script, by_flag in TRL_VALUES.items() for flag, table in by_flag.items()
                       for value, (ours, note) in table.items())
    return (
        "\n".join(lines) + f"\n\nThe same name and meaning here: {same}. TRL's booleans of flags that are not "
        f"booleans here: {bools}. An ignored flag prints its note; every flag refused is named in one message."
        f"\n\nTRL's values of a flag of ours:\n\n{values}")


if __name__ == "__main__":
    sys.stdout.write(docs_table() + "\n")
