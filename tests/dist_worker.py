"""Workers that tests/test_distributed.py runs under torchrun: `python -m torch.distributed.run
--nproc_per_node N tests/dist_worker.py NAME ARGS...`. Each prints one line per rank that the
test reads back, and exits non-zero on failure."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import sampling  # noqa: E402
from helpers import assert_gradients_agree, fp32_rtol, gradient_lengths  # noqa: E402
from plumbing import checkpoints, cli, models, rundir  # noqa: E402


def out_dir_seen_differently(base):
    """Node-local folders, simulated: each rank is given its own out_dir, and only rank 0's holds
    a checkpoint. Every rank must stop with the same error, not resume alone and hang."""
    import sft

    d = common.setup_distributed(timeout_minutes=1.0)
    out = os.path.join(base, f"node{d.rank}")
    ckpt = os.path.join(out, "checkpoint")
    os.makedirs(ckpt, exist_ok=True)
    if d.rank == 0:
        for name, text in (("config.json", "{}"), ("trainer_state.json", '{"step": 4, "config": {}}')):
            with open(os.path.join(ckpt, name), "w") as f:
                f.write(text)
    try:
        rundir.Run(sft.Config(out_dir=out, resume=True), d)
    except RuntimeError as e:
        print(f"rank {d.rank} stopped: {e}", flush=True)
        rundir.release()
        sys.exit(3)
    rundir.release()


def data_seen_differently(base):
    """Node-local data, simulated: the same --dataset path names 200 rows on one node and 150 on
    the other (each rank works in a folder of its own). Every rank must stop with one message,
    not train on other rows."""
    import json

    import sft

    d = common.setup_distributed(timeout_minutes=1.0)
    node = os.path.join(base, f"node{d.rank}")
    os.makedirs(node, exist_ok=True)
    with open(os.path.join(node, "data.jsonl"), "w") as f:
        for i in range(200 if d.rank == 0 else 150):
            f.write(json.dumps({"prompt": f"sort {i % 10} 1 2 =", "completion": " 1 2"}) + "\n")
    os.chdir(node)
    try:
        rundir.Run(sft.Config(dataset="data.jsonl", out_dir=os.path.join(base, "out")), d)
    except RuntimeError as e:
        print(f"rank {d.rank} stopped: {e}", flush=True)
        rundir.release()
        sys.exit(3)
    rundir.release()


def loaded_from_rank0(*folders):
    """loaded_from_one(folder) for each folder, in one process group."""
    for folder in folders:
        loaded_from_one(folder)
    rundir.release()


def loaded_from_one(folder):
    """Only rank 0 reads the weights: the other ranks' models are on the meta device until
    shard_model fills their shards by broadcast. The gathered weights equal the folder's, and
    each rank's forward equals that of the model read whole (non-persistent buffers included:
    Llama's rotary frequencies are in no state dict)."""
    import torch
    from safetensors.torch import load_file

    d = common.setup_distributed(timeout_minutes=1.0)
    tok = models.load_tokenizer(folder)
    model = models.load_model(folder, tok, d=d)
    on_meta = all(p.is_meta for p in model.parameters())
    assert on_meta == (d.rank != 0), (d.rank, on_meta)
    model = common.shard_model(model.eval(), d)
    state = checkpoints.full_state_dict(model, d)  # rank 0's; empty elsewhere
    if d.is_main:
        want = load_file(os.path.join(folder, "model.safetensors"))
        assert want.keys() == state.keys(), sorted(want.keys() ^ state.keys())
        assert all(torch.equal(want[k], state[k]) for k in want)
    whole = models.load_model(folder, tok).eval()
    ids = torch.tensor([[5, 9, 2, 7, 3, 11, 4]])
    with torch.no_grad():  # the gathered weights through the same modules on the same rows: the same floats
        diff = (model(input_ids=ids).logits - whole(input_ids=ids).logits).abs().max().item()
    assert diff == 0, (d.rank, diff)
    print(f"{os.path.basename(folder)}: rank {d.rank} ok: {'meta' if on_meta else 'read'} before sharding, logits "
          f"within {diff:.1e}", flush=True)
    del model
    torch.distributed.barrier()


def stop_ids(name):
    """The ids each rank stops sampling at, for a model named by hub id (read from the hub cache)."""
    d = common.setup_distributed(timeout_minutes=1.0)
    tok = models.load_tokenizer(name)
    model = models.load_model(name, tok, d=d)
    print(f"rank {d.rank} stops at {sampling.stop_token_ids(tok, model)}", flush=True)
    rundir.release()


def accumulated_gradients():
    """Two micro-batches of one optimizer step on 2 ranks (common.backward, sync on the second).
    After the first, each parameter's gradient is the rank's shard and the tensors alive grew by
    about one shard of gradients, not the whole model's (FSDP2 without a reduce-scatter holds
    full, unsharded fp32 gradients until the last micro-batch). After the second, the gathered
    gradient is the whole batch's gradient on one unsharded model."""
    import copy
    import gc

    import torch

    def live_bytes():  # every tensor alive in this process, each storage once
        seen = {}
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and not o.is_meta:
                t = o.to_local() if hasattr(o, "to_local") else o
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    d = common.setup_distributed(timeout_minutes=1.0)
    tok = models.load_tokenizer("tiny")
    common.set_seed(0)
    whole = models.load_model("tiny", tok)
    model = common.shard_model(copy.deepcopy(whole), d)
    ids = torch.randint(4, len(tok), (8, 12), generator=torch.Generator().manual_seed(0))  # the global batch
    mine = ids[common.shard_batch(8, d)]

    def loss_of(m, rows):  # any loss that is a sum over rows, divided by the global batch's 8 rows
        return m(input_ids=rows).logits.float().logsumexp(-1).sum() / 8

    before = live_bytes()
    common.backward(model, loss_of(model, mine[:2]), d, sync=False)
    grown, shard = live_bytes() - before, sum(4 * p.to_local().numel() for p in model.parameters())
    assert all(p.grad is not None and p.grad.to_local().shape == p.to_local().shape for p in model.parameters())
    assert grown <= 1.25 * shard, (d.rank, grown, shard)
    common.backward(model, loss_of(model, mine[2:]), d, sync=True)
    loss_of(whole, ids).backward()
    got = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    want = torch.cat([q.grad.flatten() for q in whole.parameters()])
    diff = (got - want).abs().max().item()  # 4 rows a rank against 8 at once: float32's rounding of the two, in norm
    assert_gradients_agree(got, want, fp32_rtol(gradient_lengths(whole.config, 12, 8 * 12)), d.rank)
    print(f"rank {d.rank} ok: {grown} bytes more after a micro-batch, a shard of gradients is {shard}; "
          f"gradient within {diff:.1e}", flush=True)
    rundir.release()


def speed_agreed():
    """Each rank times the layouts differently (rank 0: packed 1 s, padded 2 s; rank 1: packed 3 s,
    padded 1.5 s): speed.fastest sums the ranks' times, so both keep padded (3.5 s against 4)."""
    from plumbing import speed

    d = common.setup_distributed(timeout_minutes=1.0)
    table = [{"packed": 1.0, "padded": 2.0}, {"packed": 3.0, "padded": 1.5}][d.rank]
    ran = []
    speed._forward_backward = lambda model, batch, layout, **kw: ran.append(layout)
    speed.seconds = lambda fn, d: fn() or table[ran[-1]]
    best, times = speed.fastest(None, None, ["padded", "packed"], d)
    print(f"rank {d.rank} keeps {best}: {times}", flush=True)


def slow_sampler(seconds, script, *args):
    """`script ARGS` with rank 1 sleeping `seconds` at the start of its first generate, as a rank
    decoding a longer rollout would: the other rank waits in its next collective. Also checks
    that cli.start gave the process group --timeout_minutes and made the group in which ranks
    wait for rank 0's exports."""
    import importlib
    import time

    import sampling

    generate, start, seconds = sampling.generate, cli.start, [seconds]

    def slow_generate(*a, **kw):
        if int(os.environ["RANK"]) == 1 and seconds:
            time.sleep(float(seconds.pop()))
        return generate(*a, **kw)

    def checked_start(cfg):
        import torch
        import torch.distributed as dist

        d = start(cfg)
        assert checkpoints.WAIT_GROUP, "cli.start made no wait group"
        timeout = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
        assert timeout.total_seconds() == 60 * cfg.timeout_minutes, (timeout, cfg.timeout_minutes)
        return d

    sampling.generate, cli.start = slow_generate, checked_start
    module = importlib.import_module(os.path.splitext(os.path.basename(script))[0])
    sys.argv = [script, *args]
    cli.script(module.main, module.Config)


if __name__ == "__main__":
    code = 0
    try:
        globals()[sys.argv[1]](*sys.argv[2:])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    # The worker has said all it has to: skip the interpreter's finalisation, where gloo's threads,
    # freed after the process group was destroyed, could std::terminate the process (seen once in
    # several hundred runs, under load: "terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
