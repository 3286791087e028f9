"""TRL's flag names on this project's scripts: the ones that mean the same here (aliases of a flag
of ours), the ones that mean nothing here (accepted with a note), the ones that mean something
else (refused, saying what to pass instead), TRL's flags of another script (named as such), and a
"did you mean" for any other unknown flag. One table serves the parser (cli.parse_config), each
flag's --help line and the table in docs/usage.md ("Coming from TRL"; `python -m plumbing.trl_flags`
prints it). TRL's flags whose value here follows from the world size, the accumulation or the
defaults (`--per_device_train_batch_size`, `--max_length`) are translated at the start (computed).
TRL's default values: trl_defaults."""
import math
import sys

SCRIPTS = ("sft", "reward", "dpo", "grpo")
ALL, OFFLINE = SCRIPTS, ("sft", "reward", "dpo")  # OFFLINE: the scripts that train on a fixed data set
ONLY_THIS = ("always on here: every assistant turn of a `messages` row is trained on and the other turns are context; "
             "a prompt/completion row trains on its completion, a `text` row on all of its tokens")

PRECISION = ("precision is chosen here: bf16 autocast (FSDP's mixed precision under torchrun) on a GPU that has bf16, "
             "fp32 weights and optimizer; --save_dtype sets the exported weights' dtype")
LOGGED = "every step is logged here: one line and one metrics.jsonl row per step"
DROPOUT = ("dropout is always off here, as TRL's disable_dropout true turns it off (models.no_dropout: a policy's "
           "log-probs would differ from its own no-gradient pass)")
ADAPTERS = ("older TRL's: a LoRA run's reference here is the same network with its adapters off (--lora); adapters are "
            "not chosen by name")
WEIGHTS = ("one loss here, plus RPO's NLL term: `--loss_type X sft --loss_weights 1 W` is --loss_type X --rpo_alpha W; "
           "other weights or combinations have no equal here")
SHUFFLED = "the rows are drawn here in an order seeded by --seed, a new permutation each pass over them"

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
    ("torch_compile", ALL, "compile_layers", ""),
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
     "--batch_size here is the global batch, over all processes and micro-batches: --batch_size = per-device x "
     "processes x --grad_accum, computed at the start (8 per device on 4 GPUs with --grad_accum 2: --batch_size 64)"),
    ("per_device_train_batch_size", ("grpo",), "prompts_per_step",
     "a rollout here is --prompts_per_step prompts x --group_size completions over all processes, split into "
     "--num_mini_batches optimizer steps: --prompts_per_step = per-device x processes x --grad_accum x "
     "--num_mini_batches / --group_size, computed at the start (refused where that is not a whole number of groups "
     "on each process)"),
    ("max_steps", ("grpo",), "steps",
     "--steps here counts rollouts, each followed by --num_iterations x --num_mini_batches optimizer steps (TRL's "
     "max_steps counts optimizer steps): pass --steps = max_steps / (num_iterations x num_mini_batches)"),
    ("warmup_ratio", ALL, "warmup_steps",
     "warmup here is a number of optimizer steps: --warmup_steps = ceil(ratio x the run's optimizer steps), computed at "
     "the start, as TRL 1.16 reads --warmup_steps below 1 (0.1 of 700 steps: --warmup_steps 70)"),
    ("max_length", OFFLINE, "max_prompt_len",
     "TRL cuts prompt + completion to max_length from the end; here the prompt (from the left) and the completion (from "
     "the right) each have a limit: --max_prompt_len + --max_response_len = max_length, split as the defaults are "
     "(TRL's 1024: 512 + 512) or around the one given, computed at the start"),
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
    ("reward_funcs", ("grpo",), "reward_fn", ""),  # TRL's names and dotted paths: REWARD_FUNCS, reward_funcs()
    ("vllm_mode", ("grpo",), None, "the sampler is built in (sampling.py); there is no vLLM server or colocated vLLM "
     "here"),
    ("dtype", ALL, None, PRECISION),
    ("torch_dtype", ALL, None, "older TRL's name of --dtype: " + PRECISION),
    ("disable_dropout", ("reward", "dpo", "grpo"), None, DROPOUT),
    ("sync_ref_model", ("grpo",), None, "no TR-DPO mixing here: --ref_refresh_every N copies the policy into the "
     "reference every N steps (TRL's sync with ref_model_mixup_alpha 1)"),
    ("sync_ref_model", ("dpo",), None, "the reference here stays the starting policy (or --ref_model) for the whole run"),
    ("ref_adapter_name", ("dpo",), None, ADAPTERS),
    ("model_adapter_name", ("dpo",), None, ADAPTERS),
    ("shuffle_dataset", ("sft",), None, "TRL's SFT batches are drawn in a random order either way; " + SHUFFLED),
    ("shuffle_dataset", ("grpo",), None, SHUFFLED),
    ("loss_weights", ("dpo",), None, WEIGHTS),
]

# TRL's flags whose name and meaning are this project's too (listed in the docs' table)
SAME_NAME = [("seed", ALL), ("weight_decay", ALL), ("warmup_steps", ALL), ("trust_remote_code", ALL),
             ("beta", ("dpo", "grpo")), ("loss_type", ("dpo",)), ("label_smoothing", ("dpo",)),
             ("temperature", ("grpo",)), ("top_p", ("grpo",)), ("top_k", ("grpo",)), ("min_p", ("grpo",)),
             ("num_iterations", ("grpo",)), ("lr_scheduler_type", ALL), ("num_train_epochs", ALL),
             ("vllm_importance_sampling_correction", ("grpo",)), ("vllm_importance_sampling_mode", ("grpo",)),
             ("vllm_importance_sampling_clip_max", ("grpo",)), ("vllm_importance_sampling_clip_min", ("grpo",)),
             ("epsilon_high", ("grpo",)), ("scale_rewards", ("grpo",)), ("reward_weights", ("grpo",)),
             ("mask_truncated_completions", ("grpo",)), ("lora_r", ALL), ("lora_alpha", ALL), ("lora_dropout", ALL),
             ("lora_target_modules", ALL),
             ("padding_free", ("sft", "dpo")), ("report_to", ALL)]

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")  # how TRL's parser (HfArgumentParser) reads a bool's value

# The TRL flags without a counterpart here (None above) that a run accepts, printing their note, given one of
# these values (None: any value; keyed (script, name) where one script differs); another value
# (`--logging_strategy epoch`, `--packing`) is refused.
ACCEPTED = {"logging_steps": None, "logging_strategy": ("steps",), "logging_first_step": None,
            "bf16": None, "fp16": None, "save_strategy": ("steps",),
            "save_total_limit": None, "eval_strategy": ("steps",), "dataset_train_split": ("train",),
            "dataset_text_field": ("text",), "dataloader_num_workers": None, "push_to_hub": FALSE, "use_vllm": None,
            "assistant_only_loss": TRUE, "completion_only_loss": TRUE, "packing": FALSE,
            "lora_task_type": ("causal_lm", "seq_cls"), "use_rslora": FALSE, "use_dora": FALSE, "vllm_mode": None,
            "dtype": None, "torch_dtype": None, "disable_dropout": TRUE, "sync_ref_model": FALSE, "ref_adapter_name": (),
            "model_adapter_name": (), "shuffle_dataset": TRUE, ("sft", "shuffle_dataset"): None}
TRL_BOOLS = {"logging_first_step", "bf16", "fp16", "push_to_hub", "use_vllm", "assistant_only_loss",
             "completion_only_loss", "packing", "use_rslora", "use_dora", "disable_dropout", "sync_ref_model",
             "shuffle_dataset"}  # TRL's bools among them: bare, `--bf16` is true

# Flags of ours named as TRL's whose TRL type is a bool: TRL's true and false, as its parser reads them, are
# these values (--log_completions 4 logs 4 completions a step here; TRL's --log_completions true logs them)
BOOL_VALUES = {("grpo", "log_completions"): ("8", "0"), ("grpo", "scale_rewards"): ("group", "none")}

# TRL's list flags (nargs="+": `--report_to wandb trackio`): comma-joined here
LISTS = {"lora_target_modules", "report_to", "reward_funcs"}

# TRL's flags whose value here is computed at the start, from the world size, the accumulation and the defaults
# (cli.parse_config, computed()): translate() hands their values over instead of a flag
COMPUTED = ("per_device_train_batch_size", "max_length", "warmup_ratio")

# TRL's names that TRL 1.16 no longer has (its scripts and configs), kept for the commands written for an older TRL:
# --help and the docs' table say so (tests/test_trl_flags.py checks both sides against the installed TRL)
OLDER = {"max_prompt_length": ALL, "max_completion_length": OFFLINE, "warmup_ratio": ALL, "torch_dtype": ALL,
         "ref_adapter_name": ("dpo",), "model_adapter_name": ("dpo",)}

# trl/scripts/grpo.py's names of TRL's own reward functions (its --reward_funcs also takes a dotted path,
# `my_lib.rewards.fn`: `my_lib.rewards:fn` here): TRL's function itself, imported from TRL, or None: refused, saying why
REWARD_FUNCS = {"accuracy_reward": "trl.rewards:accuracy_reward", "think_format_reward": "trl.rewards:think_format_reward",
                "reasoning_accuracy_reward": "trl.rewards:reasoning_accuracy_reward",
                "get_soft_overlong_punishment": None}
OVERLONG = ("TRL's script builds it for 1280-token completions with a 256-token window: here --overlong_buffer_len 256 "
            "--overlong_penalty_factor 1, its length --max_new_tokens")

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


# TRL's DPO loss types without an equal here (dpo.py's are TRL's sigmoid, sigmoid_norm, ipo, hinge, robust and apo_zero,
# under TRL's names, and SimPO from its CPO trainer; RPO is TRL's [sigmoid, sft]: DPO_SFT)
_NO_DPO = "it is not implemented here; the losses here: sigmoid, sigmoid_norm, ipo, hinge, robust, apo_zero, simpo"
TRL_VALUES["dpo"] = {"loss_type": {
    "exo_pair": (None, "EXO (arXiv:2402.00856): " + _NO_DPO),
    "nca_pair": (None, "NCA: " + _NO_DPO),
    "bco_pair": (None, "BCO: " + _NO_DPO),
    "sppo_hard": (None, "SPPO (arXiv:2405.00675): " + _NO_DPO),
    "aot": (None, "AOT: " + _NO_DPO),
    "aot_unpaired": (None, "AOT: " + _NO_DPO),
    "discopop": (None, "DiscoPOP (arXiv:2406.08414): " + _NO_DPO),
    "apo_down": (None, "APO-down (arXiv:2408.06266): " + _NO_DPO + " (APO-zero is apo_zero)"),
    "sft": (None, "TRL's sft alone is the chosen responses' NLL: train on them with sft.py (a prompt/completion set), "
                  "or add the term to a preference loss: --loss_type sigmoid --rpo_alpha 1 (TRL's [sigmoid, sft])"),
}}
DPO_SFT = ("the chosen response's NLL per token, added to the preference loss times --rpo_alpha (RPO); TRL's sft term "
           "averages over the micro-batch's chosen tokens, --rpo_alpha over each pair's (the same where every chosen "
           "response has the same length)")


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
    same = [f"--{trl}" + (", older TRL's" if script in OLDER.get(trl, ()) else "")
            for trl, (ours, note) in table.items() if ours == flag and not note]
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


def _number(text):
    """text as a float, or nan where it is none (nan compares false with every bound)."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def translate(script, argv, flags, bools):
    """argv with TRL's names of `script` replaced by this project's: `--learning_rate 1e-5` ->
    `--lr 1e-5`, `--use_peft true` -> `--lora`, `--log_completions
    true` (or alone) -> `--log_completions 8` (BOOL_VALUES), a list flag's values comma-joined
    (`--lora_target_modules q_proj v_proj`, `--report_to wandb tensorboard`; `--reward_funcs`: reward_funcs), a TRL value of ours
    (`grpo.py --loss_type dapo` -> `--loss_agg token_mean`, TRL_VALUES; dpo.py's list `--loss_type
    sigmoid sft`: dpo_losses). flags: every flag name the script has (bools too, and their `no-`
    forms); bools: those that take no value. Returns (argv, notes, computed): the note of each TRL
    flag given that means nothing here and was accepted (ACCEPTED) or was translated with a
    difference, one line each; {name: value} of the COMPUTED flags given, for computed(). ValueError,
    naming the script, with every flag refused, in one message: a TRL flag that means something else
    here (its note), a TRL flag of another script (elsewhere), a TRL value with no equal here, a bad
    true/false, and a flag that is none of these (with a "did you mean")."""
    table, out, last, notes, refused, i, computed, losses = rows(script), [], [], [], [], 0, {}, {}
    named = {a[2:].partition("=")[0] for a in argv if a.startswith("--")}
    given = named | {table[n][0] for n in named if n in table and table[n][0] and not table[n][1]}  # an alias: ours
    if {"num_train_epochs", "steps"} <= given:  # TRL's max_steps wins over its epochs; here neither is dropped
        refused.append("--num_train_epochs sets --steps once the rows are loaded, and the command gives --steps too: "
                       "pass one")
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            out, last = out + last, argv[i - 1:]
            break
        name, eq, value = arg[2:].partition("=")
        if arg.startswith("--") and (script, name) in BOOL_VALUES:  # TRL's `--log_completions true`
            word = value if eq else argv[i] if i < len(argv) else ""
            bare = not eq and (i == len(argv) or argv[i].startswith("--"))  # `--log_completions` alone: TRL's true
            if bare or word.lower() in ("true", "false", "yes", "no"):  # words only: --log_completions 1 is a number here
                i += 0 if eq or bare else 1
                yes, no = BOOL_VALUES[(script, name)]
                if not bare and word.lower() in FALSE:
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
        if arg.startswith("--") and (name in LISTS and (name in flags or name in table)
                                     or script == "dpo" and name in ("loss_type", "loss_weights")):
            values = [value] if eq else []  # TRL's list: every value up to the next flag
            while not eq and i < len(argv) and not argv[i].startswith("--"):
                values, i = values + [argv[i]], i + 1
            if name in ("loss_type", "loss_weights"):  # dpo.py's: decided once both are read (dpo_losses)
                losses[name] = values
            elif name == "reward_funcs":
                try:
                    out.append(f"--reward_fn={reward_funcs(values, named, notes)}")
                except ValueError as e:
                    refused.append(str(e))
            else:
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
        if arg.startswith("--") and name == "warmup_steps" and "." in (word or "") and 0 < _number(word) < 1:
            i += not eq  # TRL 1.16's `--warmup_steps 0.1`: a ratio of the run's optimizer steps
            refused += ["--warmup_steps as a ratio and --warmup_ratio: pass one"] * ("warmup_ratio" in named)
            computed["warmup_ratio"] = float(word)
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
        if name in COMPUTED:  # its value, for computed() at the start
            if not eq and i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            ratio = name == "warmup_ratio"
            both = {"per_device_train_batch_size": {"batch_size", "prompts_per_step"} & given,
                    "max_length": {"max_prompt_len", "max_response_len"} & given if {"max_prompt_len",
                                                                                     "max_response_len"} <= given else (),
                    "warmup_ratio": {"warmup_steps"} & named}[name]
            if not (0 <= _number(value) < 1 if ratio else value.isdigit() and int(value) >= 1):
                refused.append(f"--{name} {value or '(no value)'} is TRL's flag: give "
                               f"{'a ratio in [0, 1)' if ratio else 'a whole number, at least 1'}")
            elif both:
                refused.append(f"--{name} sets {' and '.join(f'--{f}' for f in sorted(both))} here, which the command "
                               f"gives too: pass one or the other")
            else:
                computed[name] = float(value) if ratio else int(value)
            continue
        if ours is None:  # TRL's flag has no counterpart here: accepted, with its note, where its value is ACCEPTED's
            if not eq and i < len(argv) and (not argv[i].startswith("--") if name not in TRL_BOOLS
                                              else argv[i].lower() in TRUE + FALSE):
                value, i = argv[i], i + 1
            value = value or ("true" if name in TRL_BOOLS else "")
            accepted = ACCEPTED[(script, name)] if (script, name) in ACCEPTED else ACCEPTED.get(name, ())
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
    if losses:
        try:
            out += dpo_losses(losses.get("loss_type", ["sigmoid"]), losses.get("loss_weights"), given, notes)
        except ValueError as e:
            refused.append(str(e))
    if len(refused) == 1:
        raise ValueError(f"{script}.py: {refused[0]}{' (--help lists every flag)' * refused[0].startswith('unknown')}")
    if refused:
        raise ValueError(f"{script}.py: {len(refused)} flags refused (--help lists every flag):\n"
                         + "\n".join(f"  {r}" for r in refused))
    return out + last, notes, computed


def reward_funcs(values, named, notes):
    """TRL's `--reward_funcs a b` as --reward_fn's comma-separated list: a rule here or a
    `module:function` as it is; TRL's dotted path `my_lib.rewards.fn` as `my_lib.rewards:fn`; a
    name of TRL's own functions (REWARD_FUNCS) as that function imported from TRL, with a note.
    ValueError for one with no equal here, and where --reward_fn is given too (named: the flags given)."""
    if "reward_fn" in named:
        raise ValueError("--reward_funcs is TRL's name of --reward_fn, which the command gives too: pass one")
    entries = [e.strip() for v in values for e in v.split(",") if e.strip()]
    if not entries:
        raise ValueError("--reward_funcs: give one or more functions")
    out = []
    for e in entries:
        if e in REWARD_FUNCS:
            if REWARD_FUNCS[e] is None:
                raise ValueError(f"--reward_funcs {e}: {OVERLONG}")
            notes.append(f"note: --reward_funcs {e} is TRL's own function, called from TRL here ({REWARD_FUNCS[e]}: "
                         f"trl and its dependencies must be installed)")
            e = REWARD_FUNCS[e]
        elif ":" not in e and "." in e and not e.endswith(".py"):
            e = ":".join(e.rsplit(".", 1))  # TRL's dotted path: the module, then the function
        out.append(e)
    return ",".join(out)


def dpo_losses(types, weights, given, notes):
    """dpo.py's flags for TRL's `--loss_type` list and `--loss_weights`: one type of ours as it
    is; `X sft` (weights 1 and W, or none: 1 and 1) as --loss_type X --rpo_alpha W, with a note
    (DPO_SFT). ValueError for a TRL type not implemented here (TRL_VALUES) and for a weighted sum
    of several losses, which no flag here gives."""
    listed = " ".join(types)
    for t in types:
        if t in TRL_VALUES["dpo"]["loss_type"] and (len(types) == 1 or t != "sft"):
            raise ValueError(f"--loss_type {t} is TRL's, with no equal here: {TRL_VALUES['dpo']['loss_type'][t][1]}")
    try:
        w = [float(x) for x in weights or [1.0] * len(types)]
    except ValueError:
        raise ValueError(f"--loss_weights {' '.join(weights)}: give one number per --loss_type") from None
    if len(w) != len(types):
        raise ValueError(f"--loss_weights {' '.join(weights)}: {len(w)} weights for {len(types)} loss types "
                         f"(--loss_type {listed}): give one each")
    if len(types) == 1 and w == [1.0]:
        return [f"--loss_type={types[0]}"]
    sft = [k for k, t in enumerate(types) if t == "sft"]
    if len(types) != 2 or len(sft) != 1 or w[1 - sft[0]] != 1.0:
        said = f"--loss_weights {' '.join(weights)} is TRL's flag, with --loss_type {listed}" if weights else \
            f"--loss_type {listed} is TRL's list"
        raise ValueError(f"{said}: a weighted sum of losses; {WEIGHTS}")
    if "rpo_alpha" in given:
        raise ValueError(f"--loss_type {listed} sets --rpo_alpha here, which the command gives too: pass one")
    loss, alpha = types[1 - sft[0]], f"{w[sft[0]]:g}"
    notes.append(f"note: --loss_type {listed} (TRL's) is --loss_type {loss} --rpo_alpha {alpha} here: {DPO_SFT}")
    return [f"--loss_type={loss}", f"--rpo_alpha={alpha}"]


def computed(script, cfg, values, world, preset):
    """The flags here that TRL's COMPUTED flags give (translate()), set in place on cfg, parsed:
    `--per_device_train_batch_size 8` on `world` processes -> --batch_size 8 x world x --grad_accum
    (grpo.py: --prompts_per_step, the rollout of that many completions a process and micro-batch);
    `--max_length N` -> --max_prompt_len + --max_response_len = N, split as `preset` (the lengths
    the run would take: cli.preset) splits them, or around the one given. Returns the banner's
    notes; ValueError where no value here means the same, saying why."""
    notes = []
    if "per_device_train_batch_size" in values:
        per, accum = values["per_device_train_batch_size"], cfg.grad_accum
        if script == "grpo":
            passes = cfg.num_mini_batches or preset["num_mini_batches"]  # optimizer steps a rollout
            if per * accum * passes % cfg.group_size:
                raise ValueError(f"--per_device_train_batch_size {per} is TRL's flag: {per} x --grad_accum {accum} x "
                                 f"--num_mini_batches {passes} = {per * accum * passes} completions a process and "
                                 f"rollout are not whole groups of --group_size {cfg.group_size}: a group stays on one "
                                 f"process here. Pass --prompts_per_step (prompts a rollout, over all processes)")
            cfg.prompts_per_step = per * world * accum * passes // cfg.group_size
            got = (f"--prompts_per_step {cfg.prompts_per_step} (x --group_size {cfg.group_size} = "
                   f"{per * world * accum * passes} completions a rollout, {per} a micro-batch on each process)")
        else:
            cfg.batch_size = per * world * accum
            got = f"--batch_size {cfg.batch_size}"
        notes.append(f"note: --per_device_train_batch_size {per} (TRL's) on {world} process{'es' * (world > 1)} x "
                     f"--grad_accum {accum}: {got}")
    if "warmup_ratio" in values:  # transformers' get_warmup_steps: ceil(ratio x the run's optimizer steps)
        ratio = values["warmup_ratio"]
        if cfg.num_train_epochs:
            raise ValueError(f"--warmup_steps {ratio:g} is TRL's ratio of the run's optimizer steps, which "
                             f"--num_train_epochs sets only once the rows are loaded: give --warmup_steps in steps")
        passes = [getattr(cfg, k) or preset[k] for k in ("num_iterations", "num_mini_batches") if hasattr(cfg, k)]
        total = cfg.steps * math.prod(passes)
        cfg.warmup_steps = math.ceil(ratio * total)
        notes.append(f"note: --warmup_steps {ratio:g} (TRL's ratio of the run's {total} optimizer steps): "
                     f"--warmup_steps {cfg.warmup_steps}")
    if "max_length" in values:
        n, prompt, response = values["max_length"], cfg.max_prompt_len, cfg.max_response_len
        if prompt is None and response is None:
            prompt = n * preset["max_prompt_len"] // (preset["max_prompt_len"] + preset["max_response_len"])
        prompt, response = (prompt, n - prompt) if response is None else (n - response, response)
        if min(prompt, response) < 1:
            raise ValueError(f"--max_length {n} leaves no tokens for the {'completion' if response < 1 else 'prompt'} "
                             f"beside the one given: pass a longer --max_length")
        cfg.max_prompt_len, cfg.max_response_len = prompt, response
        notes.append(f"note: --max_length {n} (TRL's, prompt + completion): --max_prompt_len {prompt} (cut from the "
                     f"left) + --max_response_len {response} (cut from the right)")
    return notes


def did_you_mean(name, flags, table):
    """"; did you mean --lr (TRL: --learning_rate)?": the script's flags and its TRL aliases within
    TYPOS edits of `name` (edit_distance), closest first, each shown as the flag here; "" when none
    is that close: a name farther off is another flag, not a misspelling (--vllm_mode was answered
    --rs_mode). A TRL name of another script never comes here (elsewhere)."""
    def shown(n):
        if n in table and not table[n][1]:
            return f"--{table[n][0]} (TRL: --{n})"
        same = [trl for trl, (ours, note) in table.items() if ours == n and not note]
        return f"--{n}" + (f" (TRL: --{same[0]})" if same else "")

    aliases = [n for n, (ours, note) in table.items() if ours and not note]  # not the ones that set nothing here
    near = sorted((edit_distance(name, n), n) for n in {*flags, *aliases} if not n.startswith("no-"))
    close = list(dict.fromkeys(shown(n) for d, n in near if d <= typos(name)))[:3]
    return f"; did you mean {' or '.join(close)}?" if close else ""


def typos(name):
    """The edits a misspelling of `name` is taken to be within: 1 for a name of up to 5 letters, else 2."""
    return 1 if len(name) <= 5 else 2


def edit_distance(a, b):
    """The fewest single-letter insertions, deletions, substitutions and swaps of two neighbours that
    turn a into b (Damerau-Levenshtein's optimal string alignment)."""
    rows = [list(range(len(b) + 1))]
    for i, x in enumerate(a, 1):
        row = [i]
        for j, y in enumerate(b, 1):
            row.append(min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (x != y)))
            if i > 1 and j > 1 and x == b[j - 2] and a[i - 2] == y:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def docs_table():
    """The table of docs/usage.md's "Coming from TRL", in markdown."""
    scripts = lambda s: "all" if s == ALL else ", ".join(s)  # noqa: E731
    lines = ["| TRL's flag | here | scripts | what differs |", "|---|---|---|---|"]
    for trl, s, ours, note in TRL_FLAGS:
        if ours is None and trl in ACCEPTED:
            ok = ACCEPTED[(s[0], trl)] if (s[0], trl) in ACCEPTED else ACCEPTED[trl]
            values = ok[:1] if ok in (TRUE, FALSE) else ok
            here = "ignored" if ok is None else f"ignored if {' or '.join(values)}, else refused" if values else "refused"
        elif trl in COMPUTED:
            here = f"`--{ours}`, computed"
        else:
            here = "refused" if note else f"`--{ours}`"
        older = " (older TRL's)" * (set(s) <= set(OLDER.get(trl, ())))
        lines.append(f"| `--{trl}`{older} | {here} | {scripts(s)} | {note or 'nothing: the same meaning'} |")
    same = ", ".join(f"`--{n}`" + ("" if s == ALL else f" ({scripts(s)})") for n, s in SAME_NAME)
    bools = ", ".join(f"`--{flag} true` is `--{flag} {yes}` ({script}), false `{no}`"
                      for (script, flag), (yes, no) in BOOL_VALUES.items())
    values = "\n".join(f"- `{script}.py --{flag} {value}`: " + (f"`{ours}` here{note}" if ours else f"refused: {note}")
                       for script, by_flag in TRL_VALUES.items() for flag, table in by_flag.items()
                       for value, (ours, note) in table.items())
    funcs = ", ".join(f"`{name}`" for name in REWARD_FUNCS)
    return (
        "\n".join(lines) + f"\n\nThe same name and meaning here: {same}. TRL's booleans of flags that are not "
        f"booleans here: {bools}. An ignored flag prints its note; every flag refused is named in one message. "
        f"`--reward_funcs` takes TRL's dotted paths (`my_lib.rewards.fn`: `my_lib.rewards:fn` here) and the names of "
        f"TRL's own functions ({funcs}: TRL's function itself, from TRL, but get_soft_overlong_punishment: {OVERLONG})."
        f"\n\nTRL's values of a flag of ours (dpo.py's list `--loss_type X sft --loss_weights 1 W` is `--loss_type X "
        f"--rpo_alpha W`: {DPO_SFT}):\n\n{values}")


if __name__ == "__main__":
    sys.stdout.write(docs_table() + "\n")
