"""TRL 1.16.0's defaults, pinned (TRL_DEFAULTS): what --help, the banner and the docs call TRL's,
checked against TRL's config classes where TRL is installed (tests/test_trl_flags.py); and the
defaults here that differ from them, each with the flag that gives TRL's (differences, the
banner's line)."""
from plumbing import trl_flags

# TRL 1.16.0's defaults, pinned: the fields of its config classes that this project compares with (the scripts'
# presets for a model of your own, --help's "TRL's default", the banner's line of defaults that differ from TRL's).
# tests/test_trl_flags.py checks the scripts against this table, and the table against TRL's classes where TRL is
# installed. TRL 1.16 has no max_prompt_length (a GRPO prompt is not cut) and counts max_length (SFT, DPO, reward)
# over prompt + completion.
TRL_VERSION = "1.16.0"
_TRAINING = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_train_epochs=3.0, max_steps=-1,
                 warmup_steps=0, lr_scheduler_type="linear", gradient_checkpointing=True, seed=42, adam_beta1=0.9,
                 adam_beta2=0.999, weight_decay=0.0, max_grad_norm=1.0, save_steps=500)  # the four's (TrainingArguments')
TRL_DEFAULTS = {
    "SFTConfig": dict(_TRAINING, learning_rate=2e-5, max_length=1024, padding_free=False, dataset_text_field="text"),
    "RewardConfig": dict(_TRAINING, learning_rate=1e-4, max_length=1024, center_rewards_coefficient=None),
    "DPOConfig": dict(_TRAINING, learning_rate=1e-6, max_length=1024, beta=0.1, loss_type=["sigmoid"],
                      label_smoothing=0.0, precompute_ref_log_probs=False, padding_free=False),
    "GRPOConfig": dict(_TRAINING, learning_rate=1e-6, max_completion_length=512, num_generations=8,
                       steps_per_generation=None, beta=0.0, epsilon=0.2, epsilon_high=None, num_iterations=1,
                       loss_type="dapo", scale_rewards="group", temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                       mask_truncated_completions=False, reward_weights=None, vllm_importance_sampling_correction=True,
                       vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=3.0,
                       vllm_importance_sampling_clip_min=None),
    "ModelConfig": dict(lora_r=16, lora_alpha=32, lora_dropout=0.05, lora_target_modules=None),
}
CONFIG_OF = {"sft": "SFTConfig", "reward": "RewardConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig"}


def trl_default(script, field):
    """TRL 1.16.0's default of a field of the script's config class (or ModelConfig's, the LoRA
    flags), as TRL reads it: GRPO's epsilon_high None is its epsilon. KeyError where neither has it."""
    table = {**TRL_DEFAULTS["ModelConfig"], **TRL_DEFAULTS[CONFIG_OF[script]]}
    value = table[field]
    return table["epsilon"] if field == "epsilon_high" and value is None else value


def preset_trl(script, flag):
    """TRL 1.16's value, in this project's terms, of a flag that a Config's "trl" preset fills
    (cli.fill_defaults), or None where TRL has no one value for it alone: GRPO cuts no prompt, and
    SFT's, DPO's and the reward trainer's max_length counts prompt + completion together."""
    if flag == "num_mini_batches":  # steps_per_generation None: one optimizer step a generation
        return 1 if trl_default(script, "steps_per_generation") is None else None
    if flag == "reference":  # TRL loads no reference model at beta 0
        return trl_default(script, "beta") != 0
    try:
        return trl_default(script, {"lr": "learning_rate", "max_new_tokens": "max_completion_length"}.get(flag, flag))
    except KeyError:
        return None


def preset_note(script, flag, preset):
    """What --help says of a "trl" preset's value (cli.parse_config): ", TRL's", or how it stands
    to TRL's where TRL has no one value for the flag (preset_trl)."""
    if preset_trl(script, flag) is not None:
        return ", TRL's"
    if flag in ("max_prompt_len", "max_response_len") and script != "grpo":
        total = trl_default(script, "max_length")
        return f", {preset['max_prompt_len']} + {preset['max_response_len']} being TRL's max_length {total}"
    return ", where TRL 1.16 cuts no prompt" if flag == "max_prompt_len" else ""


# Flags of TRL's name (or an alias of one) that the banner does not hold against TRL's default: what a run evaluates,
# saves and logs, the speed flags (the same numbers either way: plumbing/speed.py), the model and data, and the step's
# size and the run's length, told apart by differences() itself
NOT_COMPARED = {"eval_every", "save_every", "eval_batch_size", "wandb", "log_completions", "eval_split", "padding_free",
                "model", "dataset", "out_dir", "trust_remote_code", "lora", "steps", "num_train_epochs"}
ADAM = "AdamW's beta2 0.95 (TRL's 0.999, which no flag here gives)"  # common.make_optimizer's betas are (0.9, 0.95)


def differences(script, cfg, defaults, world):
    """The defaults a run of `script` takes that are not TRL 1.16's, each with the flag that gives
    TRL's: "--seed 0 (TRL's --seed 42)". defaults: the value of each flag the run takes when it is
    not given (its Config's, or its preset's); a flag given another value is the user's choice and
    is not listed. Every flag of TRL's name or an alias of one (but NOT_COMPARED), TRL's value as
    trl_default reads it; and the step's size (TRL's is per_device_train_batch_size 8 a process),
    the run's length (TRL's 3 epochs), GRPO's prompts (TRL 1.16 cuts none) and AdamW's beta2."""
    def text(flag, value):
        if flag == "lora_target_modules" and value is None:
            return "none, peft's modules for the architecture: --lora_target_modules q_proj,v_proj on Llama"
        if isinstance(value, bool):
            return f"--{flag}" if value else f"--no-{flag}"
        return f"--{flag} {value:g}" if isinstance(value, float) else f"--{flag} {value}"

    def same(ours, theirs):
        theirs = theirs[0] if isinstance(theirs, list) and len(theirs) == 1 else theirs
        return not ours if theirs is None else ours == theirs

    at_default = [f for f in defaults if getattr(cfg, f, None) == defaults[f]]
    out, per, accum = [], trl_default(script, "per_device_train_batch_size"), cfg.grad_accum
    if script == "grpo" and "prompts_per_step" in at_default:
        rollout, passes, theirs = cfg.prompts_per_step * cfg.group_size, cfg.num_mini_batches, per * world * accum
        groups = theirs // cfg.group_size  # TRL's prompts a step, where its completions are whole groups
        if rollout != theirs * passes:
            out.append(f"--prompts_per_step {cfg.prompts_per_step} x --group_size {cfg.group_size} = {rollout} "
                       f"completions a rollout, {rollout // passes} an optimizer step (TRL's {per} a process x {world} "
                       f"x --grad_accum {accum} = {theirs}"
                       + (f", {groups} prompt{'s' * (groups != 1)} x {cfg.group_size}" * (theirs % cfg.group_size == 0))
                       + f": --per_device_train_batch_size {per})")
    elif "batch_size" in at_default and cfg.batch_size != per * world * accum:
        out.append(f"--batch_size {cfg.batch_size} rows a step (TRL's {per} a process x {world} x --grad_accum {accum} "
                   f"= {per * world * accum}: --per_device_train_batch_size {per})")
    if "steps" in at_default and not cfg.num_train_epochs:
        epochs = trl_default(script, "num_train_epochs")
        out.append(f"--steps {cfg.steps}{' rollouts' * (script == 'grpo')} (TRL's {epochs:g} passes over the "
                   f"{'prompts' if script == 'grpo' else 'rows'}: --num_train_epochs {epochs:g})")
    if script == "grpo" and "max_prompt_len" in at_default:
        out.append(f"--max_prompt_len {cfg.max_prompt_len}, a longer prompt cut from the left (TRL 1.16 cuts none: pass "
                   f"one as long as your longest)")
    pairs = {ours: trl for trl, (ours, note) in trl_flags.rows(script).items() if ours and not note}
    pairs |= {n: n for n, scripts in trl_flags.SAME_NAME if script in scripts}
    for flag, trl in pairs.items():
        if flag in NOT_COMPARED or flag not in at_default or flag.startswith("lora_") and not cfg.lora:
            continue
        try:
            theirs = trl_default(script, trl)
        except KeyError:  # an older TRL's name (max_prompt_length): no 1.16 default
            continue
        if not same(getattr(cfg, flag), theirs):
            out.append(f"{text(flag, getattr(cfg, flag))} (TRL's {text(flag, theirs)})")
    return out + [ADAM]
