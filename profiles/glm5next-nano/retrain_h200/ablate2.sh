#!/bin/bash
# Ablation rows for glm5next-nano's MTP (issue 31): short joint runs side by side on one H200.
export PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
G="python3 -m glm5mtp_cli.cli"
P=torch,numpy,huggingface_hub,rich,typer
PX=$P,triton,_pytest,hypothesis,matplotlib
T="train --tokenizer profiles/glm5-nano --device cuda --warmup 30 --time-budget ${BUDGET:-330} --eval-every 100 --force"
mkdir -p $OUT/abl
# tokenize both corpora once (the cache is shared by the rows)
$G $T --profile glm5next-nano --out /tmp/w1 --steps 1 --corpus-packages $P > $OUT/abl/warm1.log 2>&1 &
$G $T --profile glm5next-nano --out /tmp/w2 --steps 1 --corpus-packages $PX > $OUT/abl/warm2.log 2>&1 &
wait
nvidia-smi --query-gpu=memory.used --format=csv > $OUT/abl/smi0.txt
row() { name=$1; shift; mkdir -p $OUT/abl/$name
  $G $T --out /tmp/abl/$name --steps ${STEPS:-300} "$@" > $OUT/abl/$name/train.log 2>&1
  cp /tmp/abl/$name/train_report.json $OUT/abl/$name/ 2>/dev/null
  $G acceptance --model /tmp/abl/$name --prompts .out/dev/humaneval164.jsonl --limit 40 --gammas 3 \
     --temperatures 0,0.7 --max-new-tokens 128 --device cuda --json > $OUT/abl/$name/acc.json 2> $OUT/abl/$name/acc.log
}
row chain03 --profile glm5next-nano --corpus-packages $P --chain-weight 0.3 &
row mtp1chain1 --profile glm5next-nano --corpus-packages $P --mtp-weight 1.0 --chain-weight 1.0 &
row mtp1corpus --profile glm5next-nano --corpus-packages $PX --mtp-weight 1.0 &
row mtp2 --profile glm5next-nano --corpus-packages $P --mtp-weight 2.0 &
sleep 120; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv > $OUT/abl/smi1.txt
wait
python3 - <<'P'
import json, os, glob
out = os.environ["OUT"]
for d in sorted(glob.glob(f"{out}/abl/*/")):
    n = os.path.basename(d.rstrip("/"))
    try:
        r = json.load(open(d + "train_report.json")); h = r["heldout"]
        line = f"{n:12s} steps {r['steps_done']} {r['train_wall_s']}s tce {h['target_ce']:.3f} mce {h['mtp_ce']:.3f} agr {h['mtp_target_agreement']:.3f} cce {h.get('chain_ce',0):.3f} cagr {h.get('chain_target_agreement',0):.3f} peak {r['peak_device_bytes']/2**30:.1f}G"
    except Exception as e:
        line = f"{n}: no report ({e})"
    try:
        a = json.load(open(d + "acc.json"))
        for run in a["runs"]:
            if run["acceptance"]:
                acc = run["acceptance"]
                line += f" | T{run['temperature']} MAL {acc['mean_acceptance_length']:.3f} pos {[round(x, 2) for x in acc['per_position']]} same {run.get('same_tokens_as_gamma0')}"
    except Exception as e:
        line += f" | no acc ({e})"
    print(line)
P
cd $OUT && tar czf abl.tgz abl && rm -rf abl
