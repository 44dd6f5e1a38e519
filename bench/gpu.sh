#!/usr/bin/env bash
# The GPU runs, one phase per argument, on a machine lent through the device tool (see
# ../shared/gpu/README.md): wheels in .whl/, the embedded model's tokenizer in
# .gpu/tokenizer/. Every log and JSON goes to $OUT (or ./gpu-out).
#   bench/gpu.sh bringup smoke profile training serving offload colocate
# (fastapi needs opentelemetry-api, the server orjson, uvloop, httptools: ../shared/gpu/wheels.sh opentelemetry-api
# importlib-metadata orjson uvloop httptools pytest-timeout; the openai wheel imports httpx2, which the image lacks: without
# httpx2 httpcore2 truststore in that list, the tests that import openai are not collected there)
# Issue 23 (serving), in order: bringup steps serving paged profile http colocate; prefix-cache (2026-12-01)
# Issue 24 (training): training grpo profile-dpo precision
# With 15 device minutes (machine start included; 10 minutes and 8 files back per call; a machine idle for 30 s is
# given back), one long call, its phases within one deadline, then short ones while the machine is warm:
#   bash bench/gpu.sh --deadline 565 sdpa cuda-tests gpu-tests training colocate-4   (timeout_s 595; colocate last: it
# waits up to 120 s after its warm-up for the trainer, so it takes what is left)
# --deadline runs each phase under `timeout` with what is left of it, logs to $OUT/gpu.log and tars every phase's
# files into $OUT/results.tgz as it ends, so that a phase cut short costs only itself. Not measured since the H100's
# 2026-11-25 session: CPT's sweep (in `training`), 4 req/s with training on (`colocate-4`), the whole CUDA test list.
# carry .whl and .gpu: the tokenizer is the embedded model's files (engine.model_loader.embedded_model_dir())
# copied into .gpu/tokenizer
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if [ "${1:-}" = "--deadline" ]; then  # bash bench/gpu.sh --deadline SECONDS phase...
  deadline=$2; shift 2; log_dir=$OUT; export OUT=/tmp/gpu-results; mkdir -p "$OUT"
  for phase in "$@"; do
    left=$((deadline - SECONDS))
    if [ $left -lt 25 ]; then echo "=== $phase skipped: ${left} s left" >> "$log_dir/gpu.log"; continue; fi
    timeout -k 5 $left bash "$0" "$phase" 2>&1 | grep --line-buffered -v "weights are RANDOM" >> "$log_dir/gpu.log"
    echo "=== $phase ended (rc ${PIPESTATUS[0]}) at ${SECONDS} s" >> "$log_dir/gpu.log"
    tar czf "$log_dir/results.tgz" -C "$OUT" .
  done
  tail -c 11000 "$log_dir/gpu.log"; exit 0
fi
if [ ! -f /tmp/site/.alchemist-wheels ]; then  # once per machine: a later call on the warm machine skips it
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.alchemist-wheels || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
MODEL=(--model configs/models/llama-3.1-8b --load-format dummy --tokenizer .gpu/tokenizer --dtype bfloat16)
bench() { python3 -m server.cli --log-level WARNING bench "$@"; }

for phase in "$@"; do
  echo "=== $phase $(date -u +%T)"
  case $phase in
    gpu-tests)  # the gpu-marked tests; files whose test-only packages are not carried are skipped
      python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors -rf tests 2>&1 \
        | tee "$OUT/gpu-tests.log" | tail -30
      ;;
    sdpa)  # which SDPA backend a recorded prompt's attention gets on this card (masked, GQA, bfloat16, Llama-3.1-8B's
      # heads): a fused one saves its inputs, the padded K/V a recording keeps rows of; math saves head-repeated copies
      python3 - <<'PY' 2>&1 | tee "$OUT/sdpa.log"
import torch
from torch.nn.attention import SDPBackend
for q_len, keys in ((100, 128), (1000, 1024), (2000, 2048)):
    q = torch.randn(1, 32, q_len, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, keys, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(1, 1, q_len, keys, device="cuda", dtype=torch.bool).tril(keys - q_len)
    for gqa in (True, False):
        kv = k if gqa else k.repeat_interleave(4, dim=1)
        choice = torch._fused_sdp_choice(q, kv, kv, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=None,
                                         enable_gqa=gqa)
        print(f"q {q_len} keys {keys} enable_gqa={gqa}: {SDPBackend(choice).name}")
PY
      ;;
    bringup)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
      bash "$0" gpu-tests cuda-tests
      ;;
    cuda-tests)  # the tiny-model tests on CUDA; CUDA_TESTS narrows them (space-separated files) when time is short
      ALCHEMIST_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --timeout 120 -rf ${CUDA_TESTS:-\
        tests/test_engine_equivalence.py tests/test_training.py tests/test_stash.py tests/test_preemption.py \
        tests/test_sampling.py tests/test_offload.py tests/test_losses.py tests/test_adapter.py \
        tests/test_step_costs.py tests/test_decode_graphs.py tests/test_structured_outputs.py tests/test_fused_rope.py \
        tests/test_fused_norm.py tests/test_serving_copy.py tests/test_backward_sweep.py tests/test_dpo_gradients.py \
        tests/test_gated_mlp.py tests/test_training_copy.py tests/test_serving_steps.py tests/test_shared_prefix_pack.py \
        tests/test_direct_apply.py tests/test_optimizer.py tests/test_attention_mask.py tests/test_causal_prefill.py \
        tests/test_prefix_cache.py} \
        2>&1 | tee "$OUT/cuda-tests.log" | tail -30
      ;;
    prefix-cache)  # requests sharing a 2,000-token beginning, with the prefix cache and without: TTFT, tokens computed
      bench prefix-cache "${MODEL[@]}" --prefix-tokens 2000 --suffix-tokens 64 --num-requests 8 --repeats 3 \
        --json "$OUT/prefix-cache.json"
      ;;
    smoke)  # every benchmark once, short, on the 8B shape
      bench training "${MODEL[@]}" --mode cpt --tokens 512 --repeats 1 --json "$OUT/smoke-cpt.json"
      bench training "${MODEL[@]}" --mode dpo --tokens 512 --repeats 1 --json "$OUT/smoke-dpo.json"
      bench serving "${MODEL[@]}" --num-prompts 4 --max-tokens 16 --repeats 1 \
        --paths engine,hf_generate,hf_generate_batch --kv-cache-bytes 4294967296 --json "$OUT/smoke-serving.json"
      bench offload "${MODEL[@]}" --tokens 512 --entries 2 --repeats 1 --json "$OUT/smoke-offload.json"
      ;;
    profile)  # where an engine step's time goes, beside generate
      bench serving "${MODEL[@]}" --num-prompts 8 --max-tokens 32 --repeats 1 --paths engine,hf_generate \
        --kv-cache-bytes 4294967296 --profile "$OUT/profile-serving.txt" --json "$OUT/profile-serving.json"
      ;;
    training)  # DPO with both responses given: nothing decoded (see --given-responses)
      bench training "${MODEL[@]}" --mode cpt --sweep 512,1024,2048,4096 --repeats 2 \
        --kv-cache-bytes 4294967296 --plot-prefix "$OUT/training-cpt" --json "$OUT/training-cpt.json"
      bench training "${MODEL[@]}" --mode dpo --given-responses --sweep 512,1024,2048,4096 --repeats 2 \
        --kv-cache-bytes 4294967296 --plot-prefix "$OUT/training-dpo" --json "$OUT/training-dpo.json" \
        --profile "$OUT/profile-dpo.txt"
      bench training "${MODEL[@]}" --mode dpo --given-responses --tokens 512 --repeats 1 --max-fit \
        --kv-cache-bytes 4294967296 --json "$OUT/fit-dpo.json"
      bench training "${MODEL[@]}" --mode dpo --tokens 2048 --repeats 2 --one-vs-two-sweeps \
        --kv-cache-bytes 4294967296 --json "$OUT/sweeps-dpo.json"   # the allocator's peak, one sweep vs two
      ;;
    grpo)  # a group of 8 on a 1,024-token prompt: reuse against the dense trainer, then one sweep vs two
      bench training "${MODEL[@]}" --mode grpo --group-size 8 --prompt-tokens 1024 --response-tokens 64 \
        --repeats 2 --kv-cache-bytes 4294967296 --json "$OUT/training-grpo.json"
      bench training "${MODEL[@]}" --mode grpo --group-size 8 --prompt-tokens 1024 --response-tokens 64 \
        --repeats 2 --one-vs-two-sweeps --kv-cache-bytes 4294967296 --json "$OUT/sweeps-grpo.json"
      ;;
    dpo)  # the DPO part of `training` alone, for a session with little device time: reuse against recompute at
      # 512 / 1,024 / 2,048 tokens, the recording column, and where the host's time goes
      bench training "${MODEL[@]}" --mode dpo --given-responses --sweep 512,1024,2048 --repeats 2 \
        --kv-cache-bytes 4294967296 --plot-prefix "$OUT/training-dpo" --json "$OUT/training-dpo.json" \
        --profile "$OUT/profile-dpo.txt"
      ;;
    profile-dpo)  # where the DPO reuse job's time goes on the GPU
      bench training "${MODEL[@]}" --mode dpo --given-responses --tokens 1024 --repeats 1 \
        --kv-cache-bytes 4294967296 --profile "$OUT/profile-dpo.txt" --json "$OUT/profile-dpo.json"
      ;;
    precision)  # the DPO job with PEFT's float32 LoRA math, beside profile-dpo's (bfloat16 copies)
      printf '[train]\nlora_compute_dtype = "float32"\n' > /tmp/float32-lora.toml
      bench training "${MODEL[@]}" --config /tmp/float32-lora.toml --mode dpo --given-responses --tokens 1024 \
        --repeats 1 --kv-cache-bytes 4294967296 --profile "$OUT/profile-dpo-float32-lora.txt" \
        --json "$OUT/profile-dpo-float32-lora.json"
      ;;
    steps)  # host syncs per decode step, attention shapes of a 400-step trace, on the 8B shape
      bench steps "${MODEL[@]}" --kv-cache-bytes 8589934592 --json "$OUT/steps.json"
      ;;
    serving)  # cold (first round) and warm rounds, CUDA graphs against --enforce-eager, against generate
      for n in 1 8 32; do
        bench serving "${MODEL[@]}" --num-prompts $n --max-tokens 64 --repeats 3 --max-num-seqs 32 \
          --paths engine,engine_eager,hf_generate,hf_generate_batch --kv-cache-bytes 8589934592 \
          --json "$OUT/serving-$n.json"
      done
      ;;
    paged)  # decode attention reading the KV pool in place (FlexAttention, compiled; one graph per batch) against
      # gathered (issue 23, item 5): its tests on CUDA, then 1 / 8 / 32 streams with 16-token KV blocks (the default)
      # and with 64 (in case FlexAttention's kernels want larger blocks; PAGED_BLOCKS picks); `engine` gathers here,
      # FlexAttention being the GPU's default (decode_attention = "auto")
      ALCHEMIST_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --timeout 300 -rf tests/test_paged_decode.py \
        2>&1 | tee "$OUT/paged-tests.log" | tail -15
      python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/test_decode_graphs.py 2>&1 | tail -15
      for block in ${PAGED_BLOCKS:-16 64}; do
        for n in 1 8 32; do
          ALCHEMIST_CACHE_BLOCK_SIZE=$block bench serving "${MODEL[@]}" --num-prompts $n --max-tokens 64 --repeats 3 \
            --max-num-seqs 32 --paths engine,engine_flex --decode-attention gather --kv-cache-bytes 8589934592 \
            --json "$OUT/paged-$block-$n.json"
        done
      done
      ;;
    offload)  # a host pool large enough for every offloaded layer of the 8B model's entries
      ALCHEMIST_OFFLOAD_HOST_BUDGET_BYTES=34359738368 bench offload "${MODEL[@]}" --tokens 1024 --entries 3 --repeats 2 --sweep --plot "$OUT/offload.png" \
        --json "$OUT/offload.json"
      ;;
    http)  # streaming over HTTP against the engine alone at 1 / 8 / 32 streams: TPOT, the event loop's CPU per
      # token, the device's wait between steps (issue 23: HTTP within 1.1x of the engine); the server's tokens sent
      # once the next step's device work is queued (server.async_output, on by default on a GPU), then as each
      # step ends, each against the engine alone in the same run
      for mode in on off; do
        bench http "${MODEL[@]}" --streams ${HTTP_STREAMS:-32,8,1} --max-tokens 64 --rounds 3 --max-num-seqs 32 \
          --kv-cache-bytes 8589934592 --async-output $mode --json "$OUT/http-$mode.json"
      done
      ;;
    recording)  # a short recorded prefill over a plain one, trained before the next, and beside three decodes: the
      # default (its step alone, the decodes the next) against the decodes riding along in its forward
      bench recording "${MODEL[@]}" --tokens 100 --repeats 6 --kv-cache-bytes 4294967296 \
        --cases trained,beside_decodes,beside_decodes_shared --json "$OUT/recording.json"
      ;;
    colocate)  # the activation cache sized to the GPU (train.cache_bytes = 0), its longest slice named
      export ALCHEMIST_MODEL_MODEL=configs/models/llama-3.1-8b ALCHEMIST_MODEL_LOAD_FORMAT=dummy \
        ALCHEMIST_MODEL_TOKENIZER=.gpu/tokenizer ALCHEMIST_CACHE_KV_CACHE_BYTES=8589934592
      for rate in 1 4; do  # 140 s at 1 req/s on an H200 (two servers, graphs, 15 s of warm-up each), over 190 s at 4
        bench colocate --rate $rate --seconds 30 --rounds 1 --json "$OUT/colocate-$rate.json"
      done
      ;;
    colocate-4)  # the 4 req/s run alone: how many entries train on their recordings when labels outrun idle gaps
      export ALCHEMIST_MODEL_MODEL=configs/models/llama-3.1-8b ALCHEMIST_MODEL_LOAD_FORMAT=dummy \
        ALCHEMIST_MODEL_TOKENIZER=.gpu/tokenizer ALCHEMIST_CACHE_KV_CACHE_BYTES=8589934592
      bench colocate --rate 4 --seconds 30 --rounds 1 --json "$OUT/colocate-4.json"
      ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
