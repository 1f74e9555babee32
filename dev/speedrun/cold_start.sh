#!/usr/bin/env bash
# The whole speedrun process timed from the shell (interpreter, imports, CUDA start-up, compilation or
# CUDA-graph capture, one seed's training and its final validation, exit), for each rung that compiles:
#
#   cold           empty compiler caches (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR fresh temporary folders)
#   warm           the same caches again, now filled by the cold run
#   cache-fill     empty caches and --compile-cache FILE (the run writes torch.compiler.save_cache_artifacts())
#   compile-cache  empty caches again, the FILE hot-loaded (load_cache_artifacts): a new machine with the file
#
# and the bare start-up: `import torch`, `import torch; torch.cuda.init()` and the speedrun's own imports.
#
#   OUT=/tmp/cold bash dev/speedrun/cold_start.sh                       # every compiling rung (~4 min on an H100)
#   RUNGS="cuda-graphs graph-step" REPEATS=2 bash dev/speedrun/cold_start.sh
#
# Writes $OUT/process_times.jsonl (one JSON object per process: rung, cache, process_s, rc, setup_s, train_s;
# `fasttrain lab speedrun record --process-times` reads it), $OUT/cold_start.md (the table) and one log per
# process under $OUT/logs/. Knobs: RUNGS, REPEATS, SEEDS (1: the recipe as a user runs it once), EXTRA_ARGS,
# PYTHON, FASTTRAIN_DATA_DIR, CACHE_RUNGS (the rungs that get the cache-file variants: those inductor compiles),
# COLD_ONLY (rungs timed once: no compiler cache to warm, e.g. graph-step), STARTUP (0: skip the bare start-up),
# LABEL (the name the timings of the rungs go under, e.g. the record's recipe run as a rung with EXTRA_ARGS="--set ..."),
# DROP_CACHES (1: empty the operating system's file cache before each cold process, so that the interpreter and
# torch's libraries are read from disk as on a fresh machine; needs root, and says when it could not).
# The bare start-up is timed after the rungs, so that the first cold process is the machine's first.
set -u
OUT=${OUT:-/tmp/cold-start}
RUNGS=${RUNGS:-compile cuda-graphs regional graph-step muon}
CACHE_RUNGS=${CACHE_RUNGS-compile cuda-graphs regional}    # the rungs inductor compiles: the cache-file variants
COLD_ONLY=${COLD_ONLY:-}
STARTUP=${STARTUP:-1}
LABEL=${LABEL:-}
DROP_CACHES=${DROP_CACHES:-0}
REPEATS=${REPEATS:-1}
SEEDS=${SEEDS:-1}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
mkdir -p "$OUT/logs"
TIMES=$OUT/process_times.jsonl
: > "$TIMES"
WORK=$(mktemp -d /tmp/cold-start.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

field() {  # field RESULT_DIR KEY: setup_s / train_s (median over seeds) of the speedrun's only row, or null
  "$PY" - "$1" "$2" <<'EOF' 2>/dev/null || echo null
import json, sys
result = json.load(open(sys.argv[1] + "/speedrun.json"))
r = result["rows"][0]
if sys.argv[2] == "phases":     # the process's age at each milestone, and the row's own parts of the setup
    run = (r.get("runs") or [{}])[0]
    print(json.dumps({**result.get("process_phases", {}), "build_s": r.get("build_s"),
                      "warmup_steps_s": sum(r.get("warmup_ms") or []) / 1e3, "warmup_eval_s": (r.get("warmup_eval_ms") or 0) / 1e3,
                      "train_s": run.get("train_s"), "final_eval_s": run.get("eval_s")}))
    raise SystemExit
v = r.get("setup_s") if sys.argv[2] == "setup_s" else r["summary"].get("train_s_median")
print("null" if v is None else f"{v:.3f}")
EOF
}

timed() {  # timed RUNG CACHE RESULT_DIR -- COMMAND...: run it, clock it, append one line to $TIMES
  local rung=$1 cache=$2 dir=$3
  shift 4
  local log=$OUT/logs/$rung-$cache-$(date +%s%N).log
  local t0 t1 rc
  t0=$(date +%s.%N)
  "$@" > "$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  local secs setup train
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
  setup=null; train=null; phases=null
  if [ -n "$dir" ] && [ -f "$dir/speedrun.json" ]; then
    setup=$(field "$dir" setup_s); train=$(field "$dir" train_s); phases=$(field "$dir" phases)
  fi
  printf '{"rung": "%s", "cache": "%s", "process_s": %s, "rc": %d, "setup_s": %s, "train_s": %s, "phases": %s}\n' \
    "$rung" "$cache" "$secs" "$rc" "$setup" "$train" "$phases" >> "$TIMES"
  echo "$rung $cache: ${secs} s (exit $rc, setup $setup s, training $train s)"
}

fresh_caches() {  # fresh_caches NAME: point inductor and Triton at new empty folders
  export TORCHINDUCTOR_CACHE_DIR=$WORK/$1/inductor TRITON_CACHE_DIR=$WORK/$1/triton
  rm -rf "$WORK/$1"; mkdir -p "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
}

speedrun() {  # speedrun RUNG RESULT_DIR [ARGS...]
  local rung=$1 dir=$2
  shift 2
  rm -rf "$dir"
  "$PY" -m fasttrain lab speedrun --rungs "$rung" --seeds "$SEEDS" --quiet --out "$dir" ${EXTRA_ARGS:-} "$@"
}

drop_caches() {  # the file cache emptied (cold libraries), or a line saying it could not be
  [ "$DROP_CACHES" = 1 ] || return 0
  sync
  if ! (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null; then
    echo "could not empty the file cache (not root?): the cold process reads warm libraries"
  fi
}

for rung in $RUNGS; do
  name=${LABEL:-$rung}
  echo "=== $name $(date +%T)"
  for i in $(seq "$REPEATS"); do
    fresh_caches "$rung-$i"
    drop_caches
    timed "$name" cold "$WORK/r" -- speedrun "$rung" "$WORK/r"
    case " $COLD_ONLY " in *" $rung "*) continue ;; esac
    timed "$name" warm "$WORK/r" -- speedrun "$rung" "$WORK/r"
    case " $CACHE_RUNGS " in *" $rung "*) ;; *) continue ;; esac
    fresh_caches "$rung-$i-fill"
    rm -f "$WORK/$rung.cache"
    timed "$name" cache-fill "$WORK/r" -- speedrun "$rung" "$WORK/r" --compile-cache "$WORK/$rung.cache"
    if [ -s "$WORK/$rung.cache" ]; then
      fresh_caches "$rung-$i-load"
      timed "$name" compile-cache "$WORK/r" -- speedrun "$rung" "$WORK/r" --compile-cache "$WORK/$rung.cache"
    fi
  done
done

echo "=== start-up $(date +%T)"
fresh_caches startup
[ "$STARTUP" = 0 ] || for i in $(seq "$REPEATS"); do
  drop_caches
  timed startup import-torch-cold "" -- "$PY" -c "import torch"
  timed startup import-torch "" -- "$PY" -c "import torch"
  timed startup cuda-init "" -- "$PY" -c "import torch; torch.cuda.init()"
  timed startup speedrun-imports "" -- "$PY" -c \
    "import torch, fasttrain.lab.experiments.speedrun, fasttrain.lab.trainer, fasttrain.lab.model; torch.cuda.init()"
done

"$PY" - "$TIMES" > "$OUT/cold_start.md" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
def med(rung, cache, key="process_s"):
    v = [r[key] for r in rows if r["rung"] == rung and r["cache"] == cache and r["rc"] == 0 and r[key] is not None]
    return f"{statistics.median(v):.1f}" if v else "-"
print("| process | whole process s (median) |\n| --- | ---: |")
for c in ("import-torch-cold", "import-torch", "cuda-init", "speedrun-imports"):
    print(f"| `{c}` | {med('startup', c)} |")
print("\n| rung | cold s | warm s | compile-cache s | setup cold s | setup warm s | setup compile-cache s | training s |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for rung in dict.fromkeys(r["rung"] for r in rows if r["rung"] != "startup"):
    print(f"| {rung} | {med(rung, 'cold')} | {med(rung, 'warm')} | {med(rung, 'compile-cache')} | "
          f"{med(rung, 'cold', 'setup_s')} | {med(rung, 'warm', 'setup_s')} | {med(rung, 'compile-cache', 'setup_s')} | "
          f"{med(rung, 'warm', 'train_s') if med(rung, 'warm', 'train_s') != '-' else med(rung, 'cold', 'train_s')} |")
print("\n*Whole process: the shell's clock around `python -m fasttrain lab speedrun --rungs RUNG --seeds 1` "
      "(interpreter, imports, CUDA start-up, build, compilation or capture, warm-up, one seed's fixed steps, the "
      "final validation over the whole split, exit). cold: empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR; warm: "
      "the same caches after the cold run; compile-cache: empty caches with --compile-cache FILE hot-loading what "
      "an earlier process saved. setup: build + compile/capture + warm-up, inside the process.*")
EOF
cat "$OUT/cold_start.md"
