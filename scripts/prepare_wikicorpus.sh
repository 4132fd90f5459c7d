#!/usr/bin/env bash
# Full English Wikipedia -> phase 1 (seq 128, 20 predictions) and phase 2 (seq 512, 80 predictions)
# HDF5 shards, with the pipeline in data/ (see docs/DATA.md).
#
#   scripts/prepare_wikicorpus.sh OUTPUT_DIR [VOCAB_FILE]
#
# Without VOCAB_FILE an uncased WordPiece vocab of up to 30,522 tokens is trained on the corpus (fewer when
# the corpus has no more pairs of pieces seen twice or more to merge; data.prepare's vocab line then says so).
# Environment (all optional):
#   DUMP_DATE   enwiki dump date, YYYYMMDD (default 20261101; never "latest")
#   DUMP        a local dump file (a path or file:// URL) or an http(s) URL instead of downloading DUMP_DATE
#               (then set neither that nor MIRROR)
#   MIRROR      dump mirror (default https://dumps.wikimedia.org)
#   NO_VERIFY   1: download without the check against the published checksum file (a mirror that has none)
#   WORKERS     worker processes (default: the cores this process may use, nproc)
#   NUM_SHARDS  training shards per phase (default 256); TEST_SHARDS (default 8)
#   TEST_FRACTION  documents held out for the test shards (default 0.02; 0 together with TEST_SHARDS=0)
#   PYTHON      interpreter (default: .venv/bin/python if present, else python3)
#
# Rerun the same command after any interruption: every stage resumes where it stopped.
# Text (download, extraction, segmentation, tokens) is shared by both phases in OUTPUT_DIR/text.
set -euo pipefail
# Empty arrays under `set -u` need bash 4.4 (2016); older ones stop with "unbound variable" mid-script.
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)); then
    echo "prepare_wikicorpus.sh: error: needs bash 4.4 or later; this is bash $BASH_VERSION. Run it with a newer bash (the project's container has one)." >&2
    exit 2
fi

usage() { sed -n '2,21p' "$0"; }
case ${1:-} in
    -h|--help) usage; exit 0 ;;
    -*) echo "error: unknown option $1 (this script takes OUTPUT_DIR [VOCAB_FILE]; settings are environment variables)" >&2
        usage >&2; exit 2 ;;
esac
if [[ $# -lt 1 || $# -gt 2 ]]; then
    usage >&2
    exit 2
fi
# Relative paths are the caller's: resolve them before moving to the repository root.
# A URL of any scheme (http, https, file) is passed as it is.
absolute() { if [[ $1 == /* || $1 =~ ^[A-Za-z][A-Za-z0-9+.-]*:// ]]; then printf '%s' "$1"; else printf '%s/%s' "$PWD" "$1"; fi; }
OUT=$(absolute "$1")
VOCAB=${2:+$(absolute "$2")}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
# nproc would print OMP_NUM_THREADS where it is set (1 under many schedulers and containers): the cores are wanted.
WORKERS=${WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
NUM_SHARDS=${NUM_SHARDS:-256}
TEST_SHARDS=${TEST_SHARDS:-8}
TEST_FRACTION=${TEST_FRACTION:-0.02}
# Checked here, where the message can name the variable the user set rather than data.prepare's flag.
env_error() { echo "error: environment variable $1 $2" >&2; exit 2; }
for var in WORKERS:1 NUM_SHARDS:1 TEST_SHARDS:0; do
    name=${var%:*} least=${var#*:}
    [[ ${!name} =~ ^[0-9]+$ && $((10#${!name})) -ge $least ]] || env_error "$name" "must be an integer >= $least, got '${!name}'"
done
[[ $TEST_FRACTION =~ ^(0(\.[0-9]*)?|\.[0-9]+)$ ]] || env_error TEST_FRACTION "must be a number in [0, 1), got '$TEST_FRACTION'"
no_fraction=0; if [[ $TEST_FRACTION =~ ^(0(\.0*)?|\.0+)$ ]]; then no_fraction=1; fi
if [[ $((10#$TEST_SHARDS)) == 0 && $no_fraction == 0 ]]; then
    env_error TEST_SHARDS "is 0 but TEST_FRACTION is $TEST_FRACTION: the held-out documents would be written nowhere; set TEST_FRACTION=0 too, to train on every document"
elif [[ $((10#$TEST_SHARDS)) != 0 && $no_fraction == 1 ]]; then
    env_error TEST_FRACTION "is $TEST_FRACTION but TEST_SHARDS is $TEST_SHARDS: no document is held out for the test shards; set TEST_SHARDS=0 too, or a TEST_FRACTION above 0"
fi

if [[ -n ${DUMP:-} ]]; then
    for var in DUMP_DATE MIRROR; do
        [[ -z ${!var:-} ]] || env_error "$var" "applies to the download, and DUMP=$DUMP is given instead of one; unset $var, or unset DUMP to download"
    done
    source_args=(--input "$(absolute "$DUMP")")
else
    source_args=(--dump_date "${DUMP_DATE:-20261101}" --mirror "${MIRROR:-https://dumps.wikimedia.org}")
fi
case ${NO_VERIFY:-} in
    ""|0) ;;
    1) if [[ -n ${DUMP:-} && ! ${DUMP,,} =~ ^https?:// ]]; then
           env_error NO_VERIFY "applies to a dump this script downloads, and DUMP=$DUMP is a local file; unset NO_VERIFY"
       fi
       source_args+=(--no_verify) ;;
    *) env_error NO_VERIFY "must be 1 or 0, got '$NO_VERIFY'" ;;
esac
vocab_args=()
if [[ -n $VOCAB ]]; then vocab_args=(--vocab_file "$VOCAB"); fi

cd "$ROOT"
for phase in 1 2; do
    echo "=== phase $phase -> $OUT/phase$phase"
    "$PYTHON" -m data.prepare "${source_args[@]}" "${vocab_args[@]}" --phase "$phase" \
        --output_dir "$OUT/phase$phase" --text_dir "$OUT/text" \
        --num_shards "$NUM_SHARDS" --num_test_shards "$TEST_SHARDS" --test_fraction "$TEST_FRACTION" \
        --workers "$WORKERS"
    # Phase 2 uses exactly the vocab phase 1 used (given or trained).
    vocab_args=(--vocab_file "$OUT/phase1/vocab.txt")
done
