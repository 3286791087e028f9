"""Per-phase seconds of a GRPO or DPO step's trainer passes on SmolLM2-135M-Instruct, each distinct
prompt computed once (shared_prompt) against the padded forward (common) or the packed one, the
variants alternated in one process (give them A B B A), and the rollout (GRPO) and optimizer step once.

    python bench/shared_prompt_phases.py grpo 2 8 padded,shared,shared,padded   # 2 prompts x G=8, 128 + 32 tokens
    python bench/shared_prompt_phases.py dpo 8 2 padded,shared,shared,padded    # 8 pairs: chosen and rejected
"""
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import common, sampling, shared_prompt
from plumbing import models
algo, NP, G = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = common.Dist()
folder = models.model_folder("smollm2")
tok = models.load_tokenizer(folder)
model = models.load_model(folder, tok)
ref = common.freeze(copy.deepcopy(model), d)
opt, sched = common.make_optimizer([p for p in model.parameters() if p.requires_grad], 1e-6, 0.0, 0, 100)
g = torch.Generator().manual_seed(0)
P, R = 128, 32
p_ids = torch.randint(15, 25, (NP, P), generator=g).repeat_interleave(G, 0); p_mask = torch.ones_like(p_ids)
T = {}
def tick(k, t0): T.setdefault(k, []).append(round(time.perf_counter() - t0, 2)); print(k, T[k][-1], flush=True)
if algo == "grpo":
    t0 = time.perf_counter()
    with common.evaluating(model, gather=True):
        r_ids, r_mask, _ = sampling.generate(model, p_ids, p_mask, R, eos_id=-5, pad_id=tok.pad_token_id,
                                             generator=torch.Generator().manual_seed(1), return_logprobs=True)
    tick("rollout", t0)
else:
    r_ids = torch.randint(15, 25, (NP * G, R), generator=g); r_mask = torch.ones_like(r_ids)
ids, attn = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
def ref_pass(v):  # one micro-batch of every row, in the layout v
    with torch.no_grad():
        return shared_prompt.response_logprobs(ref, ids, attn, R, packed=v == "packed", shared=v == "shared")
def update(v):
    if v == "shared":
        lp, ent = shared_prompt.response_logprobs(model, ids, attn, R, with_entropy=True, shared=True)
    else:
        lp, ent = common.response_logprobs(model, ids, attn, R, with_entropy=True, packed=v == "packed")
    ((lp * r_mask).sum() / r_mask.sum()).backward()
    model.zero_grad(set_to_none=True)
for v in sys.argv[4].split(","):
    t0 = time.perf_counter(); ref_pass(v); tick("ref/" + v, t0)
    t0 = time.perf_counter(); update(v); tick("update/" + v, t0)
update("shared")
t0 = time.perf_counter(); common.optimizer_step(model, opt, sched, 1.0); tick("opt", t0)
print(json.dumps(T))
