R=$OUT/r; mkdir -p $R
step() { name=$1; shift; s=$(date +%s); "$@" > $R/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s" | tee -a $R/steps.txt; tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >> $R/steps.txt
step sklearn python3 -c "import sklearn, scipy; print(sklearn.__version__, scipy.__version__)"
step importtime python3 -X importtime -c "import torch, torch._inductor.compile_fx; import helion"
step compile_time python3 benchmarks/compile_time.py --repeats 1 --profile --out-dir $R/ct
step prof_fp8_b32 python3 benchmarks/profile_decode.py --format fp8_dynamic --batch 32 --variants helion_inductor --timeline --top 40
step sweep_gemm python3 benchmarks/sweep_gemm_configs.py --kernel gemm --suite qwen3_8b --m 8,2,24 --budget-min 3.2 --out-dir $R/sw
