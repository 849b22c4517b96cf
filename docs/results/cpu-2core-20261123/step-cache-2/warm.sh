cd /work/main
for fw in jax-pmap jax-shard; do for n in 1 2; do
  mod=${fw/-/_}
  for side in "--no-step-cache" "--step-cache"; do .venv/bin/python -m frameworks.$mod --preset digits --gpus $n $side --output /tmp/exp/warmup.json > /dev/null 2>&1; done
  echo "== $fw $n $(uptime)"
  .venv/bin/python -m benchmarks.ab --framework $fw --a=--no-step-cache --b=--step-cache --repeat 3 --out docs/results/cpu-2core-20261123/step-cache-2/$fw-$n -- --preset digits --gpus $n
done; done
echo "== end $(uptime)"
