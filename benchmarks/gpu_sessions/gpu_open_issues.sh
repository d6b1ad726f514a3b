#!/usr/bin/env bash
# The open issues' GPU measurements on one H200, in calls of under 10 minutes (run from the repository root):
#
#   PARTS="ckpt-1b checks adam8 diag 3b selfcheck-1b" BUDGET=560 bash benchmarks/gpu_sessions/gpu_open_issues.sh
#
# Needs the wheels carried in .whl/ (pydantic and its dependencies) and .whl_fp8/ (torchao 0.18): they are
# unpacked into a private folder on PYTHONPATH; nothing is installed into the machine's Python.
# Each part runs only if its minimum time is left of BUDGET seconds and is stopped when the budget ends.
#   ckpt-1b / ckpt-3b  issue 22: training stall per save, sync vs async, exact resume (bench_checkpoint.py)
#   checks             issue 18: one-rank path exactness; fp8 vs bf16 over 200 steps (gpu_perf_checks.py)
#   exact              issue 18: the one-rank path exactness check alone (gpu_perf_checks.py --skip-fp8)
#   adam8              issue 15: 8-bit AdamW on sharded DTensor parameters (tests/gpu/gpu_eight_bit_adamw.py)
#   diag               issue 19: the probe's SDPA backward against the model's (sdpa_backward_diag.py)
#   3b                 issue 18: 3B seq 8192 x 1, ndparallel vs Accelerate + compile, and fp8 (bench_train.py)
#   selfcheck-1b/-3b   issue 19: --measure and the H200 preset against measured one-GPU throughput
#   trainer            issue 22: the trainer on 1B with asynchronous saves every 10 steps (its own stall log)
#   qlora              issue 15: LoRA on bf16, 4-bit (QLoRA) and 8-bit base weights, 8B, through the trainer
#   bench-1b / -3b     issue 18: ndparallel vs Accelerate + compile (bench_train.py), ndparallel's step profiled
#   lora-mem           issue 19: the planner's 1B LoRA peak-memory rows again (frozen base now stored in bf16)
#   qat                issue 15: the trainer on 1B with qat (int8 inputs, int4 weights) and without, compiled
#   kernel             issue 18: the AdamW kernel that reads bf16 gradients vs the eager update (bf16_grad_adamw.py)
#   loss               issue 18: the chunked cross-entropy alone, per kernel (bench_loss.py)
#   syncs-1b           issue 18: every synchronizing CUDA call of a step, ndparallel and plain FSDP2 (sync_points.py)
#   final-1b / -3b     issue 18: ndparallel vs both peers at their best (and fp8 at 3B), ndparallel profiled
#   grads-1b / -3b     issue 18: bench with and without fp32 .grad (master_grads), against Accelerate + compile
#   probe-8b           issue 19: plan --measure's kernel rates at the 8B's shapes (head_dim 128), not cached
#   attn               issue 19: causal attention per SDPA backend and the varlen kernel, 8B heads (attention_backends.py)
#   qmem               issue 19: peak memory of LoRA on NF4 / int8 / bf16 base weights, 8B and 1B (gpu_memory_sweep.py)
#   qmem-after         the same after the leak fix (eaddab4), with bf16 references, selective, and compiled
#   qmem-fix           LoRA on NF4 / int8 / bf16 bases after the compiled-dequantization fix (290fbf3): compiled
#                      8B and 1B, and eager full checkpointing (the dequantization's passes)
#   qmem-fused         compiled 8B LoRA on NF4 / int8 again, the backward's dequantization compiled (fused.py)
#   attn-rows          issue 19: SDPA (cuDNN) and the varlen kernel vs row length, head_dim 64 (1B) and 128 (8B)
#   profile-32k        issue 19: the 1B's compiled step at 32k tokens per row profiled (attention in the step)
#   pick-1b            issue 19: the planner's one-GPU pick vs every candidate measured, 1B at 32k (planner_pick_check.py)
#   peer-mem           issue 19: allocated peak of the autocast step of ATorch's Llama-2-7B rows, 8 and 16 layers, and
#                      ndparallel's trainer step at the same shapes (gpu_memory_sweep.py --overrides)
#   selfcheck-scale    issue 19: --measure and the preset against measured throughput over lengths: 1B 2k-32k, 3B 16k
#   long-modes         issue 19: packed / one-document rows of 16k-64k without and with selective checkpointing
#                      (the fit saw only full checkpointing there): held-out rows for the planner
#   lora-8b-long       issue 19: 8B LoRA r16 at 8k-32k tokens, three checkpointing modes, eager and compiled (held out)
#   pick-3b            issue 19: the planner's one-GPU pick vs every candidate, 3B at 8k x 2 rows, eager
#   gemm               issue 19: bf16 GEMM rates of the planner's products by shape and tokens (gemm_shapes.py)
# Everything printed goes to $OUT/session.log; each part writes its own files under $OUT.
BUDGET=${BUDGET:-560}
PARTS=${PARTS:-ckpt-1b checks adam8 diag 3b selfcheck-1b}
source benchmarks/gpu_sessions/gpu_session_common.sh

BENCH=(python3 benchmarks/peers/bench_train.py --steps 8 --warmup 2 --json "$OUT/bench.jsonl")
part ckpt-1b 120 python3 benchmarks/components/bench_checkpoint.py --shape 1b --seq 4096 --saves 2 --out "$OUT"
part checks 100 python3 benchmarks/diagnostics/gpu_perf_checks.py --out "$OUT"
part exact 60 python3 benchmarks/diagnostics/gpu_perf_checks.py --out "$OUT" --skip-fp8
part adam8 40 python3 tests/gpu/gpu_eight_bit_adamw.py --out "$OUT"
part diag 20 python3 benchmarks/diagnostics/sdpa_backward_diag.py --out "$OUT"
part 3b 150 "${BENCH[@]}" --shape 3b --seq 8192 --micro-batch 1 --rows ndparallel,accelerate-compile,ndparallel-fp8 \
  --profile "$OUT/profiles.txt" --profile-rows ndparallel
part selfcheck-1b 90 python3 benchmarks/planner/planner_selfcheck.py --out "$OUT" --shapes 1b --seqs 4096x2
part selfcheck-3b 120 python3 benchmarks/planner/planner_selfcheck.py --out "$OUT" --shapes 3b --seqs 8192x1
part ckpt-3b 200 python3 benchmarks/components/bench_checkpoint.py --shape 3b --seq 4096 --saves 2 --out "$OUT"
part trainer 120 python3 -m ndparallel.cli train benchmarks/gpu_sessions/gpu_trainer_smoke.yaml --set save_steps=10 \
  --set output_dir=/tmp/ndp-gpu-smoke-async --set export_hf=false
part qlora 200 python3 benchmarks/components/bench_qlora.py --shape 8b --seq 4096 --steps 20 --out "$OUT" \
  --rows "${QLORA_ROWS:-lora,qlora,lora8}" --compile "${QLORA_COMPILE:-0}"
part lora-mem 90 python3 benchmarks/planner/gpu_memory_sweep.py --cases 1b:4096:2:none:lora,1b:4096:2:selective:lora \
  --out "$OUT/h200_memory_sweep_lora.jsonl"
PROFILE=(--profile "$OUT/profiles.txt" --profile-rows ndparallel)
part bench-1b 100 "${BENCH[@]}" --shape 1b --seq 4096 --micro-batch 2 --rows ndparallel,accelerate-compile "${PROFILE[@]}"
part bench-3b 130 "${BENCH[@]}" --shape 3b --seq 8192 --micro-batch 1 --rows ndparallel,accelerate-compile "${PROFILE[@]}"
SMOKE=(python3 -m ndparallel.cli train benchmarks/gpu_sessions/gpu_trainer_smoke.yaml --set max_steps=20 --set export_hf=false)
part qat 140 bash -c "${SMOKE[*]} --set output_dir=/tmp/ndp-qat --set qat.activation_dtype=int8 \
  --set qat.weight_dtype=int4 && cp /tmp/ndp-qat/metrics.jsonl $OUT/qat_metrics.jsonl && ${SMOKE[*]} \
  --set output_dir=/tmp/ndp-noqat && cp /tmp/ndp-noqat/metrics.jsonl $OUT/noqat_metrics.jsonl"
part kernel 60 python3 tests/gpu/gpu_bf16_grad_adamw.py --out "$OUT"
part loss 40 python3 benchmarks/components/bench_loss.py
part syncs-1b 90 python3 benchmarks/peers/sync_points.py --shape 1b --seq 4096 --micro-batch 2 --rows ndparallel,fsdp2-compile
GRADS_ROWS=ndparallel,ndparallel-master-grads,accelerate-compile
part grads-1b 110 "${BENCH[@]}" --shape 1b --seq 4096 --micro-batch 2 --rows "$GRADS_ROWS" "${PROFILE[@]}"
part grads-3b 150 "${BENCH[@]}" --shape 3b --seq 8192 --micro-batch 1 --rows "$GRADS_ROWS" "${PROFILE[@]}"
part final-1b 110 "${BENCH[@]}" --shape 1b --seq 4096 --micro-batch 2 --rows ndparallel,accelerate-compile,fsdp2-compile \
  "${PROFILE[@]}"
part final-3b 190 "${BENCH[@]}" --shape 3b --seq 8192 --micro-batch 1 \
  --rows ndparallel,accelerate-compile,fsdp2-compile,ndparallel-fp8 "${PROFILE[@]}"
part probe-8b 40 python3 -c "import json, sys; from ndparallel.planner import probe; \
from ndparallel.planner.shapes import load_model_shape; \
spec, eff = probe.measure(load_model_shape('8b'), tokens=16384, device='cuda', use_cache=False); \
json.dump({'gpu': spec.__dict__, 'efficiency': eff.to_dict()}, open(sys.argv[1], 'w'), indent=1); \
print(json.dumps(eff.to_dict()))" "$OUT/planner_probe_8b.json"
part attn 60 python3 benchmarks/long_context/attention_backends.py --shape 8b --rows 8192,32768 --json "$OUT/attention_backends.jsonl"
QCASES=8b:4096:1:none:lora:nf4,8b:4096:1:none:lora:int8,8b:4096:1:none:lora,1b:4096:2:none:lora:nf4,1b:4096:2:none:lora:int8
part qmem 200 python3 benchmarks/planner/gpu_memory_sweep.py --cases "$QCASES" --out "$OUT/h200_memory_sweep_quantized.jsonl"
QCASES2=8b:4096:1:none:lora:nf4,8b:4096:1:none:lora:int8,8b:4096:1:none:lora,8b:4096:1:selective:lora:nf4
QCASES2=$QCASES2,1b:4096:2:none:lora:nf4,1b:4096:2:none:lora:int8,1b:4096:2:none:lora
QCOMPILED=8b:4096:1:none:lora:nf4,8b:4096:1:none:lora:int8,8b:4096:1:none:lora
part qmem-after 300 bash -c "python3 benchmarks/planner/gpu_memory_sweep.py --cases $QCASES2 --out $OUT/h200_memory_sweep_quantized_after.jsonl \
  && python3 benchmarks/planner/gpu_memory_sweep.py --compile --steps 6 --cases $QCOMPILED --out $OUT/h200_memory_sweep_quantized_after.jsonl"
QFIX=8b:4096:1:none:lora:nf4,8b:4096:1:none:lora:int8,8b:4096:1:none:lora
QFIX=$QFIX,1b:4096:2:none:lora:nf4,1b:4096:2:none:lora:int8,1b:4096:2:none:lora
part qmem-fix 300 bash -c "python3 benchmarks/planner/gpu_memory_sweep.py --compile --steps 6 --cases $QFIX \
  --out $OUT/h200_memory_sweep_quantized_fix.jsonl && python3 benchmarks/planner/gpu_memory_sweep.py \
  --cases 8b:4096:1:full:lora:nf4,8b:4096:1:full:lora:int8,8b:4096:1:full:lora --out $OUT/h200_memory_sweep_quantized_fix.jsonl"
part qmem-fused 150 python3 benchmarks/planner/gpu_memory_sweep.py --compile --steps 6 \
  --cases 8b:4096:1:none:lora:nf4,8b:4096:1:none:lora:int8 --out "$OUT/h200_memory_sweep_quantized_fused.jsonl"
part attn-rows 120 bash -c "python3 benchmarks/long_context/attention_backends.py --shape 1b --rows 2048,4096,8192,16384,32768,65536 \
  --tokens 65536 --json $OUT/attention_rows.jsonl && python3 benchmarks/long_context/attention_backends.py --shape 8b \
  --rows 2048,4096,16384,65536 --tokens 65536 --json $OUT/attention_rows.jsonl"
part profile-32k 120 "${BENCH[@]}" --shape 1b --seq 32768 --micro-batch 1 --accumulation 2 --rows ndparallel \
  --profile "$OUT/profile_1b_32k.txt" --profile-rows ndparallel
part pick-1b 200 python3 benchmarks/planner/planner_pick_check.py --shape 1b --seq 32768 --global-batch 2 --micro-batch-sizes 1,2 \
  --out "$OUT"
LLAMA2_7B='"intermediate_size": 11008, "num_key_value_heads": 32, "vocab_size": 32000'
part peer-mem 200 bash -c "python3 benchmarks/peers/peer_memory_autocast.py --layers 8,16 \
  --out $OUT/peer_memory_autocast.jsonl && for n in 8 16; do python3 benchmarks/planner/gpu_memory_sweep.py \
  --overrides '{$LLAMA2_7B, \"num_hidden_layers\": '\$n'}' --cases 8b:4096:4:full --out $OUT/h200_memory_sweep_llama2_7b.jsonl; done"
# one process per row: a process that compiles more than ~3 models hits torch.compile's recompile limit
part selfcheck-scale 420 bash -c "for row in 1b:2048x4 1b:8192x1 1b:32768x1 3b:16384x1; do \
  python3 benchmarks/planner/planner_selfcheck.py --out $OUT/selfcheck-\${row/:/-} --shapes \${row%%:*} --seqs \${row#*:}; done"
part long-modes 200 bash -c "python3 benchmarks/long_context/bench_long_rows.py --shape 1b --lengths 16384,32768,65536 \
  --kinds packed-4096,packed-512,single --ac selective --out $OUT/h200_long_rows_modes.jsonl && \
  python3 benchmarks/long_context/bench_long_rows.py --shape 1b --lengths 16384,32768 --kinds packed-4096,packed-512,single \
  --ac none --out $OUT/h200_long_rows_modes.jsonl"
part lora-8b-long 300 bash -c "python3 benchmarks/planner/gpu_memory_sweep.py \
  --cases 8b:8192:2:none:lora,8b:16384:1:selective:lora,8b:32768:1:full:lora --out $OUT/h200_memory_sweep_lora_8b_long.jsonl \
  && python3 benchmarks/planner/gpu_memory_sweep.py --compile --steps 6 --cases 8b:16384:1:selective:lora \
  --out $OUT/h200_memory_sweep_lora_8b_long.jsonl"
part pick-3b 240 python3 benchmarks/planner/planner_pick_check.py --shape 3b --seq 8192 --global-batch 2 --micro-batch-sizes 1,2 \
  --no-compile --out "$OUT/pick-3b"
part gemm 240 python3 benchmarks/planner/gemm_shapes.py --json "$OUT/gemm_shapes.jsonl"
# issue 33 (longest rows): the fused loss, tiled MLP and offload checked on the GPU; short and long rows against
# the Liger peer; the longest packed row per model (bench_longest_row.py; every attempt in its own process)
part fused-check 100 python3 tests/gpu/gpu_fused_loss.py --out "$OUT/fused_loss_check.jsonl"
part short-1b-liger 200 "${BENCH[@]}" --shape 1b --seq 4096 --micro-batch 2 \
  --rows ndparallel,ndparallel-unfused,fsdp2-compile-liger
LONGEST=(python3 benchmarks/peers/bench_longest_row.py --out "$OUT/longest_row.jsonl")
part long-1b-128k 200 "${LONGEST[@]}" --model 1b --rows ndparallel,ndparallel-fused,ndparallel-cpu-offload --lengths 131072
part long-1b-1m 150 "${LONGEST[@]}" --model 1b --lengths 1048576
part lora-8b-512k 240 bash -c "${LONGEST[*]} --model 8b --lora --lengths 524288; grep -q '\"tokens\": 524288, \"ok\": true' \
  $OUT/longest_row.jsonl || ${LONGEST[*]} --model 8b --lora --lengths 393216"
part longest-1b 150 "${LONGEST[@]}" --model 1b --lengths 2097152
part longest-1b15 150 "${LONGEST[@]}" --model 1b --lengths 1572864
# varlen-2g: is the 1.5M failure FlashAttention's varlen kernel past 2^31 query elements? (the kernel alone)
part varlen-2g 240 python3 benchmarks/diagnostics/varlen_int32_diag.py --out "$OUT"
# offload-cost: the same row without and with offload, in one call, both compiled inside the checkpoint wrapper
part offload-cost 120 "${LONGEST[@]}" --model 1b --rows ndparallel-tiled,ndparallel --lengths 131072 --steps 3
part short-1b-selective 60 "${BENCH[@]}" --shape 1b --seq 4096 --micro-batch 2 --rows ndparallel --ac selective
part longest-3b 100 "${LONGEST[@]}" --model 3b --lengths 524288
part peer-long 240 "${LONGEST[@]}" --model 1b --rows peer-liger --lengths 262144,524288 --steps 1
# after the fused loss's float32 slices and 512 MiB chunks (session 10): the short rows against the Liger peer in
# one run (selective for ours; the peer at its best, no checkpointing), ours without checkpointing, and 131k
# (short-1b-sel-peer took 61 s in session 10; its old minimum of 200 s skipped it in session 11)
part short-1b-sel-peer 110 "${BENCH[@]}" --shape 1b --seq 4096 --micro-batch 2 --ac selective \
  --rows ndparallel,fsdp2-compile-liger
part short-1b-none 70 "${BENCH[@]}" --shape 1b --seq 4096 --micro-batch 2 --rows ndparallel
part long-1b-128k-after 120 "${LONGEST[@]}" --model 1b --rows ndparallel-fused,ndparallel --lengths 131072 --steps 3
echo "[$(date +%T)] session done in $SECONDS s"
