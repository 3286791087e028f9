"""The compiled decode step as a GPU would run it, read on the CPU: the ATen graph that inductor would
compile (captured by aot_autograd, the GPU's path of sampling.generate: sampling._gpu) walked node by
node under bf16 autocast on SmolLM2's architecture (Llama, 9 query heads over 3 key/value heads) with
its widths cut, and the ops a token costs outside the graph counted (bench/dispatch.py's counter).
On a GPU a decode step of a small model is bound by its launches and by the bytes it reads: a cache
read once, in bf16, with nothing dispatched beside the graph."""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import sampling
import kv_cache
from bench import dispatch, harness

VIEWS_AND_WRITES = {"aten.index_copy.default", "aten.copy_.default", "aten.copy.default"}  # the cache's update


class Captured:
    """A dynamo backend that keeps each ATen inference graph and runs it as it is. Dynamo runs a
    compiled function eagerly under a TorchDispatchMode (bench/dispatch.Dispatched), so `compile`'s
    step leaves the mode while it runs: what the mode counts is what runs outside the graph."""

    def __init__(self):
        self.graphs = []

    def compiler(self, gm, example_inputs):
        self.graphs.append(gm)
        return make_boxed_func(gm.forward)

    def compile(self, fn):
        from torch.utils._python_dispatch import _pop_mode_temporarily, _get_current_dispatch_mode

        compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=self.compiler), dynamic=False)

        def step(*args, **kwargs):
            if _get_current_dispatch_mode() is None:
                return compiled(*args, **kwargs)
            with _pop_mode_temporarily():
                return compiled(*args, **kwargs)
        step._torchdynamo_orig_callable = compiled._torchdynamo_orig_callable
        return step


@pytest.fixture(scope="module")
def smollm2_ops():
    return dispatch.smollm2_ops_model(2)


def _generate(model, ids, mask, n, compile):
    u = sampling.rollout_uniforms(len(ids), n, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return sampling.generate(model, ids, mask, n, -1, 0, uniforms=u, return_logprobs=True, compile=compile,
                                 check_every=sampling.GPU_CHECK_EVERY, reserve=(len(ids), ids.shape[1] + 32))


def _compiled(monkeypatch, captured):
    monkeypatch.setattr(sampling, "_compiled", {})
    monkeypatch.setattr(sampling, "_gpu", lambda device: True)
    monkeypatch.setattr(sampling, "_compile", lambda fn, gpu: captured.compile(fn))
    monkeypatch.setattr(kv_cache, "_DECODE_CACHES", type(kv_cache._DECODE_CACHES)())
    monkeypatch.setattr(kv_cache, "_DECODERS", type(kv_cache._DECODERS)())


def test_the_compiled_decode_step_reads_a_bf16_cache_once_as_it_is(smollm2_ops, monkeypatch):
    """Under bf16 autocast the static cache holds keys and values in bf16 (RoPE's fp32 cos/sin make
    the new keys fp32: sampling._CastingLayer casts the one token's), and no op of the compiled step
    computes a tensor of a cache layer's size from the cache: no cast of the whole cache to the
    compute dtype, no copy of keys and values at the query heads' count (transformers' repeat_kv
    under torch.compile: 3x here, 7x for Qwen2.5-0.5B), only the cache's own in-place update
    (functionalized: index_copy, then copied back). The draw is in the graph too: a float64 cumsum
    over the vocabulary."""
    tok, model = smollm2_ops
    captured = Captured()
    _compiled(monkeypatch, captured)
    ids, mask = harness.prompts_batch(tok, 4, 2, torch.device("cpu"))
    with torch.no_grad():
        _generate(model, ids, mask, 6, compile=True)
    held = kv_cache._DECODE_CACHES[model]
    layer = held.full.layers[0]
    assert {layer.keys.dtype for layer in held.full.layers} == {layer.values.dtype for layer in held.full.layers} \
        == {torch.bfloat16}
    assert len(captured.graphs) == 1
    (graph,) = captured.graphs
    B = len(ids)
    cache_numel = B * layer.keys.shape[1] * held.slots * layer.keys.shape[-1]  # one layer's keys for B rows
    shape = (B, layer.keys.shape[1], held.slots, layer.keys.shape[-1])
    nodes = [n for n in graph.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    read = {n for n in nodes if n.op == "placeholder" and tuple(n.meta["val"].shape) == shape}  # the cache's layers
    assert len(read) == 2 * len(held.full.layers)
    for n in nodes:  # what is computed from the cache, in graph order
        if n.op == "call_function" and any(a in read for a in n.all_input_nodes):
            read.add(n)
    big = [(str(n.target), tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in read if n.op == "call_function"
           and n.meta["val"].numel() >= cache_numel and str(n.target) not in VIEWS_AND_WRITES and not n.target.is_view]
    assert not big, big  # what would copy or cast a layer's cache each token
    writes = [n for n in nodes if str(n.target) == "aten.index_copy.default" and n.meta["val"].numel() == cache_numel]
    assert len(writes) == 2 * len(held.full.layers)  # each layer's keys and values: its one token written in place
    assert any(str(n.target) == "aten.cumsum.default" and n.meta["val"].dtype == torch.float64 for n in nodes)


def test_a_decode_token_runs_nothing_outside_the_compiled_graph(smollm2_ops, monkeypatch):
    """Per decode token, sampled with its log-probs (a rollout's call), the ops dispatched outside
    the compiled graph: none but the "all stopped?" read every 8 tokens (its reduction and the
    read: 1/8 of 2 ops and of a host sync). The forward, the draw, the done rows, the next token's
    position and what is written of the response all run inside the graph, on the Rows that the
    graph updates in place; eager, the same loop dispatches the whole step's ops each token."""
    tok, model = smollm2_ops
    captured = Captured()
    _compiled(monkeypatch, captured)
    ids, mask = harness.prompts_batch(tok, 4, 2, torch.device("cpu"))
    with torch.no_grad():
        _generate(model, ids, mask, 8, compile=True)  # compiled, the graph chosen
    ops, syncs = (dispatch.total(c) for c in dispatch.per_step(lambda n: _generate(model, ids, mask, n, compile=True), 8, 16))
    assert ops <= 2 / sampling.GPU_CHECK_EVERY and syncs <= 1 / sampling.GPU_CHECK_EVERY, (ops, syncs)
    assert len(captured.graphs) == 1  # the same graph for every call of these rows
    eager = dispatch.per_step(lambda n: _generate(model, ids, mask, n, compile=False), 8, 16)[0]
    assert dispatch.total(eager) > 100  # the counter sees a step's ops where they run outside a graph


def test_the_compiled_step_samples_the_eager_steps_tokens(smollm2_ops, monkeypatch):
    """The same rollout compiled (its ATen graph run as captured) and eager, under bf16 autocast: the
    same tokens and masks, log-probs to bf16's rounding (the eager step's cache is the same bf16 one)."""
    tok, model = smollm2_ops
    _compiled(monkeypatch, Captured())
    ids, mask = harness.prompts_batch(tok, 4, 2, torch.device("cpu"))
    with torch.no_grad():
        got, want = _generate(model, ids, mask, 12, compile=True), _generate(model, ids, mask, 12, compile=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=2e-2)
