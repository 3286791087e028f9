"""LoRA (--lora, TRL's --use_peft) in every script: adapters on a frozen model (peft), merged into
the export (models.merged_state: peft's merge on the gathered state, so it works under FSDP2 too),
checked against peft's own merge; the dropout of the adapters only where gradients flow; dpo.py's
reference the same network with its adapters off, precomputed or live; reward.py's score head
trained whole; resume; 2 processes (FSDP2) against 1; a TRL user's SFT and DPO command lines.
The runs train the Llama-, Qwen2- and reward-shaped folders of helpers.build_user_models."""
import copy
import math
import os

import pytest
import torch

import common
import sft
from helpers import (TWO_RANK_RUNS, U32, U64, adam_drift, assert_runs_agree, chat_rows, checkpoint_config,
                     checkpoint_weights, ctrl_c_after_first_save, forward_lengths, fp32_rtol, gamma, max_abs_diff,
                     read_metrics, run_here, write_jsonl)
import lm_head
import tasks
from plumbing import checkpoints, cli, models

pytest.importorskip("peft")


def run_ok(argv):
    """A script in this process (helpers.run_here); its out_dir's metrics rows."""
    proc = run_here(argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    flag = "--out_dir" if "--out_dir" in argv else "--output_dir"  # TRL's name
    return read_metrics(argv[argv.index(flag) + 1])


def weights(folder):
    """The tensors of a checkpoint folder (or a model folder), by name."""
    return checkpoint_weights(folder, name="")


def perturbed(model, seed=0):
    """A LoRA model whose B matrices are random (LoRA starts as the identity), so that merging counts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


# -----------------------------------------------------------------------------
# the export: peft's merge, on the state dict


@pytest.mark.parametrize("name", ["llama", "tiny", "llama_rm"])
def test_the_merged_state_is_peft_merge_and_unload(name, user_models):
    """models.merged_state (what every export writes: the LoRA model's gathered state, merged on rank
    0) against peft's own merge_and_unload, on a Llama (q/k/v/o, gate/up/down), GPT-2 (Conv1D, whose
    weight is (in, out): the delta transposed) and a Llama reward model (its score head trained whole,
    modules_to_save): the same names as the model before LoRA, the same tensors, and a model built
    from them computes what the LoRA model computes."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    path = "tiny" if name == "tiny" else user_models[name]
    tok = models.load_tokenizer(path)
    kind = "reward" if name == "llama_rm" else "causal"
    base = models.load_model(path, tok, kind=kind)
    lora = perturbed(models.add_lora(copy.deepcopy(base), r=4, alpha=8.0))
    if kind == "reward":  # the score head trains whole: move it too
        with torch.no_grad():
            lora.base_model.model.score.modules_to_save["default"].weight.add_(0.5)
    merged = models.merged_state(lora, lora.state_dict())
    peft_merged = copy.deepcopy(lora).merge_and_unload().state_dict()
    assert merged.keys() == peft_merged.keys() == base.state_dict().keys()
    adapters = {name.removeprefix("base_model.model.") + ".weight": m for name, m in lora.named_modules()
                if hasattr(m, "lora_A") and "default" in m.lora_A}
    for k in merged:  # W + s B A: ours in float64 rounded once, peft's in float32 (an r-term sum, a scale, an add)
        size = merged[k].abs()
        if k in adapters:
            m = adapters[k]
            terms = m.scaling["default"] * m.lora_B["default"].weight.abs() @ m.lora_A["default"].weight.abs()
            size = size + base.state_dict()[k].abs() + (terms.T if m.fan_in_fan_out else terms)
        assert ((merged[k] - peft_merged[k]).abs() <= gamma(4 + 3) * size).all(), k
    changed = [k for k in merged if not torch.equal(merged[k], base.state_dict()[k])]
    assert changed and all("norm" not in k and "embed" not in k and "wte" not in k for k in changed), changed
    auto = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    plain = auto.from_config(base.config)
    plain.load_state_dict(merged)
    ids = torch.arange(1, 9)[None] % base.config.vocab_size
    with torch.no_grad():
        want = lora(input_ids=ids).logits
        # merged weights against adapters beside them: float32's rounding of the two, of the logits' size
        tol = fp32_rtol(forward_lengths(base.config, 8) + [4] * 7 * base.config.num_hidden_layers) * want.abs().max()
        torch.testing.assert_close(plain(input_ids=ids).logits, want, rtol=0, atol=tol.item())


def test_the_scale_is_alpha_over_r_in_the_model_a_script_builds_and_in_a_checkpoints_export(tmp_path, user_models):
    """--lora_r 4 --lora_alpha 16 (scale 4; the defaults' is 2): every adapted layer of the model a
    script builds (models.with_lora on the parsed flags) computes W x + 4 B A x, checked by hand;
    and a resumable checkpoint (--save_every's, the adapters beside the frozen base) exports
    (`python -m plumbing export`) each adapted weight as W + 4 B A. The bounds are float32's
    rounding of those sums (helpers.gamma). Planted and failing here: --lora_alpha never reaching
    peft (add_lora: the scale 1 whatever the flag), and the export merging at scale 1
    (checkpoints.export); test_the_merged_state_is_peft_merge_and_unload passed on both (peft's
    merge reads the scale peft was given)."""
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file

    cfg = cli.parse_config(sft.Config, ["--lora", "--lora_r", "4", "--lora_alpha", "16"])
    tok = models.load_tokenizer(user_models["llama"])
    model = perturbed(models.with_lora(models.load_model(user_models["llama"], tok), cfg))
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 blocks

    def parts(m):  # (out, in), (r, in), (out, r) in float64
        return [p.double() for p in (m.base_layer.weight, m.lora_A["default"].weight, m.lora_B["default"].weight)]

    gen = torch.Generator().manual_seed(1)
    for name, m in layers.items():
        w, a, b = parts(m)
        x = torch.randn(5, w.shape[1], generator=gen)
        with torch.no_grad():
            got = m(x).double()
        want = x.double() @ w.T + 4 * (x.double() @ a.T) @ b.T
        # float32: each output the sum of a dot product of `in` terms and one of r terms (after one of `in`)
        bound = gamma(w.shape[1] + 4 + 2) * (x.double().abs() @ w.abs().T + 4 * (x.double().abs() @ a.abs().T) @ b.abs().T)
        assert ((got - want).abs() <= bound).all(), (name, (got - want).abs().max(), bound.max())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    checkpoints.save_checkpoint(model, tok, str(tmp_path), common.Dist(), optimizer=optimizer, step=1, config=cfg)
    exported = load_file(os.path.join(checkpoints.export(str(tmp_path), str(tmp_path / "export")), "model.safetensors"))
    for name, m in layers.items():
        w, a, b = parts(m)
        want = w + 4 * b @ a
        # float64's r-term products, then one rounding to float32 (half an ulp: U32 of the value)
        bound = gamma(4 + 1, U64) * (w.abs() + 4 * b.abs() @ a.abs()) + U32 * want.abs()
        got = exported[name.removeprefix("base_model.model.") + ".weight"].double()
        assert ((got - want).abs() <= bound).all(), (name, (got - want).abs().max())


def final_model(argv):
    """Run a script in this process (run_ok) and return the model its final save exported (the LoRA
    model as trained: checkpoints.save_checkpoint's model at the save without an optimizer) and the
    run's folder."""
    seen, save = [], checkpoints.save_checkpoint

    def saving(model, *args, **kwargs):
        if kwargs.get("optimizer") is None:
            seen.append(model)
        return save(model, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(checkpoints, "save_checkpoint", saving)
        proc = run_here(argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return seen[-1], argv[argv.index("--out_dir") + 1]


def nll64(model, ids):
    """The mean next-token NLL of ids under a float64 copy of model (its fp32 head, lm_head.FP32Head,
    a plain linear layer again, so that nothing is computed in fp32)."""
    model = copy.deepcopy(model).double()
    for m in model.modules():
        if type(m) is lm_head.FP32Head:
            m.__class__ = torch.nn.Linear
    logits = model(input_ids=ids).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


LORA_KINDS = {  # kind -> (model, targets): every kind of adapter peft puts on an LM's layers, and the tied weights
    "linear": ("llama", "all-linear"),  # q/k/v/o, gate/up/down
    "conv1d": ("tiny", "all-linear"),  # GPT-2's Conv1D (c_attn, c_proj, c_fc), weights (in, out)
    "embedding": ("llama", "embed_tokens"),  # lora_embedding_A/B
    "tied_embedding": ("tiny", "wte"),  # GPT-2's wte is its head too: the adapter changes the embedding's use alone
    "tied_head": ("tiny", "lm_head"),  # ... or the head's alone
    "tied_head_grpo": ("tiny", "lm_head"),  # grpo.py's export, the same path (before: peft's merge_and_unload)
}


@pytest.mark.parametrize("kind", LORA_KINDS)
def test_the_export_loads_as_the_trained_run(kind, tmp_path, user_models):
    """sft.py --lora (3 steps at a large lr) with each kind of adapter: the export, loaded with
    AutoModelForCausalLM.from_pretrained (no peft), computes the loss of the LoRA model the run
    ended with. Both in float64, they are one function but for the export's rounding of each
    merged weight theta to fp32 (|d theta| <= 2^-24 |theta|): to first order the losses differ by
    at most 2^-24 sum |dL/dtheta| |theta| (over every weight: those not merged are the same floats
    and add nothing), doubled for the second order (2^-48), plus 1e-12 for float64's own rounding
    (2^-53 ~ 1.1e-16 a step over a few hundred terms). And the run moved the loss by more than
    1000x that bound from the model it started from, which a lost adapter would export (before:
    wte's adapter was exported unmerged beside the weight, loading as step 0; a tied lm_head's
    final save failed with a KeyError). A tied weight is exported untied, the use without an
    adapter keeping its start."""
    from transformers import AutoModelForCausalLM

    name, targets = LORA_KINDS[kind]
    if kind.endswith("grpo"):
        argv = ["grpo.py", "--model", "tiny", "--lora", "--lora_target_modules", targets, "--steps", "2", "--n_train",
                "64", "--prompts_per_step", "4", "--group_size", "4", "--max_new_tokens", "8", "--n_eval", "8",
                "--n_eval_pairs", "8", "--eval_every", "1000", "--lr", "5e-2", "--warmup_steps", "0", "--entropy_coef",
                "0.01", "--out_dir", str(tmp_path / "run")]
    elif name == "tiny":  # the command, on fewer rows
        argv = ["sft.py", "--model", "tiny", "--lora", "--lora_target_modules", targets, "--steps", "3", "--n_train",
                "256", "--batch_size", "8", "--n_eval", "16", "--eval_every", "1000", "--warmup_steps", "0", "--lr",
                "5e-2", "--out_dir", str(tmp_path / "run")]
    else:
        argv = lora_argv("sft", tmp_path, user_models, "--lora_target_modules", targets, "--lr", "5e-2")
    trained, out = final_model(argv)
    export = AutoModelForCausalLM.from_pretrained(f"{out}/checkpoint")
    if name == "tiny":  # rows of what the run trained on, cut to the shortest
        tok, texts = tasks.char_tokenizer(), [r["prompt"] + r["completion"] for r in tasks.sft_rows(4, seed=1)]
    else:
        tok = models.load_tokenizer(user_models[name])
        texts = [tok.apply_chat_template(r["messages"], tokenize=False) for r in chat_rows(4, "sft")]
    rows = [tok(t, add_special_tokens=False).input_ids for t in texts]
    ids = torch.tensor([r[:min(map(len, rows))] for r in rows])  # (4, T)
    want, got = nll64(trained, ids).item(), nll64(export, ids)
    export64 = copy.deepcopy(export).double()
    loss = torch.nn.functional.cross_entropy(export64(input_ids=ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    grads = torch.autograd.grad(loss, list(export64.parameters()))
    bound = 2 * 2.0 ** -24 * sum((g * p).abs().sum() for g, p in zip(grads, export64.parameters())).item() + 1e-12
    assert abs(got.item() - want) <= bound, (kind, got.item(), want, bound)
    start = copy.deepcopy(trained).unload()  # the frozen model the run started from: its adapters taken off
    assert abs(nll64(start, ids).item() - want) > 1000 * bound, (kind, "the run did not move the loss")
    tied = kind.startswith("tied")
    assert export.config.tie_word_embeddings is (start.config.tie_word_embeddings and not tied)
    if tied:  # the layer without the adapter: the weight as it started, exactly
        other = export.get_output_embeddings() if targets == "wte" else export.get_input_embeddings()
        assert torch.equal(other.weight, start.get_input_embeddings().weight)


def test_an_adapter_the_export_cannot_merge_is_refused_before_training():
    """A target peft puts another kind of adapter on (a Conv2d here; peft also has Conv1d/3d and
    MultiheadAttention adapters) is refused when the adapters are added, naming the layer and why:
    merged_state merges linear layers, GPT-2's Conv1D and embeddings, and an adapter it left out
    would be training lost at the export."""
    net = torch.nn.Sequential()
    net.add_module("conv", torch.nn.Conv2d(2, 2, 3))
    net.add_module("proj", torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"--lora_target_modules conv,proj: conv is a Conv2d, whose adapter the "
                                         r"export cannot merge"):
        models.add_lora(net, 2, 4.0, target_modules="conv,proj")
    models.add_lora(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2, 4.0, target_modules="0")  # a linear one is not


def test_a_model_without_adapters_exports_its_state_as_it_is(user_models):
    tok = models.load_tokenizer(user_models["llama"])
    model = models.load_model(user_models["llama"], tok)
    state = model.state_dict()
    assert models.merged_state(model, state) is state


def test_lora_dropout_drops_in_gradient_passes_only(user_models):
    """--lora_dropout: the models run in eval mode (dropout off), so peft's nn.Dropout would never
    drop; models.TrainDropout drops where gradients flow (the update) and never in a pass without
    them (reference, old log-probs, sampling, evaluation), in either mode. The model is the one a
    script builds from its flags (models.with_lora): --lora_dropout ignored there fails here."""
    tok = models.load_tokenizer(user_models["llama"])
    cfg = cli.parse_config(sft.Config, ["--lora", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.5"])
    model = perturbed(models.with_lora(models.load_model(user_models["llama"], tok), cfg))
    ids = torch.arange(1, 17)[None]
    for mode in (model.eval, model.train):
        mode()
        with torch.no_grad():
            a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
        assert torch.equal(a, b)
        c = model(input_ids=ids).logits.detach()
        assert (c - a).abs().max() > 1e-3  # dropped: another network than the no-grad pass's
    with torch.no_grad():  # 0: the same network as the no-grad pass
        model.eval()
        a = model(input_ids=ids).logits
    for m in model.modules():
        if isinstance(m, models.TrainDropout):
            m.p = 0.0
    torch.testing.assert_close(model(input_ids=ids).logits.detach(), a, rtol=0, atol=0)


def test_unknown_target_modules_are_named(user_models):
    tok = models.load_tokenizer(user_models["llama"])
    with pytest.raises(ValueError, match="--lora_target_modules q_prj"):
        models.add_lora(models.load_model(user_models["llama"], tok), 4, 8.0, target_modules="q_prj")


# -----------------------------------------------------------------------------
# the scripts on folders of real architectures


LORA_RUNS = {"sft": ("messages.jsonl", "sft", "llama", ()), "dpo": ("pairs.jsonl", "preference", "qwen2", ()),
             "reward": ("pairs.jsonl", "preference", "llama", ("--n_normalize", "8"))}


def lora_argv(script, folder, user_models, *extra):
    """SCRIPT with --lora r 4 on 32 chat rows of its kind, a folder model (sft, reward: Llama; dpo: Qwen2)."""
    name, kind, model, own = LORA_RUNS[script]
    rows = write_jsonl(folder / name, chat_rows(32, kind))
    return [f"{script}.py", "--model", user_models[model], "--dataset", rows, "--eval_dataset", rows, "--steps", "3",
            "--batch_size", "8", "--lr", "1e-2", "--warmup_steps", "0", "--max_prompt_len", "128",
            "--max_response_len", "16", "--n_eval", "8", "--eval_every", "3", *own, "--lora", "--lora_r", "4",
            "--out_dir", str(folder / "run"), *extra]


TWO_RANKS = {"sft_lora": lambda folder, models: lora_argv("sft", folder, models, "--lr", "1e-3"),
             "dpo_lora_live": lambda folder, models: lora_argv("dpo", folder, models, "--no-precompute_ref",
                                                               "--lr", "1e-3"),
             "reward_lora": lambda folder, models: lora_argv("reward", folder, models, "--lr", "1e-3")}
TWO_RANK_RUNS.update(TWO_RANKS)


def adapted(name, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
    return name.endswith(".weight") and any(f".{t}." in name for t in lora_targets)


def test_sft_lora_exports_the_merged_model_and_trains_only_the_adapted_layers(tmp_path, user_models):
    """sft.py --lora on the Llama folder: the export is a plain Llama checkpoint (the folder's names,
    no adapter: AutoModelForCausalLM loads it without peft); every linear layer of the blocks moved,
    and nothing else did (embeddings, norms and the head frozen)."""
    from transformers import AutoModelForCausalLM

    rows = run_ok(lora_argv("sft", tmp_path, user_models))
    assert rows[-1]["loss"] < rows[1]["loss"]
    after, before = weights(tmp_path / "run" / "checkpoint"), weights(user_models["llama"])
    assert after.keys() == before.keys()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved == {k for k in after if adapted(k)}, sorted(moved ^ {k for k in after if adapted(k)})
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint")


def test_dpo_lora_reference_is_the_network_with_its_adapters_off(tmp_path, user_models):
    """dpo.py --lora (no --ref_model): the reference is the policy with its adapters off. Precomputed
    at the start (adapters still the identity) and live at every step (adapters trained, switched
    off), the losses agree step for step, and the first is ln 2 (the policy is its reference): a
    live reference with its adapters on would be the policy itself, loss ln 2 at every step."""
    (tmp_path / "pre").mkdir(), (tmp_path / "live").mkdir()
    pre = run_ok(lora_argv("dpo", tmp_path / "pre", user_models))
    live = run_ok(lora_argv("dpo", tmp_path / "live", user_models, "--no-precompute_ref"))
    config, logps = checkpoint_config(tmp_path / "pre" / "run"), abs(pre[1]["logps/chosen"]) + abs(pre[1]["logps/rejected"])
    ln2 = fp32_rtol(forward_lengths(config, 128 + 16)) * logps  # h: the policy's log-probs less the reference's
    assert pre[1]["loss"] == pytest.approx(math.log(2), abs=ln2) and live[1]["loss"] == pytest.approx(math.log(2), abs=ln2)
    for run in (pre, live):  # the adapters moved the policy from its reference, switched off in the live one
        assert abs(run[-1]["loss"] - math.log(2)) > 100 * ln2
    assert_runs_agree(pre, live, config, length=128 + 16, lr=1e-2, keys=("loss", "rewards/margins", "eval/margin"),
                      norm_terms=0, scales={k: ["logps/chosen", "logps/rejected"] for k in ("loss", "rewards/margins")}
                      | {"eval/margin": [logps]})


def test_reward_lora_trains_the_score_head_whole(tmp_path, user_models):
    """reward.py --lora --lora_target_modules q_proj,v_proj: the new score head trains whole beside
    the adapters (peft's SEQ_CLS task, modules_to_save, as TRL's reward trainer); without that task
    the head is frozen and a reward model's scores stay a random projection of what the adapters
    learn. The export loads as a sequence classifier without peft; its head moved from the one a run
    at lr 0 exports (the same seed, the same random head), its embeddings did not."""
    from transformers import AutoModelForSequenceClassification

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    targets = ["--lora_target_modules", "q_proj,v_proj"]
    run_ok(lora_argv("reward", tmp_path / "a", user_models, *targets))
    run_ok(lora_argv("reward", tmp_path / "b", user_models, *targets, "--lr", "0"))
    trained, start = weights(tmp_path / "a" / "run" / "checkpoint"), weights(tmp_path / "b" / "run" / "checkpoint")
    assert trained.keys() == start.keys() and not any("lora" in k or "original_module" in k for k in trained)
    assert (trained["score.weight"] - start["score.weight"]).abs().max() > 1e-3
    assert torch.equal(trained["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    AutoModelForSequenceClassification.from_pretrained(tmp_path / "a" / "run" / "checkpoint")


@pytest.mark.parametrize("name, keys", [
    ("sft_lora", ("loss", "grad_norm", "eval/loss")),
    ("dpo_lora_live", ("loss", "rewards/margins", "grad_norm")),
    ("reward_lora", ("loss", "grad_norm")),
])
def test_two_processes_match_one_with_lora(name, keys, tmp_path, user_models, two_ranks):
    """FSDP2 over 2 processes, each block's frozen base and adapters sharded together, rank 0 reading
    the folder and its adapters' initial values broadcast: the same losses, metrics and merged
    export as 1 process (the export merges the gathered state on rank 0: models.merged_state)."""
    one = run_ok(TWO_RANKS[name](tmp_path, user_models))
    two = read_metrics(two_ranks(name) / "run")
    config = checkpoint_config(tmp_path / "run")
    logps = ["logps/chosen", "logps/rejected"]
    assert_runs_agree(one, two, config, length=128 + 16, lr=1e-3, keys=keys,
                      scales={"loss": logps, "rewards/margins": logps} if name.startswith("dpo") else {})
    # the merged export W + s B A: A, B (and the score head) each within adam_drift D, A within
    # 1/sqrt(fan_in) + D of 0 (peft's kaiming start) and B within D (from 0), so s B A within
    # s r D (1/sqrt(fan_in) + 2 D); s = 32 / 4 (--lora_alpha's default over r)
    drift = adam_drift(1e-3, 3)
    bound = 32 / 4 * 4 * drift * (config.hidden_size ** -0.5 + 2 * drift) + drift
    assert max_abs_diff(weights(tmp_path / "run" / "checkpoint"), weights(two_ranks(name) / "run" / "checkpoint")) <= bound


def test_lora_resumes_and_its_checkpoint_exports_merged(tmp_path, user_models):
    """sft.py --lora --save_every 2, stopped by a Ctrl-C right after the step-2 checkpoint, resumed:
    the final export is the uninterrupted run's (adapters and their Adam moments restored, the base
    untouched); the step-2 checkpoint exports (`python -m plumbing export`) as a plain Llama,
    adapters merged."""
    from transformers import AutoModelForCausalLM

    for run in ("full", "resumed"):
        (tmp_path / run).mkdir()
    args = ["--steps", "4", "--save_every", "2"]
    run_ok(lora_argv("sft", tmp_path / "full", user_models, *args))
    with ctrl_c_after_first_save():
        killed = run_here(lora_argv("sft", tmp_path / "resumed", user_models, *args))
    assert killed.returncode == 130, killed.stderr[-2000:]
    export = checkpoints.export(tmp_path / "resumed" / "run", str(tmp_path / "step2"))
    step2 = weights(export)
    assert step2.keys() == weights(user_models["llama"]).keys()
    assert max_abs_diff(step2, weights(user_models["llama"])) > 1e-4  # two steps of adapters, merged
    AutoModelForCausalLM.from_pretrained(export)
    run_ok(lora_argv("sft", tmp_path / "resumed", user_models, *args, "--resume"))
    # exact: the resumed run repeats the uninterrupted one's float operations in their order
    assert max_abs_diff(weights(tmp_path / "full" / "run" / "checkpoint"),
                        weights(tmp_path / "resumed" / "run" / "checkpoint")) == 0
    a, b = read_metrics(tmp_path / "full" / "run"), read_metrics(tmp_path / "resumed" / "run")
    assert [r["loss"] for r in a if "loss" in r] == [r["loss"] for r in b if "loss" in r]


# -----------------------------------------------------------------------------
# a TRL user's command lines


def test_trl_sft_and_dpo_command_lines_with_use_peft_export_merged_models(tmp_path, user_models):
    """`sft.py` and `dpo.py` as a TRL user writes them (TRL's names: --model_name_or_path,
    --dataset_name, --use_peft, --lora_r, --lora_alpha, --lora_dropout, --lora_target_modules as a
    list, --learning_rate, --max_steps, --output_dir): they run, and each exports a merged model
    that AutoModelForCausalLM loads, in which only the named projections moved."""
    from transformers import AutoModelForCausalLM

    sft_rows = write_jsonl(tmp_path / "messages.jsonl", chat_rows(32, "sft"))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", chat_rows(32, "preference"))
    peft_flags = ["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.05",
                  "--lora_target_modules", "q_proj", "v_proj"]
    common = ["--learning_rate", "1e-2", "--max_steps", "2", "--max_prompt_length", "128", "--eval_steps", "2",
              "--warmup_steps", "0"]
    sft_out, dpo_out = tmp_path / "sft", tmp_path / "dpo"
    run_ok(["sft.py", "--model_name_or_path", user_models["llama"], "--dataset_name", sft_rows, *peft_flags, *common,
            "--batch_size", "8", "--output_dir", str(sft_out)])
    run_ok(["dpo.py", "--model_name_or_path", str(sft_out), "--dataset_name", pairs, *peft_flags, *common,
            "--batch_size", "8", "--output_dir", str(dpo_out)])
    for folder, start in ((sft_out, user_models["llama"]), (dpo_out, sft_out / "checkpoint")):
        after, before = weights(folder / "checkpoint"), weights(start)
        assert after.keys() == before.keys()
        moved = {k for k in after if not torch.equal(after[k], before[k])}
        assert moved == {k for k in after if adapted(k, ("q_proj", "v_proj"))}, sorted(moved)
        AutoModelForCausalLM.from_pretrained(folder / "checkpoint")


def test_lora_prints_no_deprecation_warning_of_transformers():
    """Every --lora run printed transformers' FutureWarning "`is_gradient_checkpointing` is
    deprecated" once per rank: peft 0.21's PeftModel reads that property. add_lora drops that one
    warning where peft raises it (no filter outside that call), and nothing else warns there."""
    import warnings

    tok = models.load_tokenizer("tiny")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # the suite's pyproject ignores FutureWarning: see it here
        models.add_lora(models.load_model("tiny", tok), r=4, alpha=8.0)
    assert [str(w.message) for w in seen] == []
    with warnings.catch_warnings(record=True) as seen:  # the filter stays inside add_lora
        warnings.simplefilter("always")
        assert models.load_model("tiny", tok).is_gradient_checkpointing is False
    assert any("is_gradient_checkpointing" in str(w.message) for w in seen)
