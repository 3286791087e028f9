"""TRL's flag names on this project's scripts: the ones that mean the same here (aliases of a flag
of ours), the ones that do not (refused, saying what to pass instead), and a "did you mean" for
any unknown flag. One table serves the parser (cli.parse_config), each flag's --help line and the
table in docs/usage.md ("Coming from TRL"; `python -m plumbing.trl_flags` prints it)."""
import difflib
import sys

SCRIPTS = ("sft", "reward", "dpo", "grpo")
ALL, OFFLINE = SCRIPTS, ("sft", "reward", "dpo")  # OFFLINE: the scripts that train on a fixed data set
STEPS = ("a run here is counted in optimizer steps: pass --steps = epochs x training rows / --batch_size (3 epochs of "
         "10,000 rows at --batch_size 64: --steps 469)")
ONLY_THIS = ("always on here: every assistant turn of a `messages` row is trained on and the other turns are context; "
             "a prompt/completion row trains on its completion, a `text` row on all of its tokens")

# (TRL's name, the scripts it holds for, the flag here, note). No note: an alias, the same meaning
# under another name. A note: TRL's flag means something else here (or nothing), and a command
# that uses it is refused with the note, which says what to pass instead.
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
    ("report_to", ALL, "wandb", ""),  # a value: wandb (--wandb) or none (--no-wandb)
    ("max_prompt_length", ALL, "max_prompt_len", ""),
    ("max_completion_length", ("dpo",), "max_response_len", ""),
    ("max_completion_length", ("grpo",), "max_new_tokens", ""),
    ("per_device_eval_batch_size", OFFLINE, "eval_batch_size", ""),
    ("max_steps", OFFLINE, "steps", ""),
    ("num_generations", ("grpo",), "group_size", ""),
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
    ("logging_steps", ALL, None, "every step is logged here: one line and one metrics.jsonl row per step"),
    ("lr_scheduler_type", ALL, None,
     "the schedule here is fixed: a linear warmup over --warmup_steps, then a cosine decay to 0"),
    ("bf16", ALL, None,
     "precision is chosen here: bf16 autocast (FSDP's mixed precision under torchrun) on a GPU that has bf16, fp32 "
     "weights and optimizer; --save_dtype sets the exported weights' dtype"),
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
    ("lora_modules_to_save", ALL, None, "no modules trained whole beside the adapters here, but reward.py's score head"),
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
             ("padding_free", ("sft", "dpo"))]

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")  # how TRL's parser (HfArgumentParser) reads a bool's value

LISTS = {"lora_target_modules"}  # TRL's list flags (nargs="+": `--lora_target_modules q_proj v_proj`): comma-joined here

# TRL's GRPO loss_type names the policy term and how it is averaged at once; here they are two flags, --loss_type (the
# term: grpo is PPO's clipped surrogate, as TRL's grpo, dapo, dr_grpo and bnpo are) and --loss_agg (the average).
# TRL's names of an average given to --loss_type: {script: {flag: {TRL's value: (the flags here, or None: refused,
# with what differs)}}}. TRL's own `grpo` is a value here too, PPO's term: averaged as TRL's grpo by --loss_agg
# seq_mean_token_mean (tests/test_variants.py computes each of TRL's losses both ways).
TRL_VALUES = {"grpo": {"loss_type": {
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
    ours = flags.split()[0]
    if any(a == ours or a.startswith(ours + "=") for a in argv):
        raise ValueError(f"{script}.py: --{name} {value} is TRL's name for {flags} here, and {ours} is given too: "
                         f"pass one of them")
    return flags.split()


def rows(script):
    """{TRL's name: (the flag here, note)} of the rows that hold for `script` (a script's file
    name without .py; none for another, such as pipeline)."""
    return {trl: (ours, note) for trl, scripts, ours, note in TRL_FLAGS if script in scripts}


def help_note(script, flag):
    """What a flag's --help line says of TRL: "(TRL: --learning_rate)" for an alias of it, and the
    note of each TRL flag that means something else here and names it."""
    table = rows(script)
    same = [f"--{trl}" for trl, (ours, note) in table.items() if ours == flag and not note]
    other = [f" (not TRL's --{trl}: {note})" for trl, (ours, note) in table.items() if ours == flag and note]
    return (f" (TRL: {', '.join(same)})" if same else "") + "".join(other)


def translate(script, argv, flags, bools):
    """argv with TRL's names of `script` replaced by this project's: `--learning_rate 1e-5` ->
    `--lr 1e-5`, `--use_peft true` -> `--lora`, `--report_to wandb` -> `--wandb`, a list flag's values
    comma-joined (`--lora_target_modules q_proj v_proj`), a TRL value of ours (`grpo.py --loss_type
    dapo` -> `--loss_agg token_mean`, TRL_VALUES). flags: every
    flag name the script has (bools too, and their `no-` forms); bools: those that take no value.
    ValueError, naming the script and the flag, for a TRL flag that means something else here
    (its note) and for a flag that is neither (with a "did you mean")."""
    table, out, i = rows(script), [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            return out + argv[i - 1:]
        name, eq, value = arg[2:].partition("=")
        if arg.startswith("--") and name in bools and not name.startswith("no-") and (
                eq or (i < len(argv) and argv[i].lower() in TRUE + FALSE)):  # TRL's `--flag false` of a bool here
            value, i = (value, i) if eq else (argv[i], i + 1)
            if value.lower() not in TRUE + FALSE:
                raise ValueError(f"{script}.py: --{name}={value}: give true or false, or --{name} / --no-{name}")
            out.append(f"--{name}" if value.lower() in TRUE else f"--no-{name}")
            continue
        if arg.startswith("--") and name in LISTS:  # TRL's list: every value up to the next flag
            values = [value] if eq else []
            while not eq and i < len(argv) and not argv[i].startswith("--"):
                values, i = values + [argv[i]], i + 1
            out.append(f"--{name}={','.join(values)}")
            continue
        given = value if eq else argv[i] if i < len(argv) else None
        if arg.startswith("--") and given in TRL_VALUES.get(script, {}).get(name, {}):  # `--loss_type dapo`
            out, i = out + trl_value(script, name, given, argv), i + (not eq)
            continue
        if not arg.startswith("--") or arg == "--help" or name in flags:
            out.append(arg)
            continue
        if name not in table:
            raise ValueError(f"{script}.py: unknown flag --{name}{did_you_mean(name, flags, table)} (--help lists "
                             f"every flag)")
        ours, note = table[name]
        if note:
            raise ValueError(f"{script}.py: --{name} is TRL's flag, and means something else here: {note}")
        if ours in bools or name == "report_to":  # a bool takes its value, if any, as TRL's parser does
            if not eq and i < len(argv) and (argv[i].lower() in TRUE + FALSE or name == "report_to"):
                value, i = argv[i], i + 1
            value = value.lower() or "true"
            if name == "report_to":
                if value not in ("wandb", "none"):
                    raise ValueError(f"{script}.py: --report_to {value}: only wandb here (--wandb), or none")
                value = "true" if value == "wandb" else "false"
            if value not in TRUE + FALSE:
                raise ValueError(f"{script}.py: --{name} {value}: give true or false")
            out.append(f"--{ours}" if value in TRUE else f"--no-{ours}")
        else:
            out.append(f"--{ours}{eq}{value}")
    return out


def did_you_mean(name, flags, table):
    """"; did you mean --lr (TRL: --learning_rate)?": the closest of the script's flags and TRL's
    names (difflib), each shown as the flag here; "" when none is close."""
    def shown(n):
        if n in table and not table[n][1]:
            return f"--{table[n][0]} (TRL: --{n})"
        same = [trl for trl, (ours, note) in table.items() if ours == n and not note]
        return f"--{n}" + (f" (TRL: --{same[0]})" if same else "")

    close = list(dict.fromkeys(map(shown, difflib.get_close_matches(name, [*flags, *table], n=3))))
    return f"; did you mean {' or '.join(close)}?" if close else ""


def docs_table():
    """The table of docs/usage.md's "Coming from TRL", in markdown."""
    scripts = lambda s: "all" if s == ALL else ", ".join(s)  # noqa: E731
    lines = ["| TRL's flag | here | scripts | what differs |", "|---|---|---|---|"]
    for trl, s, ours, note in TRL_FLAGS:
        here = "refused" if note else f"`--{ours}`"
        lines.append(f"| `--{trl}` | {here} | {scripts(s)} | {note or 'nothing: the same meaning'} |")
    same = ", ".join(f"`--{n}`" + ("" if s == ALL else f" ({scripts(s)})") for n, s in SAME_NAME)
    values = "\n".join(f"- `{script}.py --{flag} {value}`: " + (f"`{ours}` here" if ours else f"refused: {note}")
                       for script, by_flag in TRL_VALUES.items() for flag, table in by_flag.items()
                       for value, (ours, note) in table.items())
    return "\n".join(lines) + f"\n\nThe same name and meaning here: {same}.\n\nTRL's values of a flag of ours:\n\n{values}"


if __name__ == "__main__":
    sys.stdout.write(docs_table() + "\n")
