set -x
export PYTHONPATH=. OMP_NUM_THREADS=8 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv
T0=$(date +%s)
/usr/bin/time -f "wall %e s, max RSS %M KB" python3 -m tpsim capture --model deepseek-v3 --override num_hidden_layers=4 \
  --device cuda --tp 1 --convention sglang --layers=-1,1,2 --seq-len 64 --out $OUT/v3_l4.safetensors 2>&1 | grep -v "^tpsim: TP"
echo "V3 L4 done at $(( $(date +%s) - T0 )) s"
/usr/bin/time -f "wall %e s, max RSS %M KB" python3 -m tpsim export --model deepseek-v2-lite --dtype bfloat16 --out /tmp/v2l 2>&1
ls -la /tmp/v2l | head -5; ls /tmp/v2l | wc -l; du -sh /tmp/v2l
echo "export done at $(( $(date +%s) - T0 )) s"
/usr/bin/time -f "wall %e s, max RSS %M KB" python3 -m tpsim capture --model /tmp/v2l --device cuda --tp 1 --seq-len 64 --out $OUT/v2l_ckpt.safetensors 2>&1
echo "ckpt capture done at $(( $(date +%s) - T0 )) s"
/usr/bin/time -f "wall %e s, max RSS %M KB" python3 -m tpsim capture --model deepseek-v2-lite --device cuda --dtype bfloat16 --tp 1 --seq-len 64 --out $OUT/v2l_seeded.safetensors 2>&1
echo "seeded capture done at $(( $(date +%s) - T0 )) s"
python3 - <<'PY'
import os
from safetensors import safe_open
o = os.environ["OUT"]
with safe_open(f"{o}/v2l_ckpt.safetensors", "pt") as a, safe_open(f"{o}/v2l_seeded.safetensors", "pt") as b:
    x, y = a.get_tensor("aux_hidden_states"), b.get_tensor("aux_hidden_states")
    print("V2-Lite round trip: shapes", tuple(x.shape), tuple(y.shape), "bitwise equal:", bool((x.view(-1).view(__import__('torch').int16) == y.view(-1).view(__import__('torch').int16)).all()))
    print(a.metadata())
PY
