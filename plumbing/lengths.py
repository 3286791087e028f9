"""Default lengths fitted to the model: the context a --model has, read from its config before
anything loads (model_shape; whether it is `tiny` or a checkpoint of it too), and the default
prompt and response lengths cut to fit it (fit). cli.fill_defaults uses both."""
import tasks
from plumbing import models


def model_shape(cfg):
    """(context, tiny) of --model, from its config alone: its positions (n_positions or
    max_position_embeddings), and whether it is `tiny` or a checkpoint of it (tasks.TINY_GPT2's
    shape). (None, False) where no config is at hand before the load: a GGUF file, a hub model
    not downloaded yet, a path that is not there (the load names what is wrong)."""
    name = getattr(cfg, "model", "")
    if name == "tiny":
        return tasks.TINY_GPT2["n_positions"], True
    if not name or name.endswith(".gguf") or name in models.PACKAGED_MODELS:
        return None, False
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(models.resolve_checkpoint(name), local_files_only=True,
                                            trust_remote_code=cfg.trust_remote_code).get_text_config()
    except Exception:  # not here, or not a model: the load says which
        return None, False
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    return context, config.model_type == "gpt2" and all(getattr(config, k, None) == v
                                                        for k, v in tasks.TINY_GPT2.items())


def fit(cfg, filled, context):
    """Lengths filled by default (fill_defaults: `filled`) whose prompt + response do not fit the
    model's `context` positions (one fewer with grpo.py's --reward_model, which scores an EOS after
    the completion) are cut to fit, in place: both in the defaults' proportion, or the one filled
    to the room the one given leaves. Returns the banner line ("" where they fit). A length given
    that does not fit is refused at the load (models.check_context)."""
    response = "max_new_tokens" if hasattr(cfg, "max_new_tokens") else "max_response_len"
    p, r = cfg.max_prompt_len, getattr(cfg, response)
    room = (context or 0) - bool(getattr(cfg, "reward_model", ""))
    if context is None or p + r <= room or not {"max_prompt_len", response} & filled.keys():
        return ""
    if {"max_prompt_len", response} <= filled.keys():
        p = room * p // (p + r)
        r = room - p
    elif "max_prompt_len" in filled:
        p = room - r
    else:
        r = room - p
    if min(p, r) < 1:  # the one given leaves no room
        return ""
    line = (f"--max_prompt_len {cfg.max_prompt_len} + --{response} {getattr(cfg, response)} do not fit the "
            f"{context} positions of --model {cfg.model}: --max_prompt_len {p} --{response} {r} instead (pass them to "
            f"choose)")
    cfg.max_prompt_len = p
    setattr(cfg, response, r)
    return line
