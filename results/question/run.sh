#!/usr/bin/env bash
# Question-aware reading, measured: question tasks over held-out documents (the Python standard
# library's modules no project file imports, ktm.tasks.haystack), each reading side by side on
# the same documents and questions, every row a `ktm eval` result
# (results/question/TASK/LENGTH/METHOD.json: accuracy, by depth, positions, prefill seconds).
#
# Lengths in the model's tokens; 8,000 stands for 8k (a document of 8,192 tokens leaves the
# 8,192-position model no room for its question read plain).
# Methods (the budget: at most 30 % of the document: the readers at ratio 4 read a quarter of
# its positions, every other reading keeps 30 % of its tokens or KV):
#   plain            the base model reading everything
#   truncate         the base model reading the document's last 30 % of tokens
#   bm25             the base model reading the document's lines BM25 ranks best against the
#                    question, up to 30 % of its tokens, in their order (nothing trained)
#   k4, k2           the shipped consecutive-position readers, every block at K
#   k4-question      the shipped K=4 reader at ratio 4, the question allocator
#   qa-k4            the question reader (LoRA on merged rows only) at K=4
#   qa-question      the question reader as it loads: ratio 4, the question allocator
#   qa-wide          the question reader at ratio 4.01, just past its largest level: its units are
#                    the deeper level's (K=8), so that at the same positions as qa-question the
#                    document's rest is read deeper and more of the question's lines plain (the
#                    split between merged and plain at an equal budget)
#   qa-deep          the question reader at ratio 8, its deeper level: the document's units read at
#                    K=8 (its K=4 merges merged again), the question's lines plain
#   qachat-question, qachat-deep   the same two readings by the question reader for chats
#                    (smollm2-135m-k4-qa-chat: k4-qa continued on chats, train_readers.sh k4qae)
#   qacode-question  the question reader for code questions (k4-qa-chat fine-tuned on code
#                    questions of the training code: results/question/train_code_reader.sh),
#                    read as it loads: ratio 4, the question allocator (qacode-window: past the
#                    window as qa-window)
#   qanat-question   k4-qa-chat fine-tuned on the four natural kinds in turn
#                    (train_code_reader.sh natural), read with the question allocator
#   qa-scope, qacode-scope   k4-qa and the assign run read with the scope allocator (what the
#                    signal does without, and with, training on code questions)
#   code-question    the same reader shipped (smollm2-135m-k4-qa-code), read as it loads: ratio
#                    4, the scope allocator (its question's lines plain with the def and class
#                    lines they sit in; code-window: past the window, ratio 4.03)
#   qa-llamacpp      the same on llama.cpp (the embedded Q4_1 GGUF and the LoRA as an adapter
#                    set for the merged rows and cleared for the plain ones)
#   llmlingua, longllmlingua   the base model reading LLMLingua's / LongLLMLingua's 30 %
#   PRESS            the base model reading everything, then PRESS keeping 30 % of the KV
#                    (the question read after the press, as kvpress's pipeline reads it)
#   snapkv-question  SnapKV with the question in its window (the prompt read as one segment)
# Beyond the model's 8,192 positions (16,384 and 32,768 tokens) only truncation to the window
# and the question reader (ratio 4.03: at most 8,192 positions with its question and answer) run.
#
# Usage: bash results/question/run.sh [TASK:LENGTH:N[:OPTION][@METHOD,...] ...]
#   (default: the runs below); METHODS="plain truncate" to run only those methods of each run.
#   A finished row is never run again.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
READER=${READER:-smollm2-135m-k4-qa}
RATIO=${RATIO:-4}
presses="expected_attention snapkv tova streaming_llm kvzip"
all="plain truncate bm25 k4 k2 k4-question qa-k4 qa-question llmlingua longllmlingua $presses snapkv-question"
main="plain,truncate,bm25,k4,qa-k4,qa-question,longllmlingua,expected_attention,kvzip"
depth="plain,k4,qa-question,bm25"
natural="plain,truncate,bm25,qa-question,qa-wide,qachat-question,qacode-question,qanat-question"
natural+=",qa-scope,qacode-scope,code-question"
# the side by side at 1,024 and 4,096 tokens; the depth picture at 2,048 and 8,000; the other
# questions; natural questions about real code (nothing inserted) beside the retriever; past
# the window (16,384 and 32,768 tokens: truncation to the window, and the question reader in at
# most 8,192 positions)
runs=${*:-"needle:1024:20 needle:4096:12 needle:2048:11@$depth needle:8000:11@$depth
           needle:1024:20:variant=multikey@$main needle:1024:20:variant=multivalue@$main
           vartrack:1024:20@$depth codeqa:1024:20@$depth codeqa:1024:20:variant=methods@$depth
           codeqa:1024:20:variant=assign@$natural codeqa:1024:20:variant=params@$natural
           codeqa:1024:20:variant=default@$natural codeqa:1024:20:variant=within@$natural
           needle:16384:8@truncate-window,qa-window needle:32768:8@truncate-window,qa-window"}

flags() {  # the ktm eval flags of one method
  case $1 in
    plain)           echo "--model smollm2-135m --no-merge" ;;
    truncate)        echo "--compressor truncate --compressor-option ratio=0.7" ;;
    bm25)            echo "--compressor bm25 --compressor-option ratio=0.7" ;;
    truncate-window) echo "--compressor truncate --compressor-option keep=8000" ;;
    k4)              echo "--checkpoint smollm2-135m-k4-seq" ;;
    k2)              echo "--checkpoint smollm2-135m-k2-seq" ;;
    k4-question)     echo "--checkpoint smollm2-135m-k4-seq --ratio $RATIO --allocator question" ;;
    qa-k4)           echo "--checkpoint $READER --allocator even" ;;
    qa-question)     echo "--checkpoint $READER" ;;
    qa-window)       echo "--checkpoint $READER --ratio 4.03 --allocator question" ;;
    qa-wide)         echo "--checkpoint $READER --ratio 4.01 --allocator question" ;;
    qa-deep)         echo "--checkpoint $READER --ratio 8 --allocator question" ;;
    qachat-question) echo "--checkpoint smollm2-135m-k4-qa-chat" ;;
    qachat-deep)     echo "--checkpoint smollm2-135m-k4-qa-chat --ratio 8 --allocator question" ;;
    qacode-question) echo "--checkpoint runs/codeqa-assign-qachat/checkpoint" ;;
    qanat-question)  echo "--checkpoint runs/codeqa-natural-qachat/checkpoint" ;;
    code-question)   echo "--checkpoint smollm2-135m-k4-qa-code" ;;
    qa-scope)        echo "--checkpoint $READER --allocator scope" ;;
    qacode-scope)    echo "--checkpoint runs/codeqa-assign-qachat/checkpoint --allocator scope" ;;
    code-window)     echo "--checkpoint smollm2-135m-k4-qa-code --ratio 4.03 --allocator scope" ;;
    qacode-window)   echo "--checkpoint runs/codeqa-assign-qachat/checkpoint --ratio 4.03
                           --allocator question" ;;
    qa-llamacpp)     echo "--checkpoint $READER --backend llamacpp" ;;
    llmlingua)       echo "--compressor llmlingua --compressor-option ratio=0.7" ;;
    longllmlingua)   echo "--compressor llmlingua --compressor-option ratio=0.7
                           --compressor-option question_aware=true" ;;
    snapkv-question) echo "--model smollm2-135m --no-merge --prompt-mode paper --press snapkv
                           --press-ratio 0.7" ;;
    *)               echo "--model smollm2-135m --no-merge --press $1 --press-ratio 0.7" ;;
  esac
}

for run in $runs; do
  spec=${run%%@*}
  listed=$([ "$spec" = "$run" ] && echo "$all" || echo "${run#*@}" | tr , ' ')
  IFS=: read -r task length n option <<< "$spec"
  name=$task${option:+-${option#*=}}
  mkdir -p "results/question/$name/$length"
  for method in ${METHODS:-$listed}; do
    case " $listed " in *" $method "*) ;; *) continue ;; esac
    out=results/question/$name/$length/$method.json
    [ -f "$out" ] && continue
    echo "== $name $length $method"
    # shellcheck disable=SC2046
    ktm eval $(flags "$method") --task "$task" --task-option "length=$length" \
      ${option:+--task-option "$option"} --n-eval "$n" --seed 1 --threads 1 --method "$method" \
      --json "$out.tmp" && mv "$out.tmp" "$out" || { rm -f "$out.tmp"; echo "$name $length $method failed"; }
  done
done
