"""`auto`, the default of the speed flags (--padding_free, --shared_prompt, --compile: plumbing/speed.py):
the CPU's rule (FLOPs: packed and shared where they compute less; no compile), a GPU's (the layouts timed
once on the first micro-batch, the fastest kept; the compiled decode step, not under torchrun with LoRA),
the same choice on every rank and on --resume, said on the run's first lines and in run_config.json.
The GPU's rule runs here on CPU tensors with the device check and the clock faked: what it decides from
given times is what is tested; what the times are on a GPU is `python -m bench gpu`'s to measure."""
import json
from types import SimpleNamespace

import datasets
import pytest
import torch

import common
import dpo
import grpo
import sampling
import kv_cache
import sft
import tasks
from helpers import ctrl_c_after_first_save, read_metrics, run_here, run_script, write_jsonl
from plumbing import cli, models, speed

CPU = common.Dist()
CUDA_PYTHON = common.Dist()
CUDA_TORCHRUN = common.Dist(world_size=1, torchrun=True)


def test_speed_flags_parse_as_trl_and_as_auto():
    """--padding_free (TRL's boolean), --no-padding_free, --padding_free true|false|auto, the default auto;
    anything else refused naming the flag."""
    assert cli.parse_config(dpo.Config, []).padding_free == "auto"
    assert cli.parse_config(dpo.Config, []).shared_prompt == "auto"
    assert cli.parse_config(grpo.Config, []).compile == "auto"
    for argv, want in ((["--padding_free"], True), (["--no-padding_free"], False), (["--padding_free", "false"], False),
                       (["--padding_free", "True"], True), (["--padding_free", "auto"], "auto")):
        assert cli.parse_config(sft.Config, argv).padding_free == want, argv
    with pytest.raises(SystemExit):
        cli.parse_config(sft.Config, ["--padding_free", "sometimes"])
    with pytest.raises(ValueError, match=r"--shared_prompt 'yes' is not one of True, False, auto"):
        cli.check_ranges(dpo.Config(shared_prompt="yes"))


def test_on_a_cpu_auto_is_the_flop_rule_and_no_compile():
    """On a CPU every layout flag left at auto resolves to true (packing and sharing wherever they
    compute fewer FLOPs, which each pass then decides) and --compile to false, recorded with why;
    flags given are kept as given and not recorded."""
    cfg, recorded = grpo.Config(padding_free=False), {}
    model = _tiny()
    got = speed.choose(cfg, CPU, recorded, model, batch=_boom, models_=[None])
    assert got == {"padding_free": False, "shared_prompt": True, "compile": False, "compile_layers": False}
    assert set(recorded) == {"shared_prompt", "compile", "compile_layers"}
    assert "FLOPs" in recorded["shared_prompt"]["why"] and "CPU" in recorded["compile"]["why"]


def _tiny():
    return models.load_model("tiny", tasks.char_tokenizer())


def _boom():
    raise AssertionError("a CPU times nothing: the first micro-batch is not even built")


def _batch(model, G=4, P=6, R=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (P,), generator=g).tolist()] * G
    responses = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (R, 2, R - 3, 1)[:G]]
    return common.join_prompt_response(prompts, responses, 0)


@pytest.fixture
def gpu_clock(monkeypatch):
    """A GPU, as far as speed.choose can tell: the device check says so, and each layout's forward and
    backward takes the seconds `table` gives it (the real forward and backward run, on the CPU)."""
    table, ran = {}, []
    real, compile = speed._forward_backward, torch.compile
    monkeypatch.setattr(speed, "timed", lambda d: True)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile(fn, backend="eager", **kw))  # --compile_layers
    monkeypatch.setattr(speed, "_forward_backward", lambda *a, **k: ran.append(a[2]) or real(*a, **k))
    monkeypatch.setattr(speed, "seconds", lambda fn, d: fn() or table[ran[-1]])
    return table, ran


@pytest.mark.parametrize("fastest", ["padded", "packed", "shared"])
def test_on_a_gpu_the_fastest_timed_layout_is_kept(gpu_clock, fastest):
    """Each candidate (padded; packed, as the model keeps packed rows apart; shared, as the rows share a
    prompt in one process) warmed up once, then timed 3 times each in alternating order, the least of
    each compared: the fastest one is what the flags resolve to, with every time in the line. The
    weights' gradients are left as they were (none)."""
    table, ran = gpu_clock
    table.update({"padded": 2.0, "packed": 3.0, "shared": 4.0, fastest: 1.0})
    model = _tiny()
    recorded = {}
    got = speed.choose(dpo.Config(), CUDA_PYTHON, recorded, model, batch=_batch(model))
    assert got == {"padding_free": fastest == "packed", "shared_prompt": fastest == "shared", "compile_layers": True}
    assert ran == ["padded", "packed", "shared"] * 2 + ["shared", "packed", "padded", "padded", "packed", "shared"]
    measured = f"timed on the first micro-batch: {', '.join(f'{k} {1e3 * table[k]:.1f} ms' for k in table)}"
    assert recorded["padding_free"]["why"] == recorded["shared_prompt"]["why"] == measured
    assert all(p.grad is None for p in model.parameters())


def test_on_a_gpu_compile_is_on_under_python_and_torchrun_but_not_torchrun_with_lora(gpu_clock):
    """The compiled decode step on a GPU: under `python`, and under torchrun, where it decodes from a
    copy of the model outside FSDP2 (sampling._decoder); not under torchrun with LoRA's adapters,
    which that copy (a model built from the config) cannot hold."""
    table, _ = gpu_clock
    table.update({"padded": 1.0, "packed": 2.0})
    model, lora = _tiny(), models.add_lora(_tiny(), r=2, alpha=4)
    for d, m, want in ((CUDA_PYTHON, model, True), (CUDA_TORCHRUN, model, True), (CUDA_PYTHON, lora, True),
                       (CUDA_TORCHRUN, lora, False)):
        recorded = {}
        cfg = grpo.Config(shared_prompt=False)
        assert speed.choose(cfg, d, recorded, m, batch=_batch(m))["compile"] is want
        assert ("LoRA" in recorded["compile"]["why"]) is (not want)


def test_compile_layers_compiles_every_block_of_the_policy_and_its_frozen_models(gpu_clock, monkeypatch):
    """--compile_layers auto: on a GPU each transformer block's forward of the policy and of the models that
    run its passes (a frozen reference, a teacher; None: absent) is compiled, once however often choose
    runs, with symbolic sizes; on a CPU none, said with why. A block compiled keeps its numbers (here
    dynamo's eager backend): the policy's log-probs are the eager ones to the bit. The sampler's decoder
    copy (sampling._decoder) does not inherit a compiled forward bound to the model's blocks."""
    table, _ = gpu_clock
    table.update({"padded": 1.0, "packed": 2.0})
    compiled = []
    real = torch.compile  # the gpu_clock's: dynamo's eager backend
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append((fn.__self__, kw)) or real(fn, **kw))
    model, ref = _tiny(), _tiny()
    batch = _batch(model)
    with torch.no_grad():
        eager = common.response_logprobs(model, *batch[:2], batch[2].shape[1])
    for d, want in ((common.Dist(), False), (CUDA_PYTHON, True), (CUDA_PYTHON, True)):
        recorded = {}
        monkeypatch.setattr(speed, "timed", lambda d_, want=want: want)
        got = speed.choose(grpo.Config(shared_prompt=False), d, recorded, model, batch=batch, models_=[ref, None])
        assert got["compile_layers"] is want and ("GPU" in recorded["compile_layers"]["why"]) is want
    blocks = common.transformer_blocks(model) + common.transformer_blocks(ref)
    assert [b for b, _ in compiled] == blocks and all(kw == {"dynamic": True} for _, kw in compiled)  # once each
    with torch.no_grad():
        assert torch.equal(common.response_logprobs(model, *batch[:2], batch[2].shape[1]), eager)
        frames = torch._dynamo.utils.counters["frames"]["total"]
        tok = tasks.char_tokenizer()  # the sampler's forwards carry a KV cache: each block as it is, nothing traced
        sampling.generate(model, *common.pad([tok("sort 3 1 =")["input_ids"]], tok.pad_token_id, side="left"), 4,
                          tok.eos_token_id, tok.pad_token_id, temperature=0)
        assert torch._dynamo.utils.counters["frames"]["total"] == frames
    decoder = kv_cache._autocast_copy(model)[0]
    assert not any("forward" in vars(m) for m in decoder.modules())


def test_a_recorded_choice_is_kept_and_not_timed_again(gpu_clock):
    """A resumed run's choices (Run.choices, from its checkpoint) are taken as they are: nothing is
    timed, and the line says whose they are."""
    table, ran = gpu_clock
    recorded = {"padding_free": {"value": False, "why": "timed on the first micro-batch: padded 1 ms"},
                "shared_prompt": {"value": True, "why": "timed on the first micro-batch: shared 1 ms"}}
    assert speed.choose(dpo.Config(compile_layers=False), CUDA_PYTHON, recorded, _tiny(), batch=_boom) == \
        {"padding_free": False, "shared_prompt": True, "compile_layers": False}
    assert ran == []


def test_two_ranks_keep_the_layout_of_their_summed_times():
    """Rank 0 times packed faster, rank 1 padded: both keep padded, the faster over the two summed
    (tests/dist_worker.py speed_agreed)."""
    r = run_script(["tests/dist_worker.py", "speed_agreed"], nproc=2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} keeps padded: {{'padded': 3.5, 'packed': 4.0}}" in r.stdout, r.stdout


def test_a_run_records_its_choices_and_a_resume_keeps_them(tmp_path, monkeypatch):
    """sft.py at auto: run_config.json and the checkpoint's trainer_state.json hold what auto chose
    and why, the first lines say it; a resume whose checkpoint says padded (as a GPU's timing could
    have chosen) trains padded on the CPU too, and says that the run it resumes chose it."""
    rows = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"sort {i % 9} 1 =", "completion": " 1" * (1 + i % 4)}
                                              for i in range(32)])
    args = ["sft.py", "--model", "tiny", "--dataset", rows, "--eval_dataset", rows, "--steps", "4", "--batch_size",
            "8", "--save_every", "2", "--n_eval", "8", "--warmup_steps", "0", "--out_dir", str(tmp_path / "run")]
    with ctrl_c_after_first_save():  # stopped at step 2, as a Ctrl-C would
        first = run_here(args)
    assert first.returncode == 130, first.stdout[-2000:] + first.stderr[-2000:]
    assert "auto: --padding_free true (a CPU step is bound by FLOPs" in first.stdout
    config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert config["padding_free"] == "auto" and config["choices"]["padding_free"]["value"] is True
    state_file = tmp_path / "run" / "checkpoint" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["choices"]["padding_free"]["value"] is True
    state["choices"]["padding_free"] = {"value": False, "why": "timed on the first micro-batch: padded 1.0 ms"}
    state_file.write_text(json.dumps(state))
    packs, real = [], common.pack
    monkeypatch.setattr(common, "pack", lambda *a: packs.append(1) or real(*a))
    resumed = run_here([*args, "--resume"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "--padding_free false (as the run it resumes chose: timed on the first micro-batch" in resumed.stdout
    assert not packs and [r["step"] for r in read_metrics(tmp_path / "run")][-1] == 4
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["choices"]["padding_free"]["value"] is False


def test_grpo_times_a_micro_batch_shaped_as_its_first():
    """speed.rollout_sample, what a GPU times for grpo.py before its first rollout: the first prompts,
    group_size / num_mini_batches rows of each (as the deal puts a group's rows in a mini-batch), the
    micro-batch's rows, responses of random lengths up to --max_new_tokens after each prompt."""
    tok = tasks.char_tokenizer()
    prompts = [f"sort {' '.join('3' * k)} =" for k in range(3, 9)]
    env = SimpleNamespace(prompts=datasets.Dataset.from_dict({"prompt": prompts}), tokenizer=tok)
    cfg = cli.with_defaults(grpo.Config(group_size=8, num_mini_batches=2, max_new_tokens=12, max_prompt_len=32))
    ids, attn, resp = speed.rollout_sample(env, cfg, micro=10, d=CPU)
    P = ids.shape[1] - resp.shape[1]
    assert ids.shape[0] == 10 and resp.shape[1] <= 12 and 1 <= resp.sum(-1).min()
    for i in range(10):  # rows 0-3 the first prompt, 4-7 the second, 8-9 the third
        want = sampling.encode_prompts(tok, [prompts[i // 4]], 32)[0][0]
        assert ids[i, P - len(want):P].tolist() == want and attn[i, :P].sum() == len(want)
    assert (resp.sum(-1) != resp.sum(-1)[0]).any()  # lengths drawn, not all the longest
