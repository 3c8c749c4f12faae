#!/usr/bin/env bash
# GPU checks in one device call: environment report, the gpu-marked tests (NCCL vs a single-GPU reference,
# Llama, the memory planner), the default run, throughput rows, gossip vs all-reduce, scaling over 1/2/4 GPUs.
# Logs go to $OUT (or ./gpu_out). Each part has its own time limit so one slow part cannot eat the call.
# Usage on the GPU machine: bash benchmarks/gpu_check.sh [tests|default|throughput|gossip|scaling|strategies|medium|llama7b|offload|levers|nobias|best|attention|loss|recipe_s|nanogpt|nanogpt_bench|nanogpt_scaling|recipe_s_scaling|gpt2_b32|profile_loop|loop|fp8_tests|fp8_7b|fp8_numerics|fp8_gpt2|small_levers|llama3_8b|document_mask|document_mask_tests|document_mask_loss|regression|regression1 ...]
# The fp8 parts need torchao: installed from .whl/torchao-*.whl when missing (the GPU machine has no package index).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: some parts change directory
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_hwloc_base_binding_policy=none
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
MPI=${MPI:-mpiexec --oversubscribe}  # MPI=mpiexec for mpich (a CPU check of a part)
# GPUs for the multi-GPU fp8 parts: every GPU here, at most 4 (the issue's machine); NG=2 on a 2-GPU machine.
NG=${NG:-$(( $(nvidia-smi -L | wc -l) < 4 ? $(nvidia-smi -L | wc -l) : 4 ))}
# The training loop issue's recipe S: nanoGPT's Shakespeare-character GPU recipe (configs/shakespeare_char.toml).
RECIPE_S="--dataset text --input_file data/shakespeare/input.txt --tokenizer char --num_layers 6 --num_heads 6 --embed_size 384 --seq_length 256 --batch_size 64 --dropout 0.2 --no-bias --lr 1e-3 --min_lr 1e-4 --beta2 0.99 --warmup_steps 100 --max_steps 5000 --max_epochs 1000 --precision bf16 --compile --eval_batches 200"
parts=${*:-tests default throughput}

fp8_setup() {  # torchao for --precision fp8, from the wheel carried in .whl/ (docs/performance.md)
  python3 -c "import torchao" 2>/dev/null || {
    wheel=$(ls .whl/torchao-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || { echo "no torchao and no .whl/torchao-*.whl to install it from"; return 1; }
    python3 -m pip install -q --no-deps "$wheel" 2>&1 | tail -2 \
      || { python3 -m zipfile -e "$wheel" /tmp/torchao_site && export PYTHONPATH=/tmp/torchao_site:$PYTHONPATH; }
  }
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1 | tee -a "$OUT/env.txt"
}

fresh() {  # remove this script's own runs NAME... of an earlier call on this machine: a run of the same name would
  # resume from their checkpoints (a call that reuses a name trains nothing and resumes at the last call's step)
  for name; do rm -rf "logs/$name" "checkpoints/$name"; done
}

{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } | tee "$OUT/env.txt"

for part in $parts; do case $part in
tests)
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -m gpu tests/gpu/test_gpu.py tests/models/test_llama.py tests/tools/test_model_size.py tests/models/test_fused_loss.py \
    -q -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
default)
  # The README's two commands, on 2 GPUs with NCCL (data/shakespeare/input.txt carried along).
  fresh gpu_default; timeout 240 $MPI -n 2 python3 basic_training.py --max_steps 300 --run_name gpu_default 2>&1 | tr '\r' '\n' \
    | grep -v '^train:' > "$OUT/default.log"; tail -12 "$OUT/default.log"
  timeout 120 $MPI -n 1 python3 basic_training.py --max_epochs -1 --run_name gpu_default --num_tokens 100 2>&1 | tail -5 ;;
throughput)
  B="python3 benchmarks/throughput.py --model_preset gpt2 --vocab_size 50304 --precision bf16 --warmup 8 --steps 20 --out $OUT/throughput.jsonl"
  for args in "--batch_size 16" "--batch_size 16 --compile" "--batch_size 32 --compile"; do
    timeout 200 $MPI -n 1 $B $args >> "$OUT/throughput.log" 2>&1; tail -1 "$OUT/throughput.log"
  done
  for s in full-shard grad-shard no-shard; do
    timeout 200 $MPI -n 2 $B --batch_size 16 --compile --sharding $s >> "$OUT/throughput.log" 2>&1
    tail -1 "$OUT/throughput.log"
  done ;;
gossip)
  # Needs 4 GPUs: NCCL gossip against the mixing matrices, then step time and bytes sent per step of every
  # topology against all-reduce (GPT-2 124M, bf16); the table rows are printed for benchmarks/results/LOG.md.
  timeout ${GOSSIP_TIMEOUT:-900} python3 -m pytest -m gpu tests/parallel/test_decentralized.py -q -s -p no:cacheprovider 2>&1 \
    | tee "$OUT/gossip.log" | grep -E '^\||passed|failed|Error' ;;
scaling)
  # GPT-2 124M, full-shard, bf16, compile, batch 32 per GPU (or SCALING_ARGS) on 1, 2 and 4 GPUs: per-GPU
  # tokens/s should hold.
  B="python3 benchmarks/throughput.py --model_preset gpt2 --vocab_size 50304 --precision bf16 --compile --warmup 8 --steps 20 ${SCALING_ARGS:---batch_size 32} --out $OUT/scaling.jsonl"
  for g in 1 2 4; do
    timeout 150 $MPI -n $g $B >> "$OUT/scaling.log" 2>&1; tail -1 "$OUT/scaling.log"
  done ;;
strategies)
  # GPT-2 124M at batch 32 per GPU: one GPU, then every other strategy on 4 GPUs (hybrid: 2 groups of 2).
  B="python3 benchmarks/throughput.py --model_preset gpt2 --vocab_size 50304 --precision bf16 --compile --warmup 8 --steps 20 --batch_size 32 --out $OUT/strategies.jsonl"
  for s in full-shard grad-shard; do  # at world size 1, grad-shard skips the pointless reshard after forward
    timeout 150 $MPI -n 1 $B --sharding $s >> "$OUT/strategies.log" 2>&1; tail -1 "$OUT/strategies.log"
  done
  for s in grad-shard no-shard "hybrid-full-shard --shard_group_size 2" "hybrid-grad-shard --shard_group_size 2"; do
    timeout 150 $MPI -n 4 $B --sharding $s >> "$OUT/strategies.log" 2>&1; tail -1 "$OUT/strategies.log"
  done ;;
medium)
  # GPT-2 medium (350M), full-shard, batch 32 per GPU, on 1, 2 and 4 GPUs.
  B="python3 benchmarks/throughput.py --model_preset gpt2-medium --vocab_size 50304 --precision bf16 --compile --warmup 8 --steps 20 --batch_size 32 --out $OUT/medium.jsonl"
  for g in 1 2 4; do
    timeout 180 $MPI -n $g $B >> "$OUT/medium.log" 2>&1; tail -1 "$OUT/medium.log"
  done ;;
llama7b)
  # Llama-2-7B shape, T=4096, bf16, full-shard over 4 GPUs, compiled blocks, meta init: full against selective
  # recompute, and the batch each allows.
  B="python3 benchmarks/throughput.py --model_preset llama2-7b --precision bf16 --compile --meta_init --warmup 4 --steps 8 --out $OUT/llama7b.jsonl"
  IFS=';' read -ra variants <<< "${LLAMA_VARIANTS:---activation_checkpoints --batch_size 2;--activation_checkpoints --recompute selective --batch_size 2;--activation_checkpoints --batch_size 4}"
  for args in "${variants[@]}"; do
    timeout ${LLAMA_TIMEOUT:-200} $MPI -n 4 $B $args >> "$OUT/llama7b.log" 2>&1; grep -E '^\|' "$OUT/llama7b.log" | tail -1
    grep -E 'OutOfMemory|Error' "$OUT/llama7b.log" | tail -2
  done ;;
offload)
  # The largest Llama that trains on this 4-GPU machine with parameters, gradients and AdamW state in host
  # memory (16 bytes a parameter): the Llama-2-70B block shape, cut to L blocks, T=4096, batch 1 per GPU.
  free -g | tee "$OUT/free.txt"
  export OMP_NUM_THREADS=$(( $(nproc) / 4 ))  # the CPU optimizer step: one share of the cores per rank
  B="python3 benchmarks/throughput.py --model_preset llama2-70b --precision bf16 --cpu_offload --meta_init --activation_checkpoints --batch_size 1 --warmup 1 --steps 3 --collective_timeout 120 --out $OUT/offload.jsonl"
  for layers in ${OFFLOAD_LAYERS:-35 32}; do
    timeout ${OFFLOAD_TIMEOUT:-280} $MPI -n 4 $B --num_layers $layers >> "$OUT/offload.log" 2>&1; rc=$?
    grep -E '^\||host memory' "$OUT/offload.log" | tail -2; echo "layers $layers: exit $rc"
    [ $rc = 0 ] && break
  done ;;
levers)
  # GPT-2 124M on one GPU, batch 32: FSDP2 against no FSDP at all (a plain replica under autocast, as
  # --data_parallel decentralized builds it), and inductor's tuning knobs.
  B="python3 benchmarks/throughput.py --model_preset gpt2 --vocab_size 50304 --precision bf16 --compile --warmup 8 --steps 20 --batch_size 32 --out $OUT/levers.jsonl"
  for args in "" "--data_parallel decentralized" "-x TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1" "-x TORCHINDUCTOR_MAX_AUTOTUNE=1"; do
    mpi_env=${args%%--data_parallel*}; bench=${args#"$mpi_env"}  # -x VAR=1 goes to mpiexec, the rest to the script
    timeout 300 $MPI $mpi_env -n 1 $B $bench --label "compile ${args:-(FSDP2)}" >> "$OUT/levers.log" 2>&1
    grep '^|' "$OUT/levers.log" | tail -1
  done ;;
nobias)
  # GPT-2 124M without biases (nanoGPT's benchmark setting), one GPU at batch 32 to 160 beside the GPT-2
  # shape with biases; then full-shard over every GPU of the machine at batch 32 (per-GPU scaling).
  B="python3 benchmarks/throughput.py --model_preset gpt2 --vocab_size 50304 --precision bf16 --compile --warmup 8 --steps 20 --out $OUT/nobias.jsonl"
  for args in "--batch_size 32" "--batch_size 32 --no-bias" "--batch_size 64 --no-bias" "--batch_size 96 --no-bias" \
              "--batch_size 128 --no-bias" "--batch_size 160 --no-bias"; do
    timeout 150 $MPI -n 1 $B $args --label "compile $args" >> "$OUT/nobias.log" 2>&1; grep '^|' "$OUT/nobias.log" | tail -1
  done
  gpus=$(nvidia-smi -L | wc -l)
  for g in $(seq 2 $gpus); do
    timeout 150 $MPI -n $g $B --batch_size 32 --no-bias --label "compile --batch_size 32 --no-bias" >> "$OUT/nobias.log" 2>&1
    grep '^|' "$OUT/nobias.log" | tail -1
  done ;;
best)
  # Target 1's setting: GPT-2 124M without biases, batch 160 x 2 micro-steps on one GPU; expandable segments,
  # or the allocator's fragmentation makes batch 160 run out of memory.
  timeout 200 $MPI -x PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -n 1 python3 benchmarks/throughput.py \
    --model_preset gpt2 --vocab_size 50304 --precision bf16 --compile --warmup 6 --steps 12 --no-bias \
    --batch_size 160 --grad_accum_steps 2 --out "$OUT/best.jsonl" 2>&1 | tee "$OUT/best.log" | grep '^|' | tail -1 ;;
attention)
  # Causal attention kernels at GPT-2's shape: cuDNN, flash, memory-efficient SDPA and FlexAttention.
  timeout 150 python3 benchmarks/attention.py 2>&1 | tee "$OUT/attention.log" | grep '^|' ;;
loss)
  # The loss head at GPT-2's shape: the fused Triton loss (a few block sizes) against the compiled PyTorch one.
  timeout 150 python3 benchmarks/loss.py 2>&1 | tee "$OUT/loss.log" | grep -E '^\||^tokens' ;;
recipe_s)
  # The training loop issue, target 1: nanoGPT's Shakespeare-character recipe through basic_training.py on one
  # GPU, the issue's command (the text is the shipped tinyshakespeare): evaluation at the end only, then every
  # 250 steps (best val loss). Wall time includes compilation, evaluation, saving and the 200-token sample.
  # RECIPE_COLD=1: empty compile caches, as on a fresh machine. Each output line is stamped with the seconds since
  # launch (the log's recipe_s_*.log), so the wall splits into startup, compiling, training, evaluation and saving.
  for ev in ${RECIPE_EVALS:-5000 250}; do
    [ "${RECIPE_COLD:-0}" = 1 ] && export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
    start=$SECONDS; fresh recipe_s_$ev
    timeout 420 $MPI -n 1 python3 basic_training.py $RECIPE_S --eval_interval $ev --run_name recipe_s_$ev 2>&1 \
      | python3 -c "import sys, time; t = time.time(); [print(f'{time.time() - t:6.1f} {line.rsplit(chr(13), 1)[-1]}', end='', flush=True) for line in sys.stdin]" \
      > "$OUT/recipe_s_$ev.log"
    echo "recipe S, --eval_interval $ev: exit ${PIPESTATUS[0]}, wall $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    python3 benchmarks/run_summary.py logs/recipe_s_$ev | tee -a "$OUT/summary.txt"
  done ;;
nanogpt)
  # The reference beside it: nanoGPT's own train.py and config/train_shakespeare_char.py, from a copy carried
  # in .ref/nanogpt (never committed), on the same text.
  ( cd .ref/nanogpt && python3 data/shakespeare_char/prepare.py > /dev/null && start=$SECONDS \
    && timeout 420 python3 train.py config/train_shakespeare_char.py > "$OUT/nanogpt.log" 2>&1; \
    echo "nanoGPT: exit $?, wall $((SECONDS - start)) s" | tee -a "$OUT/summary.txt" )
  python3 - "$OUT/nanogpt.log" <<'PY' | tee -a "$OUT/summary.txt"
import re, statistics, sys
text = open(sys.argv[1]).read()
times = [float(t) for i, t in re.findall(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", text) if int(i) >= 100]
vals = [(int(s), float(v)) for s, v in re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", text)]
print(f"nanoGPT: step {statistics.median(times):.2f} ms (median of {len(times)} logged iterations from 100); "
      f"final val {vals[-1][1]:.4f} at step {vals[-1][0]}, best {min(v for _, v in vals):.4f}")
PY
  ;;
nanogpt_bench)
  # Issue 40, target 4: GPT-2 124M without biases on one GPU at each batch of NANO_BATCHES (32 64 96), nanoGPT's step
  # (benchmarks/nanogpt_step.py, its model.py from a copy carried in .ref/nanogpt, never committed) then ours
  # (throughput.py), both timed alike; then nanoGPT's own bench.py at batch 32, and both profiles there
  # (NANO_PROFILE=0 skips them).
  B="python3 benchmarks/throughput.py --model_preset gpt2 --vocab_size 50304 --precision bf16 --compile --no-bias --warmup 8 --steps 20 --out $OUT/nanogpt_bench.jsonl"
  for b in ${NANO_BATCHES:-32 64 96}; do
    timeout 150 python3 benchmarks/nanogpt_step.py --nanogpt .ref/nanogpt --batch_size $b >> "$OUT/nanogpt_bench.log" 2>&1
    grep '^nanoGPT' "$OUT/nanogpt_bench.log" | tail -1
    timeout 150 $MPI -n 1 $B --batch_size $b >> "$OUT/nanogpt_bench.log" 2>&1; grep '^|' "$OUT/nanogpt_bench.log" | tail -1
  done
  ( cd .ref/nanogpt && timeout 150 python3 bench.py --real_data=False --batch_size=32 2>&1 | grep 'time per iteration' \
    | sed 's/^/nanoGPT bench.py, batch 32: /' ) | tee -a "$OUT/nanogpt_bench.log"
  if [ "${NANO_PROFILE:-1}" = 1 ]; then
    timeout 150 python3 benchmarks/nanogpt_step.py --nanogpt .ref/nanogpt --batch_size 32 --profile > "$OUT/nanogpt_profile.log" 2>&1
    timeout 150 $MPI -n 1 python3 benchmarks/profile_step.py --model_preset gpt2 --vocab_size 50304 --precision bf16 \
      --compile --no-bias --batch_size 32 --steps 3 > "$OUT/ours_profile.log" 2>&1
    echo "nanoGPT:"; grep -A9 '^device busy' "$OUT/nanogpt_profile.log"; echo "ours:"; grep -A9 'per step:' "$OUT/ours_profile.log"
  fi ;;
nanogpt_scaling)
  # Target 2's reference: nanoGPT's own DDP (torchrun) on the same recipe, 1 GPU then 2 (and 4 where there are):
  # batch 64 per GPU (its gradient_accumulation_steps is split over the ranks), NANOGPT_ITERS iterations.
  gpus=$(nvidia-smi -L | wc -l)
  ( cd .ref/nanogpt && python3 data/shakespeare_char/prepare.py > /dev/null )
  for g in 1 2 4; do [ $g -le $gpus ] || continue
    ( cd .ref/nanogpt && timeout 240 torchrun --standalone --nproc_per_node=$g train.py config/train_shakespeare_char.py \
        --gradient_accumulation_steps=$g --max_iters=${NANOGPT_ITERS:-600} --eval_interval=100000 > "$OUT/nanogpt_$g.log" 2>&1 )
    echo -n "nanoGPT on $g GPU(s), exit $?: "
    python3 - "$OUT/nanogpt_$g.log" <<'PY' | tee -a "$OUT/summary.txt"
import re, statistics, sys
times = [float(t) for i, t in re.findall(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", open(sys.argv[1]).read()) if int(i) >= 100]
print(f"step {statistics.median(times):.2f} ms (median of {len(times)} logged iterations from 100)" if times else "no steps")
PY
  done ;;
recipe_s_scaling)
  # Target 2: recipe S on 1, 2 and 4 GPUs, batch 64 per GPU, full-shard and no-shard, then with --cuda_graphs
  # (one GPU, no-shard): the step time should stay within 10% of one GPU's. SCALING_REPEATS rounds through the
  # variants (the multi-GPU step can swing between calls: 6.75 and 8.61 ms on one machine); SCALING_MPI_ARGS adds
  # mpiexec options (--bind-to ...); SCALING_TREES runs each variant from each tree (another commit's checkout
  # carried along, as profile_loop's .ref/old) for a before/after within one call.
  gpus=$(nvidia-smi -L | wc -l)
  IFS=';' read -ra variants <<< "${SCALING_VARIANTS:-1 full-shard;2 full-shard;2 no-shard;4 full-shard;4 no-shard;1 full-shard --cuda_graphs;2 no-shard --cuda_graphs;4 no-shard --cuda_graphs}"
  for round in $(seq ${SCALING_REPEATS:-1}); do for v in "${variants[@]}"; do for tree in ${SCALING_TREES:-.}; do
    read -r g s <<< "$v"; [ $g -le $gpus ] || continue; tag=${tree//[.\/]/}; name="rs_${g}_${s// /_}${tag:+_$tag}_r$round"; name=${name//--/}
    ( cd $tree && fresh $name && timeout 240 $MPI ${SCALING_MPI_ARGS:-} -n $g python3 basic_training.py $RECIPE_S \
      --max_steps ${SCALING_STEPS:-600} --eval_interval 0 --eval_batches 20 --num_tokens 0 --sharding $s --run_name $name \
      > "$OUT/$name.log" 2>&1; echo -n "GPUs $g, $s, tree $tree, exit $?: "
      python3 benchmarks/run_summary.py logs/$name --skip_steps 100 ) | tee -a "$OUT/summary.txt"
  done; done; done ;;
small_levers)
  # Target 2's next levers, on recipe S's model (synthetic tokens, no dropout) over SL_GPUS GPUs (4), one GPU first:
  # DDP (graphs by size) with gradient_as_bucket_view (the default) and without (copies), DDP's all-reduces traced into
  # the compiled backward (ca), full-shard (whole_unit.py's one unit: graphs by size) and with graphs forced
  # (benchmarks/ddp_variants.py; SL_VARIANTS="V S;..." picks; "V no-shard --fsdp_unit block" is DDP, plain no-shard
  # the unit on every rank). Each row's last-step loss should agree.
  B="benchmarks/ddp_variants.py --num_layers 6 --num_heads 6 --embed_size 384 --seq_length 256 --vocab_size 65 --batch_size 64 --no-bias --dropout 0.0 --precision bf16 --compile --warmup 10 --steps 60 --out $OUT/small_levers.jsonl"
  timeout 150 $MPI -n 1 python3 $B > "$OUT/small_levers_1.log" 2>&1; echo "1 GPU: exit $?"
  IFS=';' read -ra variants <<< "${SL_VARIANTS:-default no-shard --fsdp_unit block;copies no-shard --fsdp_unit block;ca no-shard --fsdp_unit block;default no-shard;default full-shard;graphs full-shard}"
  for v in "${variants[@]}"; do
    read -r var s <<< "$v"
    DDP_VARIANT=$var timeout 150 $MPI -x DDP_VARIANT -n ${SL_GPUS:-4} python3 $B --sharding $s \
      > "$OUT/small_levers_${var}_${s// /_}.log" 2>&1; echo "$var $s: exit $?"; grep -E 'Error|error:' "$OUT/small_levers_${var}_${s// /_}.log" | tail -2
  done
  python3 -c "import json, sys; [print(r['gpus'], r['sharding'], r['options'], f\"{r['step_ms']:.2f} ms\", f\"loss {r['last_loss']:.5f}\") for r in map(json.loads, open(sys.argv[1]))]" "$OUT/small_levers.jsonl" | tee -a "$OUT/summary.txt" ;;
gpt2_b32)
  # Target 3: GPT-2 124M (biases), batch 32 per GPU, T=1024, through basic_training.py (the Shakespeare
  # characters with the vocabulary padded to 50304: the model's work is GPT-2's), one GPU, then every strategy on 4.
  G="--dataset text --input_file data/shakespeare/input.txt --tokenizer char --vocab_size 50304 --model_preset gpt2 --precision bf16 --compile --batch_size 32 --max_steps ${GPT2_STEPS:-80} --eval_interval 0 --eval_batches 2 --num_tokens 0 --checkpoint_interval 0"
  IFS=';' read -ra variants <<< "${GPT2_VARIANTS:-1 full-shard;4 full-shard;4 full-shard --fsdp_unit block;4 no-shard;4 grad-shard;4 hybrid-full-shard --shard_group_size 2}"
  for v in "${variants[@]}"; do
    read -r g s <<< "$v"; name="g2_${g}_${s// /_}"; name=${name//--/}
    fresh $name; timeout 240 $MPI -n $g python3 basic_training.py $G --sharding $s --run_name $name > "$OUT/$name.log" 2>&1
    echo -n "GPUs $g, $s, exit $?: "; python3 benchmarks/run_summary.py logs/$name --skip_steps 30 | tee -a "$OUT/summary.txt"
  done ;;
profile_loop)
  # Target 4: host time per step against device time, now and at the commit before this work (a copy carried in
  # .ref/old), for the tiny model, recipe S and GPT-2 124M at batch 32, on PROFILE_GPUS GPUs.
  g=${PROFILE_GPUS:-1}
  P="--precision bf16 --compile --steps 6"
  declare -A models=([tiny]="--model_preset tiny --vocab_size 65 --batch_size 16"
                     [recipe_s]="--num_layers 6 --num_heads 6 --embed_size 384 --seq_length 256 --vocab_size 65 --batch_size 64 --no-bias --dropout 0.2"
                     [gpt2]="--model_preset gpt2 --vocab_size 50304 --batch_size 32")
  for m in ${PROFILE_MODELS:-tiny recipe_s gpt2}; do
    for tree in ${PROFILE_TREES:-. .ref/old}; do
      ( cd $tree && timeout 200 $MPI -n $g python3 benchmarks/profile_step.py ${models[$m]} $P ${PROFILE_ARGS:-} > "$OUT/profile_${m}_${g}_${tree//[.\/]/}.log" 2>&1 )
      echo -n "$m on $g GPU(s), $([ $tree = . ] && echo now || echo before): "
      grep -m1 'per step:' "$OUT/profile_${m}_${g}_${tree//[.\/]/}.log" | tee -a "$OUT/summary.txt"
    done
  done ;;
loop)
  # The real training loop (data, logging, stop agreement, eval and save at the end) beside the benchmark's
  # row: GPT-2 124M shape on the Shakespeare characters (vocab padded to 50304), one GPU, batch 32.
  fresh loop; timeout 240 $MPI -n 1 python3 basic_training.py --model_preset gpt2 --vocab_size 50304 --precision bf16 --compile \
    --batch_size 32 --max_steps 100 --log_interval 25 --eval_interval 0 --num_tokens 0 --run_name loop 2>&1 \
    | tr '\r' '\n' | grep -v '^train:' > "$OUT/loop.log"
  cp logs/loop/metrics.jsonl "$OUT/loop_metrics.jsonl"; cat "$OUT/loop_metrics.jsonl" ;;
fp8_tests)
  # --precision fp8 on 2 GPUs against bf16 (every option), resume across precisions, one GPU, gradients: over 9 min
  # on a fresh machine, so in two calls: FP8_TESTS_K="trains_close or one_rank", then "not (trains_close or one_rank)".
  fp8_setup || continue
  timeout ${FP8_TESTS_TIMEOUT:-500} python3 -m pytest -m gpu tests/parallel/test_fp8.py -q -p no:cacheprovider \
    ${FP8_TESTS_K:+-k "$FP8_TESTS_K"} 2>&1 | tee "$OUT/fp8_tests.log" | tail -15 ;;
fp8_7b)
  # Issue 21, target 1: Llama-2-7B, T=4096, full-shard over NG GPUs (4), compiled blocks, selective recompute, meta
  # init: bf16, fp8 tensorwise (float8 all-gather) and fp8 rowwise in one call, batch FP8_7B_BATCH per GPU (2; at
  # 4, expandable segments, as memory is tight). Then the planner's estimate for each, beside the measured peak.
  fp8_setup || continue
  # FP8_7B_SHARDING: full-shard (default) or grad-shard (2x H200, batch 3: fp8 +4.7%, at +6 GB a GPU); FP8_7B_ARGS:
  # more flags (e.g. "--reduce_precision bf16").
  b=${FP8_7B_BATCH:-2}; alloc=""; [ "$b" -gt 2 ] && alloc="-x PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
  sh=${FP8_7B_SHARDING:-full-shard}
  B="python3 benchmarks/throughput.py --model_preset llama2-7b --compile --meta_init --activation_checkpoints --recompute selective --sharding $sh --batch_size $b --warmup ${FP8_7B_WARMUP:-4} --steps ${FP8_7B_STEPS:-8} --out $OUT/fp8_7b.jsonl ${FP8_7B_ARGS:-}"
  for p in ${FP8_7B_PRECISIONS:-bf16 tensorwise rowwise}; do
    prec="--precision fp8 --fp8_recipe $p"; [ $p = bf16 ] && prec="--precision bf16"
    timeout ${FP8_7B_TIMEOUT:-160} $MPI $alloc -n $NG $B $prec >> "$OUT/fp8_7b.log" 2>&1
    echo "$p, batch $b: exit $?"; grep -E 'OutOfMemory|Error' "$OUT/fp8_7b.log" | tail -2
    python3 -m minimal_fsdp plan --model_preset llama2-7b --gpus $NG --batch_size $b $prec \
      | grep -E "^$sh +selective +no " | awk -v p=$p '{print "  planner, " p ": " $6 " GiB estimated"}'
  done
  python3 benchmarks/fp8_table.py "$OUT/fp8_7b.jsonl" | tee -a "$OUT/fp8_summary.md" ;;
fp8_numerics)
  # Issue 21, target 2: a Llama of ~1B parameters (20 blocks, width 2048, 16 heads over 4 kv heads, SwiGLU 5632,
  # vocab 32000: the Shakespeare characters with the embedding padded to a real vocabulary's size) trained
  # NUMERICS_STEPS steps in bf16 and in fp8 tensorwise from the same seed on NG GPUs (4); both loss curves in one plot
  # ($OUT/fp8_numerics.png, if matplotlib is here; the metrics.jsonl files come back under $OUT/logs either way).
  fp8_setup || continue
  # NUMERICS_MODEL replaces the model's flags: issue 40's target 5 runs the 8B shape, e.g. NUMERICS_MODEL="--model_preset
  # llama3-8b --vocab_size 128256 --seq_length 2048 --batch_size 1 --activation_checkpoints --recompute selective".
  M=${NUMERICS_MODEL:---vocab_size 32000 --model llama --num_layers 20 --embed_size 2048 --num_heads 16 --num_kv_heads 4 --intermediate_size 5632 --seq_length 512 --batch_size 4}
  N="--dataset text --input_file data/shakespeare/input.txt --tokenizer char $M --max_steps ${NUMERICS_STEPS:-300} --lr 3e-4 --warmup_steps 30 --log_interval 10 --eval_interval 100 --eval_batches 20 --checkpoint_interval 0 --num_tokens 0 --compile --meta_init --log_dir $OUT/logs --checkpoint_dir /tmp/fp8_numerics ${NUMERICS_SEED:+--seed $NUMERICS_SEED} ${NUMERICS_ARGS:-}"
  # NUMERICS_SKIP_SAVE=1 ends each run once its last val loss is in metrics.jsonl: the final save of an 8B (~96 GB
  # of weights and AdamW state) is not what this part measures, and two of them would fill a small disk.
  # NUMERICS_ARGS: flags after the recipe's, which they override ("--warmup_steps 100": the 8B spiked with 30).
  # NUMERICS_SEED: another seed; NUMERICS_PRECISIONS="bf16" (or "fp8"): one run a call, where two do not fit in one
  # (the comparison below is then skipped: plot the two calls' logs after, minimal-fsdp plot A B).
  for p in ${NUMERICS_PRECISIONS:-bf16 fp8}; do
    rm -rf "$OUT/logs/fp8n_$p" /tmp/fp8_numerics/fp8n_$p
    # the blocks in float8 too (--fp8_layers all): the default model is 2048 wide, where auto keeps them bf16
    layers=""; [ $p = fp8 ] && layers="--fp8_layers all"
    ( timeout ${NUMERICS_TIMEOUT:-200} $MPI -n $NG python3 basic_training.py $N --precision $p $layers --run_name fp8n_$p 2>&1 \
      | tr '\r' '\n' | grep -v '^train:' > "$OUT/fp8n_$p.log"; echo "$p: exit ${PIPESTATUS[0]}" ) &
    run=$!
    if [ "${NUMERICS_SKIP_SAVE:-0}" = 1 ]; then
      until ! kill -0 $run 2>/dev/null || python3 -c "import json, sys; sys.exit(not any(r.get('step') == ${NUMERICS_STEPS:-300} and 'val_loss' in r for r in map(json.loads, open('$OUT/logs/fp8n_$p/metrics.jsonl'))))" 2>/dev/null; do sleep 2; done
      pkill -f "run_name fp8n_$p" && echo "$p: ended after its last evaluation (NUMERICS_SKIP_SAVE=1)"
    fi
    wait $run; rm -rf /tmp/fp8_numerics/fp8n_$p; grep -E '^step|Error|error' "$OUT/fp8n_$p.log" | tail -3
  done
  [ -f "$OUT/logs/fp8n_bf16/metrics.jsonl" ] && [ -f "$OUT/logs/fp8n_fp8/metrics.jsonl" ] || continue
  python3 -m minimal_fsdp plot "$OUT/logs/fp8n_bf16" "$OUT/logs/fp8n_fp8" --out "$OUT/fp8_numerics.png"
  python3 - "$OUT/logs" <<'PY' | tee -a "$OUT/fp8_summary.md"
import sys
from minimal_fsdp.tools.plot import read_metrics
runs = {p: read_metrics(f"{sys.argv[1]}/fp8n_{p}") for p in ("bf16", "fp8")}
for field in ("loss", "val_loss"):
    (steps, bf16), (fp8_steps, fp8) = runs["bf16"][field], runs["fp8"][field]
    assert steps == fp8_steps, (steps, fp8_steps)
    worst = max(abs(f / b - 1) for s, b, f in zip(steps, bf16, fp8) if s > 50)
    print(f"{field} at step {steps[-1]}: bf16 {bf16[-1]:.4f}, fp8 {fp8[-1]:.4f}, "
          f"fp8/bf16 - 1 = {fp8[-1] / bf16[-1] - 1:+.2%} (largest |difference| after step 50: {worst:.2%})")
PY
  ;;
fp8_gpt2)
  # Issue 21, target 3: GPT-2 124M on one GPU at its best setting (no biases, batch 160 x 2 micro-steps, expandable
  # segments) and GPT-2 XL on NG GPUs (4) (full-shard, meta init, batch 16, no recompute), bf16 against fp8 tensorwise,
  # compiled (FP8_GPT2_PRECISIONS="bf16 tensorwise rowwise" adds rowwise; FP8_GPT2_SMALL=0 skips GPT-2 124M;
  # GPT2_XL_ARGS="--batch_size 24" another batch; GPT2_XL_MPI_ARGS="-x PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True").
  fp8_setup || continue
  S="python3 benchmarks/throughput.py --vocab_size 50304 --compile --warmup 6 --steps 12 --out $OUT/fp8_gpt2.jsonl"
  for p in ${FP8_GPT2_PRECISIONS:-bf16 tensorwise}; do
    [ "${FP8_GPT2_SMALL:-1}" = 0 ] && break
    prec="--precision fp8 --fp8_recipe $p"; [ $p = bf16 ] && prec="--precision bf16"
    timeout 150 $MPI -x PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -n 1 $S --model_preset gpt2 \
      ${GPT2_SMALL_ARGS:---no-bias --batch_size 160 --grad_accum_steps 2} $prec >> "$OUT/fp8_gpt2.log" 2>&1
    echo "gpt2 $p: exit $?"
  done
  for p in ${FP8_GPT2_PRECISIONS:-bf16 tensorwise}; do
    prec="--precision fp8 --fp8_recipe $p"; [ $p = bf16 ] && prec="--precision bf16"
    timeout 200 $MPI ${GPT2_XL_MPI_ARGS:-} -n $NG $S --model_preset gpt2-xl --meta_init ${GPT2_XL_ARGS:---batch_size 16} $prec \
      >> "$OUT/fp8_gpt2.log" 2>&1
    echo "gpt2-xl $p: exit $?"
  done
  grep -E 'OutOfMemory|Error' "$OUT/fp8_gpt2.log" | tail -3
  python3 benchmarks/fp8_table.py "$OUT/fp8_gpt2.jsonl" | tee -a "$OUT/fp8_summary.md" ;;
llama3_8b)
  # Issue 40, target 1: Llama 3 8B (llama3-8b: 128K vocabulary, 8 kv heads, rope theta 500000 with Llama 3.1's
  # scaling) at T=8192, full-shard over NG GPUs (4), compiled blocks, selective recompute, meta init, batch LLAMA3_BATCH
  # per GPU (1): bf16, fp8 tensorwise and fp8 rowwise (LLAMA3_PRECISIONS; the first call compiles for minutes, so
  # one or two precisions a call), each row with tokens/s per GPU and MFU, and the planner's estimate beside it.
  fp8_setup || continue
  # LLAMA3_SHARDING (full-shard) and LLAMA3_RECOMPUTE (selective; none: no checkpointing) choose the layout: on 2x
  # H200 fp8 ran 1.8-4.6% faster as grad-shard (no backward all-gather, no second cast of each weight) at +6 GB a GPU.
  b=${LLAMA3_BATCH:-1}; sh=${LLAMA3_SHARDING:-full-shard}; rc=${LLAMA3_RECOMPUTE:-selective}
  ckpt="--activation_checkpoints --recompute $rc"; [ $rc = none ] && ckpt=""
  # LLAMA3_ARGS: more flags, e.g. "--reduce_precision bf16" (+0.8-1.5% on 2x H200). Fastest on 4x H200:
  # LLAMA3_SHARDING=grad-shard LLAMA3_RECOMPUTE=none LLAMA3_BATCH=3 (fp8 ~15,000; bf16 at batch 2: 10,867).
  B="python3 benchmarks/throughput.py --model_preset llama3-8b --compile --meta_init $ckpt --sharding $sh --batch_size $b --warmup ${LLAMA3_WARMUP:-4} --steps ${LLAMA3_STEPS:-8} --out $OUT/llama3_8b.jsonl ${LLAMA3_ARGS:-}"
  for p in ${LLAMA3_PRECISIONS:-bf16 tensorwise rowwise}; do
    prec="--precision fp8 --fp8_recipe $p"; [ $p = bf16 ] && prec="--precision bf16"
    timeout ${LLAMA3_TIMEOUT:-280} $MPI -x PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -n $NG $B $prec \
      >> "$OUT/llama3_8b.log" 2>&1
    echo "$p, batch $b: exit $?"; grep -E '^\|' "$OUT/llama3_8b.log" | tail -1
    grep -E 'OutOfMemory|Error' "$OUT/llama3_8b.log" | tail -2
    python3 -m minimal_fsdp plan --model_preset llama3-8b --gpus $NG --batch_size $b $prec \
      | grep -E "^$sh +$rc +no " | awk -v p=$p '{print "  planner, " p ": " $6 " GiB estimated"}'
  done
  python3 benchmarks/fp8_table.py "$OUT/llama3_8b.jsonl" | tee -a "$OUT/llama3_summary.md" ;;
document_mask)
  # Issue 40, target 3: Llama 3 8B at T=8192 on NG GPUs (4), as llama3_8b runs it (DOCMASK_PRECISION: bf16), on
  # windows packing documents of ~DOCMASK_LENGTH (2048) tokens, the same tokens in three runs: plain causal attention,
  # --document_mask through FlexAttention (the default kernel), and through torch's varlen flash attention
  # (MINIMAL_FSDP_DOCUMENT_KERNEL=varlen); then attention alone at the 8B shape: SDPA causal, FlexAttention causal
  # and document-masked, varlen (benchmarks/document_attention.py). Each 8B run took ~70 s on 4x H200: the limits
  # keep the part under 9 minutes. DOCMASK_RUNS picks some of the three (e.g. "flex varlen").
  fp8_setup || continue
  B="python3 benchmarks/document_mask.py --model_preset llama3-8b --compile --meta_init --activation_checkpoints --recompute selective --batch_size ${LLAMA3_BATCH:-1} --document_length ${DOCMASK_LENGTH:-2048} --warmup ${LLAMA3_WARMUP:-4} --steps ${LLAMA3_STEPS:-8} ${DOCMASK_PRECISION:---precision bf16}"
  for run in ${DOCMASK_RUNS:-causal flex varlen}; do
    mask=--document_mask; [ $run = causal ] && mask=
    timeout ${LLAMA3_TIMEOUT:-140} $MPI -x PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      -x MINIMAL_FSDP_DOCUMENT_KERNEL=${run/causal/flex} -n $NG $B $mask >> "$OUT/document_mask.log" 2>&1
    echo "$run: exit $?"; grep -E '^\|' "$OUT/document_mask.log" | tail -1
    grep -E 'OutOfMemory|Error' "$OUT/document_mask.log" | tail -2
  done
  timeout ${DOCMASK_ATTENTION_TIMEOUT:-100} python3 benchmarks/document_attention.py --document_length ${DOCMASK_LENGTH:-2048} 2>&1 \
    | tee -a "$OUT/document_attention.md" | grep -E '^\||Error' ;;
regression)
  # Issue 37's acceptance: recipe S, GPT-2 124M and Llama-2-7B throughput of this tree against an older one
  # (REGRESSION_OLD: a directory holding e.g. `git archive a2aeb3d`), in one call. Recipe S (REGRESSION_STEPS steps,
  # 1500) runs on GPU 0 old then new while GPT-2 124M (batch 32, through basic_training.py) runs on GPU 1 new then
  # old; then the 7B (throughput.py, bf16, selective recompute, batch 3) on NG GPUs, old then new.
  old=${REGRESSION_OLD:?REGRESSION_OLD=<older tree>}; new=$PWD; rs=${REGRESSION_STEPS:-1500}
  G="--dataset text --input_file data/shakespeare/input.txt --tokenizer char --vocab_size 50304 --model_preset gpt2 --precision bf16 --compile --batch_size 32 --max_steps 80 --eval_interval 0 --eval_batches 2 --num_tokens 0 --checkpoint_interval 0"
  one() {  # TREE GPU NAME SKIP FLAGS...: one basic_training.py run in TREE on GPU, its summary line
    local tree=$1 gpu=$2 name=$3 skip=$4; shift 4
    ( cd $tree && rm -rf logs/$name checkpoints/$name && PYTHONPATH=$tree CUDA_VISIBLE_DEVICES=$gpu timeout 300 $MPI -n 1 \
      python3 basic_training.py "$@" --run_name $name > "$OUT/$name.log" 2>&1; echo "$name exit $?" ) \
      && PYTHONPATH=$new python3 $new/benchmarks/run_summary.py $tree/logs/$name --skip_steps $skip | tee -a "$OUT/summary.txt"
  }
  ( for t in old new; do tree=$old; [ $t = new ] && tree=$new
      one $tree 0 rs_$t 300 $RECIPE_S --max_steps $rs --eval_interval $rs --eval_batches 20; done ) &
  ( for t in new old; do tree=$old; [ $t = new ] && tree=$new
      one $tree 1 g2_$t 30 $G; done ) &
  wait
  B="benchmarks/throughput.py --model_preset llama2-7b --precision bf16 --compile --meta_init --activation_checkpoints --recompute selective --batch_size 3 --warmup 4 --steps ${REGRESSION_7B_STEPS:-8}"
  for t in old new; do tree=$old; [ $t = new ] && tree=$new
    ( cd $tree && PYTHONPATH=$tree timeout 240 $MPI -x PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -n $NG \
      python3 $B --out "$OUT/regression_7b_$t.jsonl" > "$OUT/regression_7b_$t.log" 2>&1; echo "7B $t: exit $?" )
    grep -E '^\|' "$OUT/regression_7b_$t.log" | tail -1 | tee -a "$OUT/summary.txt"
  done ;;
regression1)
  # The same check on one GPU: recipe S (REGRESSION_STEPS, 1000; its val loss at the end) and GPT-2 124M's
  # throughput (batch 32, compiled), this tree against REGRESSION_OLD alternating old, new, old, new.
  old=${REGRESSION_OLD:?REGRESSION_OLD=<older tree>}; new=$PWD; rs=${REGRESSION_STEPS:-1000}
  G="benchmarks/throughput.py --model_preset gpt2 --vocab_size 50304 --precision bf16 --compile --warmup 8 --steps 20 --batch_size 32"
  for rep in 1 2; do for t in old new; do tree=$old; [ $t = new ] && tree=$new; name=rs_${t}_$rep
    ( cd $tree && rm -rf logs/$name checkpoints/$name && PYTHONPATH=$tree timeout 200 $MPI -n 1 python3 basic_training.py \
      $RECIPE_S --max_steps $rs --eval_interval $rs --eval_batches 20 --num_tokens 0 --run_name $name > "$OUT/$name.log" 2>&1
      echo "recipe S $t $rep: exit $?" )
    PYTHONPATH=$new python3 $new/benchmarks/run_summary.py $tree/logs/$name --skip_steps 300 | tee -a "$OUT/summary.txt"
    ( cd $tree && PYTHONPATH=$tree timeout 200 python3 $G > "$OUT/g2_${t}_$rep.log" 2>&1; echo "GPT-2 $t $rep: exit $?" )
    echo "GPT-2 124M $t $rep: $(grep -E '^\|' "$OUT/g2_${t}_$rep.log" | tail -1)" | tee -a "$OUT/summary.txt"
  done; done ;;
document_mask_loss)
  # Issue 40, target 3's second half: on a packed corpus (each of the shipped Shakespeare's 7,222 speeches one
  # document, ~40 tokens of a 4096-piece sentencepiece, so a window of 1024 packs ~25 documents), the val loss at
  # equal steps with --document_mask against plain causal attention, one GPU (DML_MODEL: GPT-2 124M's shape).
  python3 -c "import json; t = open('data/shakespeare/input.txt').read(); f = open('/tmp/speeches.jsonl', 'w'); [f.write(json.dumps({'text': p.strip()}) + chr(10)) for p in t.split(chr(10) * 2) if p.strip()]"
  D="--dataset text --input_file /tmp/speeches.jsonl --tokenizer sentencepiece --vocab_size 4096 ${DML_MODEL:---model_preset gpt2 --seq_length 1024 --batch_size 16} --precision bf16 --compile --max_steps ${DML_STEPS:-600} --warmup_steps 60 --lr 6e-4 --log_interval 20 --eval_interval 100 --eval_batches 20 --checkpoint_interval 0 --num_tokens 0 --log_dir $OUT/logs"
  for mask in no-document_mask document_mask; do
    fresh dml_$mask; rm -rf $OUT/logs/dml_$mask
    timeout ${DML_TIMEOUT:-280} $MPI -n 1 python3 basic_training.py $D --$mask --run_name dml_$mask 2>&1 | tr '\r' '\n' \
      | grep -v '^train:' > "$OUT/dml_$mask.log"; echo "$mask: exit ${PIPESTATUS[0]}"
    python3 benchmarks/run_summary.py $OUT/logs/dml_$mask --skip_steps 100 | tee -a "$OUT/summary.txt"
  done ;;
document_mask_tests)
  # The document mask's GPU tests: varlen flash attention against dense SDPA and each document alone (GPT, Llama),
  # in compiled blocks under selective recompute, and a one-GPU training run through each CUDA kernel.
  timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -m gpu tests/models/test_document_mask.py -q -p no:cacheprovider 2>&1 \
    | tee "$OUT/document_mask_tests.log" | tail -15 ;;
esac; done
