#!/usr/bin/env bash
# make demo: the main job end to end on the embedded default (SmolLM2-135M, State of the Union):
# a datastore from the 1990s speeches, lambda and T tuned on 2001-2002, evaluation on 2003 onwards,
# then the same evaluation through real retrieval and LM gRPC servers. About 6-8 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
MEMLM=.venv/bin/memlm
OUT=${MEMLM_DEMO_OUT:-$HOME/.cache/memlm/demo}
DS="$OUT/ds-sotu-1990-2000"
WINDOW=(--context 512 --stride 512)
mkdir -p "$OUT"

if [ -f "$DS/manifest.json" ]; then
  echo "== datastore $DS already built (delete it to rebuild)"
else
  echo "== building the datastore: SOTU 1990-2000 (about 81k tokens), keys at the last feed-forward input"
  $MEMLM datastore build --model smollm2-135m --data sotu --split "1990<=year<=2000" "${WINDOW[@]}" --out "$DS"
fi
$MEMLM datastore info "$DS"

echo "== in-process kNN-LM: tune lambda and T on 2001-2002, evaluate on 2003+ (first 6000 tokens)"
$MEMLM eval --model smollm2-135m --data sotu --split "year>=2003" --max-tokens 6000 "${WINDOW[@]}" \
  --datastore "$DS" --k 1024 --lambda auto --knn-temperature auto \
  --tune-data sotu --tune-split "2001<=year<=2002" --tune-max-tokens 4000 --json "$OUT/knnlm.json"

echo "== the same through real gRPC servers (retrieval + language model)"
.venv/bin/python scripts/demo_services.py --datastore "$DS" --tuned "$OUT/knnlm.json" \
  --split "year>=2003" --max-tokens 6000 --context 512 --stride 512
