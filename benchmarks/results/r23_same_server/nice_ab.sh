#!/usr/bin/env bash
# row 3 against one server, the API server's nice alternated (0 / 10); CPU seconds of each process per run
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/nice_ab}; mkdir -p $OUT
PORT=8031
.venv/bin/rivulet serve --dtype bfloat16 --port $PORT --max-num-seqs 64 --max-model-len 2048 --disable-uvicorn-access-log > $OUT/serve.log 2>&1 &
API=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 0.5; done
ENG=$(pgrep -P $API -f core_proc | head -1)
echo "api $API engine $ENG"
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
.venv/bin/rivulet bench serve --base-url http://127.0.0.1:$PORT --tokenizer default --input-len 32 --output-len 8 --num-prompts 2 --max-concurrency 2 --ignore-eos --disable-tqdm > /dev/null
for i in 1 2 3; do
  for mode in ${ORDER:-0 10}; do
    renice -n $mode -p $API > /dev/null
    a0=$(cpu $API); e0=$(cpu $ENG)
    .venv/bin/rivulet bench serve --base-url http://127.0.0.1:$PORT --tokenizer default --dataset random --input-len 128 --output-len 128 \
      --num-prompts 128 --max-concurrency 64 --ignore-eos --disable-tqdm --result-json $OUT/nice${mode}_$i.json > /dev/null 2>&1
    a1=$(cpu $API); e1=$(cpu $ENG)
    python3 -c "
import json;p=json.load(open('$OUT/nice${mode}_$i.json'))['points'][0]
print('nice $mode run $i', round(p['output_throughput'],1), 'tok/s tpot', round(p['mean_tpot_ms'],1), 'api cpu s', ($a1-$a0)/100, 'engine cpu s', ($e1-$e0)/100, 'dur', round(p['duration_s'],1))"
  done
done
kill $API; wait $API 2>/dev/null
