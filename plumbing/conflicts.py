"""Flags that do not go together, one function a script, each message saying what to change (each
flag's own range and choices: cli.check_ranges; the schedule: cli.check_schedule). Called by the
scripts right after cli.start."""
import dataclasses
import math


def dpo(cfg):
    """Flags that do not go together (each flag's own range and choices: cli.check_ranges)."""
    if cfg.label_smoothing and cfg.loss_type not in ("sigmoid", "sigmoid_norm", "robust"):
        raise ValueError("--label_smoothing applies to --loss_type sigmoid, sigmoid_norm and robust only")
    if cfg.ref_model and cfg.loss_type == "simpo":
        raise ValueError("--loss_type simpo uses no reference model: drop --ref_model")


def grpo(cfg, d):
    """The batch arithmetic and the flags that do not go together, with messages that say what to
    change (each flag's own range and choices: cli.check_ranges)."""
    n_local = cfg.prompts_per_step // max(d.world_size, 1)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    is_set = [f"--{k} {'none' if getattr(cfg, k) is None else getattr(cfg, k)}" for k in (
        "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")
        if getattr(cfg, k) != defaults[k]]  # the correction's mode and bounds, where they are not the defaults
    checks = [
        (cfg.prompts_per_step % d.world_size == 0,
         f"--prompts_per_step {cfg.prompts_per_step} must be divisible by world size {d.world_size} (groups stay on one rank)"),
        ((n_local * cfg.group_size) % (cfg.num_mini_batches * cfg.grad_accum) == 0,
         f"each rank's {n_local} prompts x --group_size {cfg.group_size} completions must split into "
         f"--num_mini_batches {cfg.num_mini_batches} x --grad_accum {cfg.grad_accum} equal micro-batches"),
        (cfg.rs_samples == 0 or cfg.rs_samples >= cfg.group_size,
         f"--rs_samples {cfg.rs_samples} must be at least --group_size {cfg.group_size} (it keeps group_size of them)"),
        (cfg.adv_estimator == "grpo" or (cfg.scale_rewards == "none" and not cfg.global_norm),
         f"--adv_estimator {cfg.adv_estimator} sets its own scale: pass --scale_rewards none and no --global_norm"),
        (cfg.loss_type != "cispo" or cfg.epsilon_high >= 1,
         f"--loss_type cispo caps the IS weight at --epsilon_high itself, as TRL does: {cfg.epsilon_high} would "
         f"scale every token down; pass a cap above 1 (TRL suggests 5, ScaleRL's eps_max)"),
        (not cfg.delta or cfg.loss_type == "grpo",
         f"--delta bounds the clipped surrogate: it needs --loss_type grpo, not {cfg.loss_type}"),
        (not cfg.clip_ratio_c or cfg.loss_type in ("grpo", "dppo_tv", "dppo_kl"),
         f"--clip_ratio_c bounds the clipped surrogate or DPPO's weight: it needs --loss_type grpo or dppo_*, not "
         f"{cfg.loss_type}"),
        (not cfg.loss_type.startswith("dppo") or cfg.importance_sampling_level == "token",
         f"DPPO's trust region is per token: --loss_type {cfg.loss_type} needs --importance_sampling_level token"),
        (None in (cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max)
         or cfg.vllm_importance_sampling_clip_min < cfg.vllm_importance_sampling_clip_max,
         f"--vllm_importance_sampling_clip_min {cfg.vllm_importance_sampling_clip_min} must be less than "
         f"--vllm_importance_sampling_clip_max {cfg.vllm_importance_sampling_clip_max}"),
        (not cfg.vllm_importance_sampling_mode.endswith("truncate") or not (
            cfg.vllm_importance_sampling_clip_min is None is cfg.vllm_importance_sampling_clip_max),
         f"--vllm_importance_sampling_mode {cfg.vllm_importance_sampling_mode} needs "
         f"--vllm_importance_sampling_clip_min or --vllm_importance_sampling_clip_max"),
        (cfg.vllm_importance_sampling_correction or not is_set,
         f"{' and '.join(is_set)} shape{'s' if len(is_set) == 1 else ''} the sampler-trainer correction, which is "
         f"off: pass --vllm_importance_sampling_correction too, or drop {'them' if len(is_set) > 1 else 'it'}"),
        (not cfg.delta or cfg.delta > 1 + cfg.epsilon_high,
         f"--delta {cfg.delta} must exceed 1 + --epsilon_high ({1 + cfg.epsilon_high}) or be 0 (off)"),
        (not cfg.clip_ratio_c or cfg.clip_ratio_c > 1, f"--clip_ratio_c {cfg.clip_ratio_c} must exceed 1 or be 0 (off)"),
        (cfg.overlong_buffer_len <= cfg.max_new_tokens,
         f"--overlong_buffer_len {cfg.overlong_buffer_len} must be at most --max_new_tokens {cfg.max_new_tokens}"),
        (not (cfg.lora and (cfg.ref_refresh_every or d.torchrun or cfg.save_every or cfg.resume)),
         "--lora runs under `python` (sharded adapters are not merged), without --ref_refresh_every (its reference is "
         "the adapters switched off), --save_every or --resume (its checkpoint holds merged weights)"),
        (not (cfg.compile is True and d.torchrun), "--compile runs under `python`: under torchrun FSDP2's hooks split the decode "
         "step into a graph per layer, and CUDA graphs would be re-recorded every rollout (the gathered weights move)"),
        (not (cfg.teacher and cfg.off_policy_mask_threshold),
         "--off_policy_mask_threshold masks sequences by the sign of their advantage; with --teacher each token has "
         "its own: use one or the other"),
        (cfg.beta or cfg.reference or not (cfg.kl_in_reward or cfg.ref_refresh_every or cfg.eval_pairs),
         "--beta 0 (TRL's default for a model of your own) loads no reference model: --kl_in_reward, "
         "--ref_refresh_every and --eval_pairs need one; pass --beta > 0 (0.04 is GRPO's), or --reference"),
        (d.world_size == 1 or ":" not in cfg.reward_fn or 2 * cfg.reward_fn_timeout <= 60 * cfg.timeout_minutes,
         f"--reward_fn_timeout {cfg.reward_fn_timeout:g} s with --timeout_minutes {cfg.timeout_minutes:g}: a rank whose "
         f"reward function hangs is stopped, naming it and its rank, after --reward_fn_timeout, while the other ranks "
         f"wait for it in a collective for --timeout_minutes, which must be at least twice that (their rollouts end "
         f"at other times), or the job ends in a collective's timeout naming neither; pass --timeout_minutes "
         f"{math.ceil(cfg.reward_fn_timeout / 30):g} or a --reward_fn_timeout of at most {30 * cfg.timeout_minutes:g}"),
        (not (cfg.save_every and cfg.ref_refresh_every and cfg.save_every % cfg.ref_refresh_every),
         f"--save_every {cfg.save_every} must be a multiple of --ref_refresh_every {cfg.ref_refresh_every} "
         f"(a resumed run rebuilds its reference from the checkpoint)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
