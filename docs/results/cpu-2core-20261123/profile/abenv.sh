# usage: abenv.sh REPS variant... ; runs jax-pmap on the d2l work at 1 device with DPX=variant, alternating
cd /tmp/ci-clone
R=$1; shift
for r in $(seq 1 $R); do
  for v in "$@"; do
    DPX=$v .venv/bin/python -m frameworks.jax_pmap --preset digits --batch-size 128 --momentum 0 --weight-decay 0 --epochs 4 --no-augment --lr-schedule constant --warmup-epochs 0 --gpus ${GPUS:-1} --output /tmp/prof/abenv-$v-$r.json >/dev/null 2>&1
    python3 -c "import json; d=json.load(open('/tmp/prof/abenv-$v-$r.json')); print('$r', '$v', round(d['images_per_sec'],1))"
  done
done
