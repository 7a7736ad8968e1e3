#!/usr/bin/env bash
# Trains the readers: encoder + LoRA pretrained to read merged text, from unlabeled text only
# (the train sides of the shipped data: CommitPack code, Fashion review texts, tree texts).
# The recipe is the one the probes in results/README.md chose. Each run resumes if its folder
# holds a checkpoint, logs readability R on held-out text every 100 steps, and ends with:
#   ktm pack-reader (shipped stages) -> ktm/readers/NAME (fp16): k2 -> smollm2-135m-k2,
#                                       k4e -> smollm2-135m-k4
#   ktm eval --readability -> results/readers/STAGE_readability.json (64 windows per held-out set)
#   metrics.jsonl + run.json -> results/readers/runs/STAGE/ (the R-per-CPU-minute curve)
# Usage: bash results/readers/train_readers.sh [STAGE...]   (default: k2 k4r k4c k4e, the shipped
#        readers' whole chain: the K=4 reader is k4r continued by k4c, then by k4e)
# Stages:
#   k2   K=2 from scratch.
#   k4r  K=4 as recursive merging (--inner-k 2: a K=2 merge of two K=2 merges), the inner level's
#        encoder and the LoRA from the K=2 reader: the first of the shipped K=4 reader's three
#        stages (it was shipped alone until k4e).
#   k4   K=4 with a fresh K=4 encoder, LoRA from the K=2 reader (the plain K curriculum; not
#        shipped: k4r reads better, results/README.md section 1.3). When it was run it was packed
#        and evaluated as smollm2-135m-k4; unpacked stages are evaluated from their checkpoint.
#   k3   K=3 the same way (K=3 has no recursion: 3 is prime), 200 steps; not shipped: the
#        experiment reads it from runs/readers/k3/checkpoint (or $K3_READER).
#   k2d, k4d  a second, distillation phase on a reader: start from the shipped K=2 / K=4 reader
#        (--init; K2_READER / K4_READER=DIR for another) and train 200 more steps with the
#        objectives distill + ae=0.5 at half the learning rates (results/README.md section 1.3).
#        Run after k2 / k4r: `train_readers.sh k2 k4r k2d k4d` is the whole chain.
#   k4c  a continuation of k4r (runs/readers/k4r/checkpoint; when it was run here it started
#        from k4r packed in fp16, the K=4 reader shipped then): the same objectives (lm + ae)
#        for 300 more steps at half the learning rates, a second cosine, on windows k4r did not
#        see (seed 1; K4_READER=DIR for another start).
#   k4e  a second continuation, of k4c, packed as the shipped K=4 reader: 600 more steps of
#        the same objectives at 3e-4 / 3e-5 (a gentler re-warm than k4c's 5e-4, whose dip cost
#        its first 100 steps), seed 2 (K4C_READER=DIR; default runs/readers/k4c/checkpoint, so
#        run after k4c).
#   k2c  a continuation of the shipped K=2 reader the same way: 450 steps at 3e-4 / 3e-5, seed 1
#        (K2_READER=DIR for another start).
#   k4f  a third continuation, of k4e (K4E_READER=DIR; default runs/readers/k4e/checkpoint): only
#        the objective R measures (lm) on only the two domains it is measured on (code, reviews),
#        300 steps at 1.5e-4 / 1.5e-5, seed 3; the probe k2c-lm did this at K=2.
#   k2s, k4s  the shipped K=2 / K=4 reader continued with consecutive positions (--init READER
#        --no-spread-positions: each merged block at the next position, the only layout llama.cpp
#        and vLLM accept), 150 steps of the recipe's objectives at 3e-4 / 3e-5, seed 4; k2s is
#        packed as smollm2-135m-k2-seq (K2_READER / K4_READER=DIR for another start).
#   k4s2 a second consecutive-position continuation, of k4s (K4S_READER=DIR; default
#        runs/readers/k4s/checkpoint): the same 150 steps again, seed 5; packed as
#        smollm2-135m-k4-seq.
#   k4chat the shipped smollm2-135m-k4-seq (K4SEQ_READER=DIR for another start) continued 150
#        steps the same way with half its lm and ae windows read as chats (--chat-share 0.5),
#        seed 6; packed as smollm2-135m-k4-chat, the reader for ktm serve --history-budget.
#   k4qa the shipped smollm2-135m-k4-seq (K4SEQ_READER=DIR for another start) continued 300 steps
#        with its LoRA on the merged rows only (--lora-scope merged: plain tokens read by the base
#        LM as it is), the recall objective beside lm and ae (a question copied from the window,
#        read plain after it), half of the windows at a ratio in [2.5, 4] laid out by the question
#        allocator (or even, or rules), at 5e-4 / 5e-5, seed 7; packed as smollm2-135m-k4-qa, read
#        by default at ratio 4 with the question allocator (results/question/README.md).
#   k4qac the shipped smollm2-135m-k4-qa (K4QA_READER=DIR for another start) continued 150 steps
#        the same way with half its windows read as chats (--chat-share 0.5): lm and ae as
#        k4chat's, recall as one user message (the document, then a one-line question quoting
#        the cue) answered as the assistant, the way ktm serve's chat reads a question about a
#        pasted document; recall weighted 1, at 3e-4 / 3e-5, seed 8. Not shipped: a needle asked
#        in a chat was answered less often than by k4qa (results/question/chat_reader.json).
#   k4qad the shipped smollm2-135m-k4-qa (K4QA_READER=DIR for another start) continued 100 steps
#        with the answer objective beside k4qa's: a question quoting a cue asked in a chat, the
#        target the base LM's own greedy answer to the chat read plain, KL to its reading (the
#        reader learns to answer a chat as the base answers it); lm, ae=0.5, recall=0.5,
#        answer=1, at 3e-4 / 3e-5, seed 9 (results/question/chat_reader.json).
#   k4qad2 k4qad (K4QAD_READER=DIR, by default runs/readers/k4qad/checkpoint) continued 100 steps
#        with the answer objective weighted 3 (lm 0.5, ae 0.25, recall 0.5), seed 10.
#   k4qae the shipped smollm2-135m-k4-qa (K4QA_READER=DIR for another start) continued 100 steps
#        with k4qad2's weights, its answer windows' documents up to 512 tokens
#        (--answer-context-tokens; the others' 256), nearer the documents users paste into a
#        chat, seed 11; packed as smollm2-135m-k4-qa-chat, read by default as k4qa is: the
#        question reader that answers a chat (results/question/README.md).
# k2 comes first: the others start from the K=2 reader, by default the shipped one
# (K2_READER=DIR to use another). One thread per run; run two stages at once on two cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
recipe=(--slot-weights --mlp-ratio 0.5 --plain-prefix 1 --spread-positions --lora-r 16 --lora-alpha 64
        --sources code reviews trees=0.5 --objectives lm ae=0.5
        --batch-size 8 --lr 1e-3 --encoder-lr 1e-4 --schedule cosine --warmup-steps 20
        --eval-every 100 --n-eval-windows 32 --save-every 25 --seed 0 --threads 1 --no-progress)
# k2 was started at 600 steps and resumed, at step 175, with this shorter schedule (a stream's
# order does not depend on its length; only the cosine's span changed)
# the distillation phase (k2d, k4d): later flags win over the recipe's
distill=(--objectives distill ae=0.5 --lr 5e-4 --encoder-lr 5e-5 --warmup-steps 10 --eval-every 50)
# the continuation (k4c): the recipe's objectives, half its learning rates, new windows (seed 1)
cont=(--lr 5e-4 --encoder-lr 5e-5 --warmup-steps 10 --seed 1)
# the gentler continuations (k4e, k2c)
gentle=(--lr 3e-4 --encoder-lr 3e-5 --warmup-steps 10)
# the lm-only continuation (k4f): later flags win over the recipe's sources and objectives
lmonly=(--sources code reviews --objectives lm --lr 1.5e-4 --encoder-lr 1.5e-5 --warmup-steps 10)
# the consecutive-position continuations (k2s, k4s): later flags win over the recipe's
seq=(--no-spread-positions "${gentle[@]}" --seed 4 --eval-every 50)
declare -A steps=([k2]=400 [k3]=200 [k4]=450 [k4r]=450 [k2d]=200 [k4d]=200 [k4c]=300 [k4e]=600 [k2c]=450 [k4f]=300 [k2s]=150 [k4s]=150 [k4s2]=150 [k4chat]=150 [k4qa]=300 [k4qac]=150 [k4qad]=100 [k4qad2]=100 [k4qae]=100)
declare -A packed=([k2]=smollm2-135m-k2 [k4e]=smollm2-135m-k4 [k2s]=smollm2-135m-k2-seq
                   [k4s2]=smollm2-135m-k4-seq [k4chat]=smollm2-135m-k4-chat
                   [k4qa]=smollm2-135m-k4-qa [k4qae]=smollm2-135m-k4-qa-chat)
# the prompt layout a packed reader is read with by default (ktm pack-reader --ratio --allocator)
declare -A layout=([k4qa]="--ratio 4 --allocator question"
                   [k4qae]="--ratio 4 --allocator question")
# the earlier stages a packed stage continues (their committed curves), its reader.json lineage
declare -A chain=([k4e]="k2 k4r k4c" [k4f]="k2 k4r k4c k4e" [k2s]="k2"
                  [k4s2]="k2 k4r k4c k4e k4s" [k4qa]="k2 k4r k4c k4e k4s k4s2"
                  [k4qae]="k2 k4r k4c k4e k4s k4s2 k4qa")
[ $# -gt 0 ] || set -- k2 k4r k4c k4e
for name in "$@"; do
  [ -n "${steps[$name]:-}" ] || { echo "unknown stage $name: expected k2, k3, k4, k4r, k2d, k4d, k4c, k4e, k2c, k4f, k2s, k4s, k4s2, k4chat, k4qa, k4qac, k4qad, k4qad2 or k4qae" >&2; exit 2; }
  k=${name:1:1}
  out=runs/readers/$name
  start=(--init-adapter "${K2_READER:-smollm2-135m-k2}"); extra=()
  case $name in
    k2) start=() ;;
    k4r) extra=(--inner-k 2) ;;
    k2d) start=(--init "${K2_READER:-smollm2-135m-k2}"); extra=("${distill[@]}") ;;
    k4d) start=(--init "${K4_READER:-smollm2-135m-k4}"); extra=("${distill[@]}") ;;
    k4c) start=(--init "${K4_READER:-runs/readers/k4r/checkpoint}"); extra=("${cont[@]}") ;;
    k4e) start=(--init "${K4C_READER:-runs/readers/k4c/checkpoint}"); extra=("${gentle[@]}" --seed 2) ;;
    k2c) start=(--init "${K2_READER:-smollm2-135m-k2}"); extra=("${gentle[@]}" --seed 1) ;;
    k4f) start=(--init "${K4E_READER:-runs/readers/k4e/checkpoint}"); extra=("${lmonly[@]}" --seed 3) ;;
    k2s) start=(--init "${K2_READER:-smollm2-135m-k2}"); extra=("${seq[@]}") ;;
    k4s) start=(--init "${K4_READER:-smollm2-135m-k4}"); extra=("${seq[@]}") ;;
    k4s2) start=(--init "${K4S_READER:-runs/readers/k4s/checkpoint}"); extra=("${seq[@]}" --seed 5) ;;
    k4chat) start=(--init "${K4SEQ_READER:-smollm2-135m-k4-seq}"); extra=(--chat-share 0.5 "${seq[@]}" --seed 6) ;;
    k4qa) start=(--init "${K4SEQ_READER:-smollm2-135m-k4-seq}")
          extra=(--no-spread-positions --lora-scope merged --objectives lm ae=0.5 recall=0.5
                 --mixed-share 0.5 --ratio-range 2.5 4 --mixed-signals question=2 even rules
                 --lr 5e-4 --encoder-lr 5e-5 --warmup-steps 20 --eval-every 50 --seed 7) ;;
    k4qac) start=(--init "${K4QA_READER:-smollm2-135m-k4-qa}")
           extra=(--no-spread-positions --lora-scope merged --objectives lm ae=0.5 recall=1
                  --chat-share 0.5 --mixed-share 0.5 --ratio-range 2.5 4
                  --mixed-signals question=2 even rules --lr 3e-4 --encoder-lr 3e-5
                  --warmup-steps 10 --eval-every 50 --seed 8) ;;
    k4qad) start=(--init "${K4QA_READER:-smollm2-135m-k4-qa}")
           extra=(--no-spread-positions --lora-scope merged --objectives lm ae=0.5 recall=0.5
                  answer=1 --mixed-share 0.5 --ratio-range 2.5 4
                  --mixed-signals question=2 even rules --lr 3e-4 --encoder-lr 3e-5
                  --warmup-steps 10 --eval-every 50 --seed 9) ;;
    k4qad2) start=(--init "${K4QAD_READER:-runs/readers/k4qad/checkpoint}")
            extra=(--no-spread-positions --lora-scope merged --objectives lm=0.5 ae=0.25
                   recall=0.5 answer=3 --mixed-share 0.5 --ratio-range 2.5 4
                   --mixed-signals question=2 even rules --lr 3e-4 --encoder-lr 3e-5
                   --warmup-steps 10 --eval-every 50 --seed 10) ;;
    k4qae) start=(--init "${K4QA_READER:-smollm2-135m-k4-qa}")
           extra=(--no-spread-positions --lora-scope merged --objectives lm=0.5 ae=0.25
                  recall=0.5 answer=3 --answer-context-tokens 512 --mixed-share 0.5
                  --ratio-range 2.5 4 --mixed-signals question=2 even rules --lr 3e-4
                  --encoder-lr 3e-5 --warmup-steps 10 --eval-every 50 --seed 11) ;;
  esac
  # a stopped stage resumes from its checkpoint, built as it started (the --init reader's settings)
  [ -d "$out/checkpoint" ] && start+=(--resume)
  ktm pretrain --k "$k" "${recipe[@]}" --max-steps "${steps[$name]}" --out-dir "$out" "${start[@]}" "${extra[@]}"
  mkdir -p "results/readers/runs/$name"
  cp "$out/metrics.jsonl" "$out/run.json" "results/readers/runs/$name/"
  ckpt=$out/checkpoint
  if [ -n "${packed[$name]:-}" ]; then
    after=()
    for stage in ${chain[$name]:-}; do after+=("results/readers/runs/$stage"); done
    # shellcheck disable=SC2086
    ktm pack-reader "$out" --name "${packed[$name]}" ${after[@]+--after "${after[@]}"} \
      ${layout[$name]:-}
    ckpt=${packed[$name]}
  fi
  ktm eval --checkpoint "$ckpt" --readability reviews code --n-windows 64 --threads 1 \
    --method "reader-$name" --json "results/readers/${name}_readability.json"
done
