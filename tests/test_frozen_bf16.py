"""grpo.py --lora casts its frozen base to bf16 once per rollout and once for the reference and
old-policy passes (environment.frozen_in_bf16), not on every forward. Proven under the CPU's bf16
autocast (torch.autocast("cpu"): the same casts as a GPU's), against the per-forward cast that
autocast does without it: the rollout's ids and log-probs, the reference's, the losses and the
trained weights are the same to the last bit (one rounding of each weight either way); the fp32
masters come back, the adapters and the fp32 head are never cast, nothing is cast where there is
no bf16 autocast, and the copies sit on their weight's device (`meta` here, a GPU there)."""
import contextlib
import importlib.util
import math

import pytest
import torch

import common
import environment
import grpo
import sampling
import shared_prompt
from helpers import checkpoint_weights, family_tokenizer, read_metrics, write_jsonl
from plumbing import models

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")

CPU = common.Dist()
LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=256)  # RoPE, GQA, a gated MLP


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama-shaped model's folder (random weights) with a small BPE tokenizer that adds BOS."""
    import transformers

    tok = family_tokenizer("bos")
    config = transformers.LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **LLAMA)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def bf16_on_cpu(monkeypatch):
    """common.autocast(d) as on a GPU with bf16, on the CPU: torch.autocast("cpu", bfloat16)."""
    monkeypatch.setattr(common, "bf16_supported", lambda device: True)


def lora_model(name):
    """`name` (a folder, or `tiny`: the embedded task's GPT-2, whose linears are Conv1D) as grpo.py
    loads it (models.load_model: the fp32 head), with LoRA adapters that change its output."""
    torch.manual_seed(0)
    model = models.add_lora(models.load_model(name, models.load_tokenizer(name)), r=4, alpha=8.0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)  # LoRA starts as the identity
    return model


def folder_of(family, llama):
    return llama if family == "llama" else "tiny"


@pytest.mark.parametrize("family", ["llama", "tiny"])
def test_only_the_frozen_linears_are_cast_and_the_masters_come_back(family, llama, bf16_on_cpu):
    """Inside the block exactly peft's base layers' weights and biases are bf16, each equal to
    autocast's own cast of its master; every other parameter (the adapters, which train; the
    embeddings, norms and fp32 head) is the same object. A nested block copies nothing. On leaving,
    each parameter is the very object it was, fp32, its values untouched."""
    model = lora_model(folder_of(family, llama))
    before = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in before.items()}
    base = {n for n in before if ".base_layer." in n}  # peft's name for a wrapped layer's own weights
    assert base and all(not before[n].requires_grad for n in base)
    with environment.frozen_in_bf16(model, CPU):
        inside = dict(model.named_parameters())
        assert {n for n, p in inside.items() if p.dtype == torch.bfloat16} == base
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for n in base:
                x = torch.ones(1, inside[n].shape[-1])
                assert torch.equal(inside[n], values[n].to(torch.bfloat16))
                assert inside[n].device == before[n].device and not inside[n].requires_grad
                if inside[n].dim() == 2 and ".lm_head." not in n:  # autocast casts the copy to itself
                    torch.testing.assert_close(torch.nn.functional.linear(x, inside[n]),
                                               torch.nn.functional.linear(x, before[n]), rtol=0, atol=0)
        assert all(inside[n] is before[n] for n in before if n not in base)
        with environment.frozen_in_bf16(model, CPU):
            assert all(p is inside[n] for n, p in model.named_parameters())
        assert all(p is inside[n] for n, p in model.named_parameters())
    after = dict(model.named_parameters())
    assert all(after[n] is before[n] and after[n].dtype == torch.float32 for n in before)
    assert all(torch.equal(after[n], values[n]) for n in before)


def test_nothing_is_cast_without_bf16_autocast(llama, monkeypatch):
    """On the CPU (common.autocast: no autocast), with enabled=False, and for a model with nothing
    frozen (full fine-tuning: autocast caches those casts itself), every parameter stays as it is."""
    model = lora_model(llama)
    before = dict(model.named_parameters())
    with environment.frozen_in_bf16(model, CPU):
        assert all(p is before[n] for n, p in model.named_parameters())
    monkeypatch.setattr(common, "bf16_supported", lambda device: True)
    with environment.frozen_in_bf16(model, CPU, enabled=False):
        assert all(p is before[n] for n, p in model.named_parameters())
    full = models.load_model(llama, models.load_tokenizer(llama))
    params = dict(full.named_parameters())
    with environment.frozen_in_bf16(full, CPU):
        assert all(p is params[n] for n, p in full.named_parameters())


def test_the_copies_are_made_on_their_weights_device(monkeypatch):
    """On `meta` (which refuses a tensor of another device beside its own, as CUDA does, and any read
    back to the host): each copy is made where its weight is, and the masters come back there."""
    import transformers

    with torch.device("meta"):
        model = models.add_lora(transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
            vocab_size=64, **LLAMA)), r=4, alpha=8.0)
    meta = common.Dist(device=torch.device("meta"))
    # meta has no autocast of its own: the CPU's stands in for it, as tests/memory_trace.py does for a GPU's
    monkeypatch.setattr(common, "autocast", lambda d, enabled=True: torch.autocast("cpu", dtype=torch.bfloat16))
    before = dict(model.named_parameters())
    with environment.frozen_in_bf16(model, meta):
        cast = [p for p in model.parameters() if p.dtype == torch.bfloat16]
        assert cast and all(p.device.type == "meta" for p in model.parameters())
    assert all(p is before[n] for n, p in model.named_parameters())


@pytest.mark.parametrize("family", ["llama", "tiny"])
def test_the_rollout_and_the_reference_equal_the_per_forward_cast(family, llama, bf16_on_cpu):
    """sampling.generate's ids, masks and log-probs (the behaviour policy's, per token) and the
    reference's log-probs (the adapters off, in micro-batches), with the base cast once, equal
    autocast's per-forward casts exactly; and bf16 is really on (fp32 gives other log-probs)."""
    model = lora_model(folder_of(family, llama))
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 5, 2, 4, 5])
    p_ids = torch.randint(3, V, (6, 5), generator=g)
    p_mask = (torch.arange(5) >= 5 - lengths[:, None]).long()  # left-padded
    p_ids = p_ids * p_mask
    u = torch.rand(6, 12, generator=g, dtype=torch.float64)

    def rollout_and_reference(cast_once, autocast=True):
        with common.evaluating(model), common.autocast(CPU, enabled=autocast), \
                (environment.frozen_in_bf16(model, CPU) if cast_once else contextlib.nullcontext()):
            ids, mask, logps = sampling.generate(model, p_ids, p_mask, 12, eos_id=0, pad_id=0, uniforms=u,
                                                 return_logprobs=True)
            with environment.reference_context(model, model):  # ref is model: LoRA's adapters off
                ids_, attn = torch.cat([p_ids, ids], 1), torch.cat([p_mask, mask], 1)
                plan = shared_prompt.plan(torch.arange(6)[None], ids_, attn, ids.shape[1], 4, CPU, models=[model])
                ref = shared_prompt.planned_logprobs(model, ids_, attn, ids.shape[1], plan, CPU)
        return ids, mask, logps, ref

    per_forward, once = rollout_and_reference(False), rollout_and_reference(True)
    for a, b in zip(per_forward, once):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fp32 = rollout_and_reference(False, autocast=False)
    assert fp32[0].shape != once[0].shape or (fp32[2] - once[2]).abs().max() > 1e-4


def grpo_config(llama, tmp_path, out):
    """Two steps of grpo.py --lora with every pass the base cast once touches: the rollout, the
    reference and old-policy passes (2 mini-batches), the update, and evaluation before the first
    step and after the last (--eval_dataset greedy and sampled as the rollouts are; held-out
    prompts greedy, as an embedded task's: with_held_out)."""
    rows = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"What is {i} + 7?", "reward_fn": "digits"}
                                                    for i in range(8)])
    return grpo.Config(model=llama, dataset=rows, eval_dataset=rows, n_eval=4, prompts_per_step=2, group_size=4,
                       max_prompt_len=48, lora=True, lora_r=4, steps=2, max_new_tokens=8, beta=0.04, num_iterations=1,
                       num_mini_batches=2, lr=1e-2, entropy_coef=0.01, warmup_steps=0, eval_every=100,
                       out_dir=str(tmp_path / out))


def with_held_out(grpo_evals):
    """environment.grpo_evals, its --eval_dataset prompts also as held-out prompts (an embedded
    task's: greedy answers scored by their rule, sampling.evaluate_generations)."""
    def evals(*args, **kwargs):
        out = grpo_evals(*args, **kwargs)
        rows = out["prompts"]["rows"]
        out["held_out"] = {"prompt": rows["prompt"], "reward_fn": rows["reward_fn"], "own_prompt": out["prompts"]["own"]}
        return out
    return evals


def test_grpo_lora_steps_are_the_per_forward_casts_to_the_bit(llama, tmp_path, monkeypatch, bf16_on_cpu):
    """grpo.py --lora under bf16 autocast, two steps, cast once and cast per forward: the same
    rollouts (ids, log-probs), reference and old log-probs, metrics (loss, grad_norm, KL, the
    sampler-trainer gap, evaluation) and trained weights, bit for bit; and the cast-once run did
    cast (its blocks found bf16 weights), around every rollout, log-prob pass and greedy evaluation
    and around no backward (the update casts as autocast does). Without bf16 autocast (the CPU's default) no
    block casts."""
    real = environment.frozen_in_bf16

    def run(out, blocks, cast_once=True):
        """grpo.main, recording each block's bf16 parameters, each rollout and log-prob pass (and
        whether a block was open around it), and whether one was open at each backward."""
        rollouts, passes, open_at, backward_open, greedy_open = [], [], [0], [], []
        rollout, planned, backward = environment.rollout, shared_prompt.planned_logprobs, common.backward
        greedy = sampling.evaluate_generations

        @contextlib.contextmanager
        def recording(model, d, enabled=True):
            with real(model, d, enabled=enabled) if cast_once else contextlib.nullcontext():
                blocks.append(sum(p.dtype == torch.bfloat16 for p in model.parameters()))
                open_at[0] += 1
                try:
                    yield
                finally:
                    open_at[0] -= 1

        def record_rollout(*args, **kwargs):
            n = len(blocks)
            roll = rollout(*args, **kwargs)
            rollouts.append((roll.r_ids.clone(), roll.r_mask.clone(), roll.r_logps.clone(), len(blocks) > n))
            return roll

        def record_pass(*args, **kwargs):  # the reference's and the old policy's passes
            out = planned(*args, **kwargs)
            passes.append((*(out if isinstance(out, tuple) else (out,)), open_at[0] > 0))
            return out

        def record_backward(*args, **kwargs):
            backward_open.append(open_at[0] > 0)
            return backward(*args, **kwargs)

        def record_greedy(*args, **kwargs):
            greedy_open.append(open_at[0] > 0)
            return greedy(*args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(environment, "frozen_in_bf16", recording)
            m.setattr(environment, "rollout", record_rollout)
            m.setattr(shared_prompt, "planned_logprobs", record_pass)
            m.setattr(common, "backward", record_backward)
            m.setattr(sampling, "evaluate_generations", record_greedy)
            m.setattr(environment, "grpo_evals", with_held_out(environment.grpo_evals))
            cfg = grpo_config(llama, tmp_path, out)
            grpo.main(cfg)
        assert all(r[-1] for r in rollouts + passes) and greedy_open and all(greedy_open)
        assert backward_open and not any(backward_open)
        rows = [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "mem/"))}  # the clock's
                for r in read_metrics(cfg.out_dir)]
        return rollouts, passes, rows, checkpoint_weights(cfg.out_dir)

    once_blocks, per_forward_blocks = [], []
    once = run("once", once_blocks)
    per_forward = run("per_forward", per_forward_blocks, cast_once=False)
    assert once_blocks and min(once_blocks) > 0 and not any(per_forward_blocks)
    assert len(once[0]) == 2 and len(once[1]) >= 4  # two rollouts; the reference and old passes of each step
    for a, b in zip(once[0] + once[1], per_forward[0] + per_forward[1], strict=True):
        for x, y in zip(a[:-1], b[:-1], strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert once[2] == per_forward[2] and any("loss" in r for r in once[2])
    assert all("eval/exact_match" in r and "eval/reward" in r for r in once[2] if r["step"] in (0, 2))
    assert all(math.isfinite(r["loss"]) for r in once[2] if "loss" in r)
    assert once[3].keys() == per_forward[3].keys()
    assert all(torch.equal(once[3][k], per_forward[3][k]) for k in once[3])
    monkeypatch.setattr(common, "bf16_supported", lambda device: False)
    fp32_blocks = []
    run("fp32", fp32_blocks)
    assert fp32_blocks and not any(fp32_blocks)
