#!/bin/bash
# Issue 31: retrain glm5next-nano on the H200, then HumanEval acceptance beside glm5-nano.
export PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
G="python3 -m glm5mtp_cli.cli"
mkdir -p /tmp/t /tmp/a
$G train --profile glm5next-nano --out /tmp/g5n --tokenizer profiles/glm5-nano \
  --corpus-packages torch,numpy,huggingface_hub,rich,typer --device cuda --dtype bf16 --seed 0 \
  --steps 4000 --batch-size 32 --seq-len 1024 --lr 0.002 --warmup 100 --mtp-weight 1.0 --chain-weight 1.0 \
  --indexer-weight 1.0 --time-budget ${BUDGET:-400} --eval-every 200 --eval-tokens 131072 --force > /tmp/t/train.log 2>&1
tail -12 /tmp/t/train.log
cp /tmp/g5n/train_report.json /tmp/g5n/config.json /tmp/t/
(cd /tmp/g5n && sha256sum model.safetensors > /tmp/t/sha.txt && split -b 12M model.safetensors $OUT/part_)
tar czf $OUT/t.tgz -C /tmp t
A="acceptance --prompts .out/dev/humaneval164.jsonl --gammas 3 --temperatures 0,0.7 --max-new-tokens 128 --batch-size 8 --device cuda --json"
$G $A --model /tmp/g5n > /tmp/a/acc_next.json 2> /tmp/a/acc_next.log &
$G $A --model glm5-nano > /tmp/a/acc_nano.json 2> /tmp/a/acc_nano.log &
wait
cat /tmp/a/acc_next.log /tmp/a/acc_nano.log
tar czf $OUT/a.tgz -C /tmp a
