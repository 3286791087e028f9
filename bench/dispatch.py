"""What a step dispatches, counted on the CPU: aten ops and host syncs per decode step (ours against
transformers' model.generate) and per DPO and GRPO training step (the scripts' own step against a
plain transformers padded forward and backward of the same batch, what TRL 1.16 runs). On a GPU a
small model's step is dispatch-bound (~10-15 us an op on an H200, docs/gpu.md), so the counts are
what a GPU pays for, and they are deterministic: tests/test_dispatch.py bounds them, so that what a
GPU shows cannot regress unseen between GPU loans. Counts, never times.

    python -m bench dispatch                    # a decode step, SmolLM2's shape (30 layers, widths cut: counts do not depend on them)
    python -m bench dispatch --training         # and a DPO and a GRPO step (tests/test_dispatch.py's setups)
    python -m bench dispatch --layers 2 --diff  # a short model, and each op whose count differs per decode step

Per step: the count over a run of `more` extra steps minus the count over the shorter run, over
`more` (what is done once a call, the prefill, a run's setup and its evaluations, cancels). Host
syncs: aten._local_scalar_dense (.item(), bool()), Tensor.tolist and .numpy, nonzero, masked_select,
unique and indexing with a boolean mask, each of which makes a GPU's host wait for its queue to drain.
"""
import collections
import contextlib
import copy
import os
import sys
import tempfile
from unittest import mock

import torch
import torch._inductor.config
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lm_head  # noqa: E402
import data  # noqa: E402
import dpo  # noqa: E402
import environment  # noqa: E402
import grpo  # noqa: E402
import sampling  # noqa: E402
import tasks  # noqa: E402
from bench import harness  # noqa: E402

SYNCS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
         "aten._unique2.default", "aten.unique_dim.default", "aten.unique_consecutive.default",
         "aten.repeat_interleave.Tensor"}
# SmolLM2-135M's architecture (Llama: 30 layers, 9 heads over 3 KV heads, SwiGLU, tied head) with every width cut:
# the ops a step dispatches depend on the layers and the code path, not on the widths
SMOLLM2_OPS = dict(hidden_size=72, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9,
                   num_key_value_heads=3, head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-5,
                   rope_theta=100000.0, tie_word_embeddings=True)


class Dispatched(TorchDispatchMode):
    """Counts the aten ops dispatched inside it by name (`ops`) and the host syncs among them
    (`syncs`); nothing is counted inside `paused()`."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs, self.counting = collections.Counter(), collections.Counter(), True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            name = str(func)
            self.ops[name] += 1
            boolean_index = func is torch.ops.aten.index.Tensor and any(
                t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1])
            if name in SYNCS or boolean_index:
                self.syncs[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):  # a CPU tensor's .tolist() and .numpy() read it without an aten op: counted here
        self._saved = torch.Tensor.tolist, torch.Tensor.numpy
        for method, saved in zip(("tolist", "numpy"), self._saved):
            setattr(torch.Tensor, method, self._reading(f"Tensor.{method}", saved))
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)

    def _reading(self, name, method):
        def read(tensor, *args, **kwargs):
            if self.counting:
                self.syncs[name] += 1
            return method(tensor, *args, **kwargs)
        return read

    @contextlib.contextmanager
    def paused(self):
        self.counting = False
        try:
            yield
        finally:
            self.counting = True


def per_step(run, short, more):
    """(ops, syncs) per step, Counters by op name: run(short + more) minus run(short), over `more`."""
    counts = []
    for n in (short, short + more):
        with torch.no_grad(), Dispatched() as seen:
            run(n)
        counts.append(seen)
    return tuple(_per(getattr(counts[1], k), getattr(counts[0], k), more) for k in ("ops", "syncs"))


def _per(long, short, more):
    diff = collections.Counter(long)
    diff.subtract(short)
    return collections.Counter({k: v / more for k, v in diff.items() if v})


def smollm2_ops_model(layers=30, seed=0):
    """(tokenizer, model): SmolLM2's architecture with widths cut (SMOLLM2_OPS), random weights, the
    scripts' fp32 head, the character tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = tasks.char_tokenizer()
    config = LlamaConfig(**{**SMOLLM2_OPS, "num_hidden_layers": layers}, vocab_size=len(tok),
                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.get_output_embeddings().__class__ = lm_head.FP32Head  # the scripts' head (plumbing.models.load_model)
    return tok, model


# -----------------------------------------------------------------------------
# a decode step: ours (sampling.generate, eager) against model.generate, temperature 1, no early stop


def decode_step(model, ids, mask, pad_id, eos_id, short=8, more=16, check_every=None):
    """{"ours": (ops, syncs), "generate": (ops, syncs)} per decode step of the same rows: sampling.generate
    (eager, its stop check every `check_every` steps) and model.generate (do_sample, a dynamic cache)."""
    def ours(n):
        return sampling.generate(model, ids, mask, n, -1, pad_id, temperature=1.0, check_every=check_every,
                                 generator=torch.Generator(device=ids.device).manual_seed(0))

    def generate(n):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id, eos_token_id=eos_id)

    return {"ours": per_step(ours, short, more), "generate": per_step(generate, short, more)}


# -----------------------------------------------------------------------------
# a training step: the script's own (its main, one more step; the rollout and the evaluations not counted)
# against a plain transformers padded forward and backward of the same rows, in aten ops and host syncs
# (Dispatched) or in kernel launches where parts of it are compiled (--compile_layers), counted from the
# profiler's events, since a dispatch mode makes dynamo run compiled code eagerly

UNCOUNTED = "dispatch: uncounted"  # a record_function region whose events launches() leaves out


def launches(run):
    """{name: count} of what run() launches: each aten op dispatched outside a compiled region (the
    outermost only: a composite op once, as the one kernel or view it amounts to), and inside one each
    of inductor's kernels ("compiled kernel") and each op it calls out to (a matmul, attention). The
    graphs must have been compiled with torch._inductor.config.cpp.enable_kernel_profile on (on the
    CPU inductor's kernels are seen only then). Events under record_function(UNCOUNTED) are left out."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    counts = collections.Counter()
    for e in prof.events():
        above, parent = [], e.cpu_parent
        while parent is not None:
            above.append(parent.name)
            parent = parent.cpu_parent
        if UNCOUNTED in above:
            continue
        if e.name.startswith("graph_") and "cpp_" in e.name:
            counts["compiled kernel"] += 1
        elif e.name.startswith("aten::") and not any(a.startswith("aten::") for a in above):
            counts[e.name] += 1
    return counts


def script_step(script, argv, steps=1, pause=(), count_launches=False):
    """(ops, syncs, outputs) of one steady training step of script.main (dpo or grpo): its run of argv for
    steps + 1 steps minus its run for `steps` (their first steps alike; the last one's evaluation is in
    both). pause: (module, name) of functions whose ops are not counted (the rollout: a decode loop,
    counted by decode_step; the data), and whose outputs are returned. count_launches: (launches, None,
    outputs), after a first run that compiles what the counted ones run."""
    if count_launches:
        torch.compiler.reset()  # as a run's process starts: no graph compiled
    counts, outputs = [], []
    for n in ((steps,) if count_launches else ()) + (steps, steps + 1):
        with tempfile.TemporaryDirectory() as out, contextlib.ExitStack() as stack:
            seen = None if count_launches else stack.enter_context(Dispatched())
            for module, name in pause:
                stack.enter_context(mock.patch.object(module, name, _uncounted(getattr(module, name), seen, outputs)))
            run = lambda: script.main(script.cli.parse_config(script.Config, [*argv, "--steps", str(n), "--out_dir", out]))  # noqa: E731
            if count_launches:
                counts.append(launches(run))
            else:
                run()
                counts.append(seen)
    if count_launches:
        return _per(counts[-1], counts[-2], 1), None, outputs
    return _per(counts[1].ops, counts[0].ops, 1), _per(counts[1].syncs, counts[0].syncs, 1), outputs


def _uncounted(fn, seen, outputs):
    """fn, its ops left out of `seen`'s count (None: of launches()'), its outputs kept."""
    def run(*args, **kwargs):
        with seen.paused() if seen is not None else torch.profiler.record_function(UNCOUNTED):
            outputs.append(fn(*args, **kwargs))
        return outputs[-1]
    return run


def padded_step(model, ids, attn, n_response, loss_fn, lr=1e-6, count_launches=False):
    """(ops, syncs) of a plain transformers training step, as TRL 1.16 runs one: the policy's
    padded forward over every row (logits of the last n_response + 1 positions kept), log-probs of
    the response tokens by log_softmax and gather, the reference's same forward without
    gradients, loss_fn(logps, ref_logps) -> loss, backward, gradient clipping, AdamW (fused,
    common.make_optimizer's kind) and zero_grad; count_launches: (launches, None). The model is
    copied: its reference is its copy."""
    policy, ref = copy.deepcopy(model).train(), copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.95), fused=True)
    labels = ids[:, -n_response:]

    def logps(m):
        logits = m(input_ids=ids, attention_mask=attn, logits_to_keep=n_response + 1).logits[:, :-1]  # (B, R, V)
        return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)  # (B, R)

    def step():
        with torch.no_grad():
            ref_logps = logps(ref)
        loss = loss_fn(logps(policy), ref_logps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state made: the counted step is a steady one
    if count_launches:
        return launches(step), None
    with Dispatched() as seen:
        step()
    return seen.ops, seen.syncs


def dpo_loss(resp, beta=0.1):
    """TRL's sigmoid DPO loss over rows [chosen; rejected] (the scripts' pair_batch layout)."""
    def loss(logps, ref_logps):
        pi, ref = (logps * resp).sum(-1).chunk(2), (ref_logps * resp).sum(-1).chunk(2)
        return -torch.nn.functional.logsigmoid(beta * ((pi[0] - ref[0]) - (pi[1] - ref[1]))).mean()
    return loss


def grpo_loss(resp, advantages, beta=0.04, eps=0.2):
    """TRL's GRPO loss, one iteration (the old policy is the policy, detached), the k3 KL, token mean."""
    def loss(logps, ref_logps):
        ratio = torch.exp(logps - logps.detach())
        pg = -torch.min(ratio * advantages[:, None], ratio.clamp(1 - eps, 1 + eps) * advantages[:, None])
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        return ((pg + beta * kl) * resp).sum() / resp.sum()
    return loss


def total(counter):
    return sum(counter.values())


# tests/test_dispatch.py's training steps: 2 layers of SmolLM2's architecture, rows of exact lengths
DPO_ARGV = ["--n_eval", "2", "--n_eval_prompts", "2", "--batch_size", "4", "--max_prompt_len", "32",
            "--max_response_len", "32", "--eval_every", "1000", "--no-precompute_ref"]
GRPO_ARGV = ["--n_eval", "2", "--prompts_per_step", "4", "--group_size", "4", "--max_prompt_len", "32",
             "--max_new_tokens", "8", "--num_iterations", "1", "--num_mini_batches", "1", "--beta", "0.04",
             "--eval_every", "1000"]
PADDED = ("--no-shared_prompt", "--no-padding_free")


def training_rows(work, layers=2, flag_sets=((), PADDED), count_launches=False):
    """Table rows of a DPO step (a live reference) and a GRPO step less its rollout and evaluation, at each
    of flag_sets, against a plain transformers padded step of the same rows (padded_step): their ops and
    host syncs, or their kernel launches. SmolLM2's architecture at `layers` layers, widths cut."""
    torch._inductor.config.cpp.enable_kernel_profile = count_launches  # inductor's CPU kernels seen by the profiler
    tok, model = smollm2_ops_model(layers)
    folder = os.path.join(work, "model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    pairs = harness.make_data(os.path.join(work, "pairs.jsonl"), [(32, 32)] * 8)
    prompts = harness.make_data(os.path.join(work, "prompts.jsonl"), [(24, 8)] * 16)
    rows = []
    for script, rows_file, argv, pause, what in (
            (dpo, pairs, DPO_ARGV, [(data, "pair_batch")], "a DPO step, live reference, 4 pairs of 32 + 32 tokens"),
            (grpo, prompts, GRPO_ARGV, [(environment, "rollout"), (environment, "evaluate")],
             "a GRPO step less its rollout and evaluation, 4 prompts x G = 4, 24 + 8 tokens")):
        for flags in flag_sets:
            ours, syncs, outs = script_step(script, ["--model", folder, "--dataset", rows_file, "--eval_dataset",
                                                     rows_file, *argv, *flags], pause=pause, count_launches=count_launches)
            if script is dpo:
                ids, attn, resp = max(outs, key=lambda b: len(b[0]))  # a training batch (2 x 4 rows), not an evaluation's
                loss, n = dpo_loss(resp), resp.shape[1]
            else:
                roll = [o for o in outs if isinstance(o, environment.Rollout)][-1]
                ids, attn = torch.cat([roll.p_ids, roll.r_ids], 1), torch.cat([roll.p_mask, roll.r_mask], 1)
                loss, n = grpo_loss(roll.r_mask.float(), torch.linspace(-1, 1, len(ids))), roll.r_ids.shape[1]
            padded, padded_syncs = padded_step(model, ids, attn, n, loss, count_launches=count_launches)
            shown = f"{what}, {layers} layers, {' '.join(flags) or 'default flags'}"
            rows.append([f"{shown}: kernel launches (ops outside compiled regions + compiled kernels)",
                         f"{total(ours):,.0f} ({ours['compiled kernel']:,.0f} compiled kernels)", f"{total(padded):,.0f}",
                         f"**{total(ours) / total(padded):.2f}x**"] if count_launches else
                        [shown, f"{total(ours):,.0f} ops, {total(syncs):.0f} syncs",
                         f"{total(padded):,.0f} ops, {total(padded_syncs):.0f} syncs", f"{total(ours) / total(padded):.2f}x ops"])
    return rows


def main(args):
    """The dispatch command: a decode step's counts (and with --training a DPO and a GRPO step's, with
    --launches their kernel launches, eager and with --compile_layers), printed and written as a table
    (bench/results/dispatch-cpu[-TAG].json)."""
    tok, model = smollm2_ops_model(args.layers)
    ids, mask = harness.prompts_batch(tok, 4, 2, torch.device("cpu"))
    steps = decode_step(model, ids, mask, tok.pad_token_id, tok.eos_token_id, check_every=sampling.GPU_CHECK_EVERY)
    (ours, ours_syncs), (gen, gen_syncs) = steps["ours"], steps["generate"]
    rows = [[f"a decode step, SmolLM2's architecture ({args.layers} layers), {len(ids)} rows, sampled",
             f"{total(ours):,.0f} ops, {total(ours_syncs):.3g} host syncs",
             f"`model.generate`: {total(gen):,.0f} ops, {total(gen_syncs):.3g} syncs", f"{total(ours) / total(gen):.3f}x ops"]]
    if args.diff:
        for k in sorted(set(ours) | set(gen), key=lambda k: ours[k] - gen[k]):
            if ours[k] != gen[k]:
                print(f"  {k:55s} ours {ours[k]:7.2f}  generate {gen[k]:7.2f}")
    if args.training:
        with tempfile.TemporaryDirectory() as work:
            rows += training_rows(work)
    if args.launches:
        with tempfile.TemporaryDirectory() as work:
            rows += training_rows(work, layers=args.layers, flag_sets=((), ("--compile_layers", "true")),
                                  count_launches=True)
    header = ["step", "ours", "reference (a plain transformers step: what TRL 1.16 runs)", "ratio"]
    print(harness.markdown(header, rows), end="")
    path = harness.save("dispatch", torch.device("cpu"), args.tag, {"header": header, "rows": rows}, argv=args.argv,
                        folder=args.results)
    print(f"wrote {path}")
