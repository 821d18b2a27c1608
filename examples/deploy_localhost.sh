#!/usr/bin/env bash
# A 4-party deployment on loopback: every party its own process, over gRPC with mutual TLS.
#
# Makes a federation CA and certificates, writes four parties' files (breast-cancer columns,
# scikit-learn's bundled copy) and a federation file, starts the three data parties and the
# aggregation server in the background, trains LASER from the label party and stops everything
# (a trap on EXIT kills the pids it started). Each data party keeps its own part of the trained
# model in its own directory (DIR/models-NAME/NAME/RUN_ID/); the script then copies the parts
# beside the label party's manifest and predicts in one process (DIR/predictions.csv), and
# predicts again with every part where it lives, each data party in its own process and the
# representations sealed (DIR/predictions-deployed.csv). ALIGN is `join` (default: the label
# party learns every party's ids) or `psi` (DH-PSI with each data party: it learns only which
# of its ids each party holds), in training and in prediction.
#
#     bash examples/deploy_localhost.sh [--overwrite] [DIR] [EPOCHS] [ALIGN]
#
# A DIR that holds what an earlier demo wrote (its files, certificates, runs, models) is refused
# before anything is written or started, unless --overwrite, which removes those first. Each
# file is written whole or not at all.
#
# It runs with the project's .venv when there is one (no need to activate it); PYTHON=... names
# another interpreter.
set -euo pipefail

OVERWRITE=0
if [ "${1:-}" = --overwrite ]; then OVERWRITE=1; shift; fi
DIR=${1:-$(mktemp -d)}
EPOCHS=${2:-5}
ALIGN=${3:-join}
# The interpreter: $PYTHON if set, else the project's own (.venv, made by scripts/setup.sh), else
# the python on PATH (one that has secure-vfl installed).
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python
  VENV_PYTHON="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python"
  if [ -x "$VENV_PYTHON" ]; then PYTHON=$VENV_PYTHON; fi
fi
# Five processes on one machine: one torch thread each, or they oversubscribe a small machine's
# cores (benchmarks/README.md, "How to read the deploy costs").
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
svfl() { "$PYTHON" -m secure_vfl "$@"; }  # the `secure-vfl` command

# What the demo writes in DIR. An earlier demo's would be replaced in part only: `certs init`
# refuses a CA that is there (after the files were written), each data party's model folder would
# hold two runs and the model's copy would land inside the old one.
OUTPUTS=(bank.csv shop.csv insurer.csv telco.csv labels.csv federation.toml certs run
         models-shop models-insurer models-telco model-copy predictions.csv
         predictions-deployed.csv)
for name in shop insurer telco aggregator; do OUTPUTS+=("$name.log" "$name-predict.log"); done
if [ -e "$DIR" ] && [ ! -d "$DIR" ]; then
    echo "deploy_localhost.sh: DIR $DIR is a file; expected a directory (or a new path)." >&2
    exit 2
fi
FOUND=()
for name in "${OUTPUTS[@]}"; do
    if [ -e "$DIR/$name" ] || [ -L "$DIR/$name" ]; then FOUND+=("$DIR/$name"); fi
done
if [ "${#FOUND[@]}" -gt 0 ]; then
    if [ "$OVERWRITE" = 0 ]; then
        more=""; [ "${#FOUND[@]}" -le 3 ] || more=" ..."
        echo "deploy_localhost.sh: ${FOUND[*]:0:3}$more exist (an earlier demo's?); expected a" \
            "new DIR (or --overwrite to replace them)." >&2
        exit 2
    fi
    rm -rf -- "${FOUND[@]}"
fi
mkdir -p "$DIR"
PIDS=()
trap 'for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
      rm -rf -- "$DIR/.federation.toml.$$.tmp" "$DIR/.model-copy.$$.tmp"' EXIT

# Free ports for the four parties and the aggregator, chosen by the OS.
read -r P0 P1 P2 P3 PA < <("$PYTHON" -c \
    "from secure_vfl.federation.network import free_loopback_ports; print(*free_loopback_ports(5))")

"$PYTHON" - "$DIR" <<'PY'
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.datasets import load_breast_cancer

from secure_vfl.io import atomic_write

out = Path(sys.argv[1])
bunch = load_breast_cancer(as_frame=True)
ids = [f"p{i:04d}" for i in range(len(bunch.data))]
for name, columns in zip(("bank", "shop", "insurer", "telco"),
                         np.array_split(np.array(bunch.data.columns), 4)):
    frame = bunch.data[list(columns)].copy()
    frame.insert(0, "id", ids)
    atomic_write(out / f"{name}.csv", lambda tmp: frame.to_csv(tmp, index=False), replace=False)
labels = pd.DataFrame({"id": ids, "label": bunch.target})
atomic_write(out / "labels.csv", lambda tmp: labels.to_csv(tmp, index=False), replace=False)
PY

svfl certs init --out "$DIR/certs" \
    --party bank --party shop --party insurer --party telco --party aggregator

# Written beside its place and renamed there: whole or absent.
cat > "$DIR/.federation.toml.$$.tmp" <<TOML
ca = "certs/ca.pem"
label_party = "bank"

[aggregator]
address = "127.0.0.1:$PA"
cert = "certs/aggregator.pem"
key = "certs/aggregator.key"

[party.bank]
address = "127.0.0.1:$P0"
cert = "certs/bank.pem"
key = "certs/bank.key"
data = "bank.csv"
labels = "labels.csv"

[party.shop]
address = "127.0.0.1:$P1"
cert = "certs/shop.pem"
key = "certs/shop.key"
data = "shop.csv"

[party.insurer]
address = "127.0.0.1:$P2"
cert = "certs/insurer.pem"
key = "certs/insurer.key"
data = "insurer.csv"

[party.telco]
address = "127.0.0.1:$P3"
cert = "certs/telco.pem"
key = "certs/telco.key"
data = "telco.csv"
TOML
mv -- "$DIR/.federation.toml.$$.tmp" "$DIR/federation.toml"

# The data parties, each keeping its part of the model in its own directory, and the
# aggregation server, in the background; each logs to DIR/NAME$1.log.
serve_all() {
    local name model_dir
    for name in shop insurer telco aggregator; do
        model_dir=()
        [ "$name" = aggregator ] || model_dir=(--model-dir "$DIR/models-$name")
        # The interpreter itself in the background, not the svfl function: $! is then the
        # party's own pid (a function would run in a subshell whose pid the trap would kill,
        # leaving the party serving after a failed step).
        "$PYTHON" -m secure_vfl party serve --federation "$DIR/federation.toml" --name "$name" \
            "${model_dir[@]}" > "$DIR/$name$1.log" 2>&1 &
        PIDS+=($!)
    done
}
serve_all ""

svfl train --federation "$DIR/federation.toml" --name bank \
    --method laser --heads active --secure-agg masks --epochs "$EPOCHS" --align "$ALIGN" \
    --out "$DIR/run" --quiet

for pid in "${PIDS[@]}"; do wait "$pid"; done  # each data party exits 0 once the run ends
PIDS=()
echo "every party finished; result: $DIR/run/result.json"

# The model: the label party's part and manifest in run/model/, every data party's part at that
# party. To predict in one process, copy the parts beside the manifest (checked against the
# SHA-256 each party reported) and predict; here on the training files themselves.
RUN_ID=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["model"]["run_id"])' \
    "$DIR/run/result.json")
# Copied beside its place and renamed there: whole or absent.
cp -r "$DIR/run/model" "$DIR/.model-copy.$$.tmp"
for name in shop insurer telco; do
    cp -r "$DIR/models-$name/$name/$RUN_ID" "$DIR/.model-copy.$$.tmp/$name"
done
mv -- "$DIR/.model-copy.$$.tmp" "$DIR/model-copy"
svfl predict --model "$DIR/model-copy" --party-file "$DIR/bank.csv" --party-file "$DIR/shop.csv" \
    --party-file "$DIR/insurer.csv" --party-file "$DIR/telco.csv" --out "$DIR/predictions.csv"

# Or where the parts live: each data party loads its own part in its own process and serves its
# rows (`--data NEW.csv` for new ones; here its training file), aligned as in training.
serve_all -predict
svfl predict --federation "$DIR/federation.toml" --name bank --model "$DIR/run" \
    --align "$ALIGN" --secure-agg masks --out "$DIR/predictions-deployed.csv"
for pid in "${PIDS[@]}"; do wait "$pid"; done
PIDS=()
