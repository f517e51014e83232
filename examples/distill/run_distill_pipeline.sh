#!/bin/bash
# The launcher of ROLL's examples (examples/*/run_distill_pipeline.sh), for this toolkit:
#   bash examples/distill/run_distill_pipeline.sh                       # the demo
#   CONFIG_NAME=skewed bash examples/distill/run_distill_pipeline.sh max_steps=60
# Extra arguments are Hydra-style overrides (key.sub=value, +key=value, ~key).
set -euo pipefail

CONFIG_NAME="${CONFIG_NAME:-demo}"                    # demo.yaml
CONFIG_PATH="${CONFIG_PATH:-examples/distill}"

cd "$(dirname "$0")/../.."
cargo run -p distill -- \
       --config_path "$CONFIG_PATH" \
       --config_name "$CONFIG_NAME" \
       "$@"
