# Sourced by the drivers beside it (gemma3.sh, bamba.sh, moe.sh): the environment every GPU run
# shares (NVLink multicast off, hub offline), $OUT, what the machine has, and the commands'
# shorthands: $cli, $io (a short latency run), `summary TITLE LINES FILE`.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton, transformers, ray; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "ray", ray.__version__, "gpus", torch.cuda.device_count())'
cli="python3 -m launch.cli"
io="--input-len 512 --output-len 128 --num-iters 2 --num-iters-warmup 1"
summary() { echo "== $1"; tail -n "${2:-20}" "$OUT/$3"; }
