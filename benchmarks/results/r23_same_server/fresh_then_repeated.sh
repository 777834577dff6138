set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/fvs}; mkdir -p $OUT; PORT=8032
.venv/bin/rivulet serve --dtype bfloat16 --port $PORT --max-num-seqs 64 --max-model-len 2048 --disable-uvicorn-access-log > $OUT/serve.log 2>&1 &
API=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 0.5; done
.venv/bin/rivulet bench serve --base-url http://127.0.0.1:$PORT --tokenizer default --input-len 32 --output-len 8 --num-prompts 2 --max-concurrency 2 --ignore-eos --disable-tqdm > /dev/null
for i in 1 2 3; do
  .venv/bin/rivulet bench serve --base-url http://127.0.0.1:$PORT --tokenizer default --dataset random --input-len 128 --output-len 128 \
      --num-prompts 128 --max-concurrency 64 --ignore-eos --disable-tqdm --result-json $OUT/run$i.json > /dev/null 2>&1
  python3 -c "
import json;p=json.load(open('$OUT/run$i.json'))['points'][0]
print('run $i', round(p['output_throughput'],1), 'tok/s tpot', round(p['mean_tpot_ms'],1), 'dur', round(p['duration_s'],1))"
done
grep faulted $OUT/serve.log
kill $API; wait $API 2>/dev/null
