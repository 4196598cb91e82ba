#!/usr/bin/env bash
# The GPU benchmarks of record in one command, each part bounded in time so that the
# whole stays under 10 minutes. $OUT (default ./bench-out) gets few files: machine.txt,
# summary.txt (each part's exit status and time), each part's table (NAME.md) and logs.tar.gz,
# every log and per-configuration JSON (no model weights), re-made after each part so that a
# run stopped early leaves what it measured.
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/gpu_record.sh
#
# A part that runs past its limit is stopped (with its subprocesses); what it measured
# until then is in its .md (tables are rewritten after each configuration) and its log.
# TINY=1 runs the same parts on the CPU with the tiny model (a check that each one starts).
# DRY=1 prints each part's command instead of running it (tests/unit/test_gpu_record.py parses
# every one with its script's own argument parser, so a run on the GPU never meets a bad flag).
# PARTS names the parts to run (default: decode grpo generation, at most 8 minutes together);
# the others are commands of their own: PARTS=dpo_flex (at most 6 minutes: DPO at UltraFeedback
# lengths, packed rows on flex attention against TRL + Liger at a micro-batch of 8 pairs; each
# flex configuration's first step compiles its attention, about 100 s on an H100), PARTS=dpo_flex16
# (the same at 16 pairs), PARTS=distill (with its teacher, about 7
# minutes: ours padding-free under a 4,096-token budget against TRL), PARTS=distill_checkpointing
# (the same with gradient checkpointing in both, TRL's default), PARTS=distill_padded (about 3
# minutes: ours in its default, padded layout, alone; the three in one part ran past ten minutes),
# PARTS="e2e_dpo real_lengths" (about 6 minutes), PARTS=grpo_real (at most 9 minutes: GRPO at 8 x 8
# completions of log-normal lengths up to 2,048 tokens, ours padded and packed against TRL, whose
# generate runs every step to the longest completion, and ours packed with its decoding step
# compiled: at bf33ce2 generation was 90% of the packed step), PARTS=grpo_longest (at most 9
# min 20 s: the longest completion ours (one completion a row, two decoded at a time) and TRL, at
# its default micro-batch and at one completion a micro-batch, are predicted to train at 8 x 8,
# from the peak at 4,096, 8,192 and 16,384 tokens, with the rollout's KV cache at that length),
# PARTS=grpo_longest_offload (at most 7 minutes: the same prediction for TRL at one completion a
# micro-batch and ours with its MLP tiled, both with the checkpointed layers' inputs offloaded to
# host memory, what a user after the longest completion would add: what each holds a token then),
# PARTS=grpo_longest_compile (at most 7 minutes: the same with offload for ours tiled, then also
# with its decoder layers compiled and one completion decoded at a time; each probe's pinned host
# memory beside its peak), PARTS=layer_saved (at most 4 minutes: what one decoder layer saves for
# its backward a token on the GPU, eager, tiled, compiled and both, benchmarks/layer_saved_bytes.py),
# PARTS=grpo_long_memory (at most 7 minutes: what is alive at the peak of a step of one prompt's 8
# completions of 16,384 tokens with checkpointing, ours one completion a row (also with each layer's
# MLP in tiles of 896 tokens) and TRL one completion a micro-batch, by the line that allocated it:
# where the per-token cost of the longest runs goes),
# PARTS="compiled_decode attention compiled_generation compiled_grpo" (at most 9 min 20 s:
# StaticDecode's step compiled by inductor against the uncompiled one, by part, in generation
# and in GRPO; and one step's attention computed seven ways, decode_attention.py, the Triton
# kernel among them); PARTS="grpo_checkpointing grpo_offload" (at most 9 minutes: GRPO at 64 x 8 x 256
# with gradient checkpointing, then with its layers' inputs offloaded to host memory, ours padded
# and packed (a budget of 32,768 tokens: one row a micro-batch) against TRL);
# PARTS="triton_decode triton_generation" (about 4 minutes: the decoding
# step with the Triton attention kernel, by part, and generation with it, alone and with the step
# compiled and the draw inside the head); PARTS="fused_decode triton_configs" (about 8 minutes: the
# step at batch 512 with the Triton kernel, compiled, with and without the draw inside the head;
# the kernel alone under each launch of a grid, to choose its default); PARTS=fast_grpo (at most 7
# minutes: GRPO at 64 x 8 x 256 with the fastest decoding step measured, ours_compiled_triton:
# compiled, the Triton kernel, the logits' draw, which beat the draw in the head at 71009fc, and the
# same with the fused projections, against ours and TRL); PARTS=grpo_training (at most 8 minutes:
# the same shape, ours by default, with its decoder layers compiled, with the fastest decoding and
# with both (ours_fastest): at bda33d2 the step's time outside generation was 72% at the fastest);
# PARTS=decode_kernels (about 7 minutes: the step at batch 512 with the Triton kernel, compiled, and
# the kernels that take its time, by name and by kind, for the eager forward and the compiled step;
# then the same step with each layer's q/k/v and gate/up projections as one GEMM each);
# PARTS=step_attention (about 1 minute: the attention alone as a step calls it, 24 caches a graph,
# so none stays in the L2 cache, a window of 384 slots with 257 written; the grouped sdpa and
# the Triton kernel under each launch of the grid, and with its slots split over 8, 16 and 32
# programs a multiprocessor);
# PARTS=distill_memory (about 3 minutes, with its teacher: ours padding-free with checkpointing, and
# what is alive at the peak of one more step, by the line that allocated it); PARTS=distill_parts
# (about 3 minutes: ours padding-free alone, each micro-batch part's divergence sum and tokens by
# step, to see whether a repeated step loss repeats part by part); PARTS=grpo_profile (at most 5.5
# minutes: GRPO's training alone at 64 x 8 x 256, completions of random ids in place of
# generation, ours packed with the prompt shared (eager, then with its decoder layers compiled:
# fewer, fused launches a row) and ours padded (TRL's step is not what the profile asks about),
# and one more step of each under torch.profiler: wall time against GPU busy time, kernels by kind);
# PARTS=grpo_profile_padded (at most 4 minutes: the same for ours padded, eager and with its decoder
# layers compiled: at bf33ce2 the padded step's element-wise kernels took 952 of its 1,917 GPU ms);
# PARTS=packed_attention (at most 3 minutes: one packed GRPO row's attention, forward and
# backward, flex attention as transformers runs it for 14 query heads (keys and values repeated),
# flex with enable_gqa, and sdpa on the same completions padded); PARTS=generation_128,
# PARTS=generation_512 (at most 9 min 20 s each: batches 64, 256 and 512, 256 new tokens a row,
# generate as TRL runs it (first: the ratios' base), ours (its fastest step, then its default)
# and generate with its static cache and compiled decoding) and PARTS=generation_real (at most 8.5
# minutes: the same at batch 512 with completions of log-normal lengths, median 300, p95 1,500,
# at most 2,048 tokens, without `static`, which PARTS=generation_real_static runs alone, at most
# 7 minutes), PARTS=generation_real_512 and PARTS=generation_real_512_static (the same with
# 512-token prompts); PARTS=generation_defaults (about 3.5 minutes: generation at batch 256
# and 512, 128-token prompts, ours' default step (the Triton kernels on CUDA since
# ae1bfaa) against the grouped sdpa's, with the projections fused, and ours_fastest).
# PARTS=baseline_grpo and PARTS=baseline_generation run an earlier commit's own benchmark
# scripts, from its tree unpacked at $BASELINE (default /tmp/baseline; `git archive COMMIT`
# carried and unpacked there), on this run's model: its default GRPO step at 64 x 8 x 256 (about
# 1.5 minutes) and its default generation at batch 512 (about 1 minute). Beside PARTS=fast_grpo
# and PARTS=generation_defaults in the same command they give "today's" speed and this tree's
# on one machine, where the two were measured on different machines before.
set -u
OUT=${OUT:-$PWD/bench-out}
MODEL=${MODEL:-/tmp/bench-model}
BASELINE=${BASELINE:-/tmp/baseline}  # an earlier commit's tree, for the baseline_* parts
TEACHER=${TEACHER:-/tmp/bench-teacher}
PARTS=${PARTS:-"decode grpo generation"}
SNAPSHOT="--memory_snapshot"; PROFILE="--profile"  # the CUDA allocator's history, CUDA kernels: GPU only
if [ "${TINY:-0}" = 1 ]; then X="--device cpu --tiny"; SHAPE="tiny=True, dtype='fp32'"; BATCH=4; BATCHES=4; DEFAULTS_BATCHES=4
     GRPO_REAL="--completion_lengths lognormal:4:7"  # uneven lengths at the tiny scale
     GENERATION_REAL="--completion_lengths lognormal:4:7"
     SNAPSHOT=""; PROFILE=""; LONG_TOKENS=32
     GRPO_BUDGET=64; CKPT_BUDGET=64; DISTILL_BUDGET=0; LONGEST="--memory_fit 8 16 32"
     OFFLOAD="--gradient_checkpointing"  # offload pins host memory, which a CPU-only machine cannot
     TRITON=""  # the Triton kernel runs on CUDA only
     SAVED="--lengths 64 128 --tiled_mlp_tokens 16"
else X=""; SHAPE="tiny=False, dtype='bf16', device='cuda'"; BATCH=512; BATCHES="64 256 512"; GRPO_BUDGET=8192; DISTILL_BUDGET=4096
     DEFAULTS_BATCHES="256 512"
     # With gradient checkpointing a packed token holds its layers' inputs only (43 KB at this
     # shape, against about 1.7 MB without: 10.3 GiB a step's rise for rows of at most 6,528
     # tokens at db70797): a budget above a micro-batch's 17,408 tokens (8 groups
     # of 128 + 8 x 256 with the prompt shared) trains each micro-batch as one row, 8 forwards a
     # step as the padded trainers run, instead of 24 rows of at most 8,192.
     CKPT_BUDGET=32768
     OFFLOAD="--checkpoint_offload"; TRITON="--decode_kernel triton"; SAVED="--device cuda --lengths 4096 16384"
     # The peak's line over three lengths, and where it meets the GPU's memory: with checkpointing
     # the boundary lies past 65,536 tokens a completion (TRL's line at f7eace9 meets an H100's
     # memory at ~82,700), where a step of 64 completions takes many minutes of attention alone.
     # One prompt's 8 completions: one micro-batch, whose peak is a step's of 8 prompts (the same
     # weights, gradients and optimizer state, the same activations a micro-batch; TRL's at
     # 4,096 with 8 prompts, 7.86 GiB at f7eace9, is the check), at an eighth of the probes' time.
     LONGEST="--memory_fit 4096 8192 16384 --prompts 1"; LONG_TOKENS=16384
     GRPO_REAL="--prompts 8 --completion_lengths lognormal:300:1500 --new_tokens 2048 --per_device_train_batch_size 8"
     GENERATION_REAL="--completion_lengths lognormal:300:1500 --new_tokens 2048"; fi
mkdir -p "$OUT"
: > "$OUT/summary.txt"
LOGS=$(mktemp -d /tmp/gpu-record-XXXXXX)  # logs and per-configuration output, packed into $OUT/logs.tar.gz

pack() {  # the logs so far into one archive, weights and checkpoints left out
    local tmp="$OUT/logs.tar.gz.$BASHPID"
    tar -czf "$tmp" -C "$LOGS" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
        --exclude='*.pth' --exclude='checkpoint-*' . 2>/dev/null && mv "$tmp" "$OUT/logs.tar.gz" || rm -f "$tmp"
}
( while sleep 60; do pack; done ) >/dev/null 2>&1 &  # also while a part runs: a run stopped from outside keeps its logs
PACKER=$!
trap 'kill $PACKER 2>/dev/null' EXIT

wanted() {  # wanted NAME: PARTS names it; the model always; the teacher with the distillation part
    case " $PARTS " in *" $1 "*) return 0;; esac
    [ "$1" = model ] || { [ "$1" = teacher ] && [[ " $PARTS " == *" distill"* ]]; }
}

part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    wanted "$name" || return 0
    if [ "${DRY:-0}" = 1 ]; then echo "DRY $name $limit $(printf '%q ' "$@")"; return 0; fi
    timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "$name: rc=$rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
    pack
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import benchmarks.harness.env as e; print(e.versions_line(e.versions()))"; } > "$OUT/machine.txt" 2>&1
part model 30 python3 -c "from benchmarks.builders.model import build_model as b; print(b('$MODEL', $SHAPE, seed=0))"
part decode 45 python3 benchmarks/decode_profile.py $X --batches $BATCHES --repeats 5 --kernels 8 \
    --model_dir "$MODEL" --markdown_out "$OUT/decode.md"
part grpo 330 python3 benchmarks/e2e_grpo.py $X --configs trl ours_shared_prompt ours \
    --warmup_steps 1 --timed_steps 2 --max_tokens_per_batch $GRPO_BUDGET \
    --model_dir "$MODEL" --log_dir "$LOGS/grpo" --markdown_out "$OUT/grpo.md"
part generation 110 python3 benchmarks/generation.py $X --batches $BATCH --repeats 1 --methods ours ours_fused dynamic_eos \
    --model_dir "$MODEL" --log_dir "$LOGS/generation" --markdown_out "$OUT/generation.md"
for PAIRS in 8 16; do NAME=dpo_flex; [ $PAIRS = 8 ] || NAME=dpo_flex$PAIRS
STEP=""; [ "${TINY:-0}" = 1 ] && STEP="--pairs $PAIRS"  # the tiny run's step is 8 pairs
part $NAME 360 python3 benchmarks/e2e_dpo.py $X $STEP --real_lengths ultrafeedback --warmup_steps 2 --timed_steps 2 \
    --configs trl_liger ours_padding_free_fixed_flex ours_shared_prompt_fixed_flex --per_device_train_batch_size $PAIRS \
    --model_dir "$MODEL" --log_dir "$LOGS/$NAME" --markdown_out "$OUT/$NAME.md"; done
# The generation matrix: ours against generate as TRL runs it and generate with its static cache
# and compiled decoding, at three batch sizes, two prompt lengths, fixed and realistic lengths.
for PROMPT in 128 512; do P=$PROMPT; [ "${TINY:-0}" = 1 ] && P=$((PROMPT / 16))  # the tiny run: 8 and 32
part generation_$PROMPT 560 python3 benchmarks/generation.py $X --batches $BATCHES --repeats 1 \
    --prompt_length $P --methods dynamic_eos ours_fastest ours static --model_dir "$MODEL" \
    --log_dir "$LOGS/generation_$PROMPT" --markdown_out "$OUT/generation_$PROMPT.md"; done
# At realistic lengths, batch 512: `generate` as TRL runs it and ours in one part, `generate` with its
# static cache and compiled decoding (its compilation and 2,048-step calls) in a part of its own.
for PROMPT in 128 512; do P=$PROMPT; [ "${TINY:-0}" = 1 ] && P=$((PROMPT / 16))
SUFFIX=""; [ $PROMPT = 128 ] || SUFFIX=_$PROMPT
part generation_real$SUFFIX 500 python3 benchmarks/generation.py $X --batches $BATCH --repeats 1 $GENERATION_REAL \
    --prompt_length $P --methods dynamic_eos ours_fastest ours --model_dir "$MODEL" \
    --log_dir "$LOGS/generation_real$SUFFIX" --markdown_out "$OUT/generation_real$SUFFIX.md"
part generation_real${SUFFIX}_static 400 python3 benchmarks/generation.py $X --batches $BATCH --repeats 1 \
    $GENERATION_REAL --prompt_length $P --methods static --model_dir "$MODEL" \
    --log_dir "$LOGS/generation_real${SUFFIX}_static" --markdown_out "$OUT/generation_real${SUFFIX}_static.md"; done
part baseline_grpo 200 python3 "$BASELINE/benchmarks/e2e_grpo.py" $X --configs ours --warmup_steps 1 --timed_steps 2 \
    --model_dir "$MODEL" --log_dir "$LOGS/baseline_grpo" --markdown_out "$OUT/baseline_grpo.md"
part baseline_generation 150 python3 "$BASELINE/benchmarks/generation.py" $X --batches $BATCH --repeats 3 \
    --methods ours --model_dir "$MODEL" --log_dir "$LOGS/baseline_generation" --markdown_out "$OUT/baseline_generation.md"
part generation_defaults 300 python3 benchmarks/generation.py $X --batches $DEFAULTS_BATCHES --repeats 3 \
    --methods ours_sdpa ours ours_fused_projections ours_fastest --model_dir "$MODEL" \
    --log_dir "$LOGS/generation_defaults" --markdown_out "$OUT/generation_defaults.md"
part e2e_dpo 200 python3 benchmarks/e2e_dpo.py $X --lengths 2048 4096 --configs ours_fused_compile trl_liger \
    --model_dir "$MODEL" --log_dir "$LOGS/e2e_dpo" --markdown_out "$OUT/e2e_dpo.md"
part real_lengths 150 python3 benchmarks/e2e_dpo.py $X --real_lengths ultrafeedback --warmup_steps 2 --timed_steps 2 \
    --configs trl_liger ours_shared_prompt_flex trl_liger_grouped \
    --model_dir "$MODEL" --log_dir "$LOGS/real_lengths" --markdown_out "$OUT/real_lengths.md"
part grpo_real 540 python3 benchmarks/e2e_grpo.py $X --configs trl ours_shared_prompt ours ours_shared_prompt_compiled \
    $GRPO_REAL \
    --warmup_steps 1 --timed_steps 2 --max_tokens_per_batch $GRPO_BUDGET \
    --model_dir "$MODEL" --log_dir "$LOGS/grpo_real" --markdown_out "$OUT/grpo_real.md"
part grpo_longest 560 python3 benchmarks/e2e_grpo.py $X --longest_search --configs trl ours_shared_prompt_rows2 trl_micro1 \
    --max_tokens_per_batch 0 $LONGEST --model_dir "$MODEL" --log_dir "$LOGS/grpo_longest" \
    --markdown_out "$OUT/grpo_longest.md"
part grpo_longest_offload 400 python3 benchmarks/e2e_grpo.py $X --longest_search --configs trl_micro1 \
    ours_shared_prompt_rows2_tiled $OFFLOAD --max_tokens_per_batch 0 $LONGEST --model_dir "$MODEL" \
    --log_dir "$LOGS/grpo_longest_offload" --markdown_out "$OUT/grpo_longest_offload.md"
part grpo_longest_compile 420 python3 benchmarks/e2e_grpo.py $X --longest_search --configs ours_shared_prompt_rows2_tiled \
    ours_shared_prompt_rows1_tiled_compile $OFFLOAD --max_tokens_per_batch 0 $LONGEST --model_dir "$MODEL" \
    --log_dir "$LOGS/grpo_longest_compile" --markdown_out "$OUT/grpo_longest_compile.md"
part layer_saved 240 python3 benchmarks/layer_saved_bytes.py $X $SAVED --markdown_out "$OUT/layer_saved.md"
part grpo_long_memory 420 python3 benchmarks/e2e_grpo.py $X --configs ours_shared_prompt ours_shared_prompt_rows2_tiled trl_micro1 --random_completions \
    --prompts 1 --num_generations 8 --per_device_train_batch_size 8 --new_tokens $LONG_TOKENS --gradient_checkpointing \
    --max_tokens_per_batch 0 --warmup_steps 1 --timed_steps 1 $SNAPSHOT \
    --model_dir "$MODEL" --log_dir "$LOGS/grpo_long_memory" --markdown_out "$OUT/grpo_long_memory.md"
part grpo_profile 330 python3 benchmarks/e2e_grpo.py $X --configs ours_shared_prompt ours_shared_prompt_compile ours --random_completions \
    $PROFILE --warmup_steps 1 --timed_steps 1 --max_tokens_per_batch $GRPO_BUDGET \
    --model_dir "$MODEL" --log_dir "$LOGS/grpo_profile" --markdown_out "$OUT/grpo_profile.md"
part grpo_profile_padded 240 python3 benchmarks/e2e_grpo.py $X --configs ours ours_compile --random_completions \
    $PROFILE --warmup_steps 1 --timed_steps 1 \
    --model_dir "$MODEL" --log_dir "$LOGS/grpo_profile_padded" --markdown_out "$OUT/grpo_profile_padded.md"
part compiled_decode 120 python3 benchmarks/decode_profile.py $X --batches $BATCH --repeats 5 --compile \
    --model_dir "$MODEL" --markdown_out "$OUT/compiled_decode.md"
part attention 90 python3 benchmarks/decode_attention.py $X --repeats 20 --markdown_out "$OUT/attention.md"
part packed_attention 180 python3 benchmarks/packed_attention.py $X --markdown_out "$OUT/packed_attention.md"
part compiled_generation 150 python3 benchmarks/generation.py $X --batches $BATCH --repeats 1 \
    --methods ours ours_compiled --model_dir "$MODEL" --log_dir "$LOGS/compiled_generation" \
    --markdown_out "$OUT/compiled_generation.md"
part fast_grpo 400 python3 benchmarks/e2e_grpo.py $X --configs trl ours ours_compiled_triton \
    ours_compiled_triton_fused_projections \
    --warmup_steps 1 --timed_steps 2 --model_dir "$MODEL" --log_dir "$LOGS/fast_grpo" \
    --markdown_out "$OUT/fast_grpo.md"
part grpo_training 480 python3 benchmarks/e2e_grpo.py $X --configs ours ours_compile \
    ours_compiled_triton_fused_projections ours_fastest \
    --warmup_steps 1 --timed_steps 2 --model_dir "$MODEL" --log_dir "$LOGS/grpo_training" \
    --markdown_out "$OUT/grpo_training.md"
part compiled_grpo 200 python3 benchmarks/e2e_grpo.py $X --configs ours ours_compiled \
    --warmup_steps 1 --timed_steps 2 --model_dir "$MODEL" --log_dir "$LOGS/compiled_grpo" \
    --markdown_out "$OUT/compiled_grpo.md"
part grpo_checkpointing 270 python3 benchmarks/e2e_grpo.py $X --configs trl ours_shared_prompt ours \
    --gradient_checkpointing --warmup_steps 1 --timed_steps 2 --max_tokens_per_batch $CKPT_BUDGET \
    --model_dir "$MODEL" --log_dir "$LOGS/grpo_checkpointing" --markdown_out "$OUT/grpo_checkpointing.md"
part grpo_offload 270 python3 benchmarks/e2e_grpo.py $X --configs trl ours_shared_prompt ours \
    $OFFLOAD --warmup_steps 1 --timed_steps 2 --max_tokens_per_batch $CKPT_BUDGET \
    --model_dir "$MODEL" --log_dir "$LOGS/grpo_offload" --markdown_out "$OUT/grpo_offload.md"
part triton_decode 60 python3 benchmarks/decode_profile.py $X --batches $BATCHES --repeats 5 --kernels 8 \
    $TRITON --model_dir "$MODEL" --markdown_out "$OUT/triton_decode.md"
part fused_decode 330 python3 benchmarks/decode_profile.py $X --batches $BATCH --repeats 5 --compile --fused_sampling \
    $TRITON --model_dir "$MODEL" --markdown_out "$OUT/fused_decode.md"
part decode_kernels 420 python3 benchmarks/decode_profile.py $X --batches $BATCH --repeats 5 --compile --kernels 15 \
    --fuse_projections \
    $TRITON --model_dir "$MODEL" --markdown_out "$OUT/decode_kernels.md"
part step_attention 150 python3 benchmarks/decode_attention.py $X --step_like --slots 384 --repeats 10 \
    --variants grouped_sdpa triton_grouped triton_loads_masked --triton_configs --split_fills 8 16 32 \
    --markdown_out "$OUT/step_attention.md"
part triton_configs 150 python3 benchmarks/decode_attention.py $X --repeats 20 --variants grouped_sdpa triton_grouped triton_loads_masked \
    --triton_configs --slots 256 512 --markdown_out "$OUT/triton_configs.md"
part triton_generation 200 python3 benchmarks/generation.py $X --batches $BATCH --repeats 1 \
    --methods ours ours_triton ours_compiled_triton_fused --model_dir "$MODEL" --log_dir "$LOGS/triton_generation" \
    --markdown_out "$OUT/triton_generation.md"
part teacher 90 python3 -c "from benchmarks.builders.model import build_model as b; print(b('$TEACHER', $SHAPE, seed=1, shape='1.5b'))"
part distill 480 python3 benchmarks/e2e_distill.py $X --configs ours_padding_free trl \
    --max_tokens_per_batch $DISTILL_BUDGET --model_dir "$MODEL" --teacher_dir "$TEACHER" \
    --log_dir "$LOGS/distill" --markdown_out "$OUT/distill.md"
part distill_checkpointing 480 python3 benchmarks/e2e_distill.py $X --configs ours_padding_free trl \
    --gradient_checkpointing --max_tokens_per_batch $DISTILL_BUDGET --model_dir "$MODEL" --teacher_dir "$TEACHER" \
    --log_dir "$LOGS/distill_checkpointing" --markdown_out "$OUT/distill_checkpointing.md"
part distill_memory 240 python3 benchmarks/e2e_distill.py $X --configs ours_padding_free --timed_steps 1 $SNAPSHOT \
    --gradient_checkpointing --max_tokens_per_batch $DISTILL_BUDGET --model_dir "$MODEL" --teacher_dir "$TEACHER" \
    --log_dir "$LOGS/distill_memory" --markdown_out "$OUT/distill_memory.md"
part distill_parts 240 python3 benchmarks/e2e_distill.py $X --configs ours_padding_free --log_parts \
    --max_tokens_per_batch $DISTILL_BUDGET --model_dir "$MODEL" --teacher_dir "$TEACHER" \
    --log_dir "$LOGS/distill_parts" --markdown_out "$OUT/distill_parts.md"
part distill_padded 200 python3 benchmarks/e2e_distill.py $X --configs ours \
    --model_dir "$MODEL" --teacher_dir "$TEACHER" --log_dir "$LOGS/distill_padded" --markdown_out "$OUT/distill_padded.md"
kill $PACKER 2>/dev/null; wait $PACKER 2>/dev/null; pack
rm -rf "$LOGS"; [ "${DRY:-0}" = 1 ] || rm -rf "$MODEL" "$TEACHER"
cat "$OUT/machine.txt" "$OUT/summary.txt"
for f in $PARTS; do echo; cat "$OUT/$f.md" 2>/dev/null || tar -xzOf "$OUT/logs.tar.gz" "./$f.log" 2>/dev/null | tail -5; done
