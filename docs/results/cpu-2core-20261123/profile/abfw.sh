# usage: abfw.sh REPS GPUS fw... ; alternating runs of the frameworks on the issue-13 work
cd /work/main
R=$1; G=$2; shift 2
for r in $(seq 1 $R); do
  if [ $((r % 2)) = 0 ]; then set -- $(printf '%s\n' "$@" | tac); fi
  for m in "$@"; do
    .venv/bin/python -m $m --preset digits --batch-size 128 --momentum 0 --weight-decay 0 --epochs 4 --no-augment --lr-schedule constant --warmup-epochs 0 --gpus $G --output /tmp/prof/abfw2-$m-$r.json >/dev/null 2>&1
    python3 -c "import json,os; d=json.load(open('/tmp/prof/abfw2-$m-$r.json')); print('$r', '$m', round(d['images_per_sec'],1), [round(e['sec'],2) for e in d['epochs']], os.getloadavg()[0])"
  done
done
