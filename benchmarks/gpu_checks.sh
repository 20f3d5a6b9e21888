#!/bin/bash
# One device call (docs/performance.md, "How the GPU numbers were taken"): install, GPU
# tests, the joint-graph tests on this machine's torch, then the given benchmark steps.
#   bash benchmarks/gpu_checks.sh tests sweep        # step names: tests, sweep, sparse, variants, varianttests, train, demo, matmul, qsa, presample, finite, attnbwd
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # expecttest is not in the GPU image
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { echo "install failed"; tail "$OUT/install.log"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    tests)
      timeout 420 python3 -m pytest -q -m gpu tests/ > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?: $(tail -1 "$OUT/gpu_tests.log")"
      timeout 200 python3 -m pytest -q -m "not inductor and not gpu" tests/test_sparse_backward.py tests/test_partition.py \
        tests/test_registry.py tests/test_variants.py > "$OUT/cpu_side.log" 2>&1 || true
      echo "joint-graph tests on this torch: $(tail -1 "$OUT/cpu_side.log")" ;;
    sweep) timeout 300 python3 benchmarks/sweep_hytopk_config.py --seq 32768 --deadline 200 ${SWEEP_CONFIGS:+--configs $SWEEP_CONFIGS} \
             > "$OUT/sweep.md" 2> "$OUT/sweep.log"; echo "sweep rc=$?"; cat "$OUT/sweep.md" ;;
    sparse) timeout 300 python3 benchmarks/bench_sparse_backward.py --seqs ${SPARSE_SEQS:-8192,16384,32768} \
             > "$OUT/sparse.md" 2> "$OUT/sparse.log"; echo "sparse rc=$?"; cat "$OUT/sparse.md" ;;
    variants) timeout 300 python3 benchmarks/bench_variants.py --seqs ${VARIANT_SEQS:-8192,32768} \
             > "$OUT/variants.md" 2> "$OUT/variants.log"; echo "variants rc=$?"; cat "$OUT/variants.md" ;;
    train)  # the example's own defaults beyond S = 512: k = S/32, S/32 queries a sequence, 360 dense (S = 128, 512) + 300 warm-up + 200 sparse + 200 control steps, reference 200 (50 beyond 8K), 50 of them also at the same weights
      timeout ${TRAIN_TIMEOUT:-570} python3 examples/train_dsa.py --device cuda --seq ${TRAIN_SEQ:-8192} ${TRAIN_STEPS:+--steps $TRAIN_STEPS} \
        --out "$OUT/train_dsa_loss.png" > "$OUT/train.log" 2>&1; echo "train rc=$?"
      grep -E "step [0-9]+/[0-9]+:" "$OUT/train.log" | tail -4; grep -vE "^  .* step [0-9]+/[0-9]+:" "$OUT/train.log" | tail -32 ;;
    demo) timeout 400 python3 examples/demo.py --seq ${DEMO_SEQ:-16384} > "$OUT/demo.log" 2>&1; echo "demo rc=$?"; tail -12 "$OUT/demo.log" ;;
    matmul) timeout 120 python3 benchmarks/matmul_rate.py > "$OUT/matmul.md" 2> "$OUT/matmul.log"; echo "matmul rc=$?"; cat "$OUT/matmul.md" ;;
    qsa) timeout 200 python3 benchmarks/sweep_qsa_config.py --seq 32768 --keys ${QSA_KEYS:-fp32} ${QSA_CONFIGS:+--configs $QSA_CONFIGS} \
             > "$OUT/qsa.md" 2> "$OUT/qsa.log"; echo "qsa rc=$?"; cat "$OUT/qsa.md" ;;
    presample)  # the sampled estimate's A/B (docs/kernel.md, "Selecting"): the default (presample=128 up to 128K keys) against no estimate, iid and struct, 32K and 128K
      for args in "--seq 32768 --inputs iid" "--seq 32768 --inputs struct" "--seq 131072 --inputs iid" "--seq 131072 --inputs struct"; do
        timeout 150 python3 benchmarks/sweep_hytopk_config.py $args --configs "presample=0;default;presample=0;default" \
          >> "$OUT/presample.md" 2>> "$OUT/presample.log"; echo "presample $args rc=$?"
      done
      grep -E "^S=|^\| (default|presample)" "$OUT/presample.md" ;;
    finite) timeout 300 python3 benchmarks/bench_finite_check.py --sizes ${FINITE_SIZES:-32768} > "$OUT/finite.md" 2> "$OUT/finite.log"
             echo "finite rc=$?"; cat "$OUT/finite.md" ;;
    attnbwd) timeout 540 python3 benchmarks/bench_attention_backward.py --seqs ${ATTN_SEQS:-8192,32768,131072} \
             --shapes ${ATTN_SHAPES:-per_head,mqa16,mqa128} > "$OUT/attnbwd.md" 2> "$OUT/attnbwd.log"
             echo "attnbwd rc=$?"; cat "$OUT/attnbwd.md"; tail -3 "$OUT/attnbwd.log" ;;
    varianttests) timeout 300 python3 -m pytest -q -m gpu tests/test_variants.py > "$OUT/variant_tests.log" 2>&1
             echo "variant gpu tests rc=$?: $(tail -1 "$OUT/variant_tests.log")" ;;
    *) echo "unknown step $step" ;;
  esac
  echo "[$step took $(( $(date +%s) - t0 )) s]"
done
