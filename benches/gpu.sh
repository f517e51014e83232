#!/usr/bin/env bash
# One-go GPU check for a machine with a real GPU (about ten minutes after the build):
# device info, the GPU parity test set, the train-step and generation benches on bench-155m
# and on the seed's Llama-3.2-1B shape, their PyTorch-CUDA twins when torch with CUDA is
# installed, and one summary table.
#
#   benches/gpu.sh [--device wgpu:0] [--python /path/to/python] [--quick] [--profile dev]
#
# --device   our device (default: the first hardware wgpu adapter, see `devices` below;
#            `cuda:0` in a build with `--features cuda`; extra cargo flags in $CARGO_FLAGS)
# --python   a Python with torch (+ transformers, peft) for the twins; they run on CUDA when
#            torch sees a CUDA device, otherwise they are skipped (CPU twins are other benches)
# --quick    tiny shapes (a software driver such as lavapipe: proof of function, not speed)
# --profile  cargo profile (default release; `dev` reuses the test build, for a quick check)
# --skip-build  use what is built
# Everything is logged under ${OUT:-target/gpu-check}; the table is also in summary.md there.
set -uo pipefail
cd "$(dirname "$0")/.."

device="" python="" quick=0 build=1 profile=release
while [ $# -gt 0 ]; do
    case "$1" in
        --device) device="$2"; shift 2 ;;
        --python) python="$2"; shift 2 ;;
        --quick) quick=1; shift ;;
        --skip-build) build=0; shift ;;
        --profile) profile="$2"; shift 2 ;;
        *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
out="${OUT:-target/gpu-check}"
mkdir -p "$out"
flags=(${CARGO_FLAGS:-})
bin="target/$profile"
[ "$profile" = dev ] && bin=target/debug

if [ "$build" = 1 ]; then
    echo "== building ($profile; not part of the ten minutes)"
    cargo build --profile "$profile" -p kd-benches --bins "${flags[@]}" || exit 1
    # --workspace: the members' features (kd-model's default `wgpu`) apply, as in `cargo test`.
    cargo test --profile "$profile" --workspace --test gpu --no-run "${flags[@]}" || exit 1
fi

echo "== devices"
"$bin/devices" | tee "$out/devices.txt" || exit 1
if [ -z "$device" ]; then
    device=$(sed -n 's/^default GPU: \([^ ]*\).*/\1/p' "$out/devices.txt")
fi
if [ -z "$device" ]; then
    echo "no GPU found: install a Vulkan driver, or pass --device" >&2
    exit 1
fi
echo "using $device"

twin=()
if [ -n "$python" ]; then
    if "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        twin=(--python "$python" --torch-device cuda)
        "$python" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name())" | tee -a "$out/devices.txt"
    else
        echo "torch without CUDA at $python: the PyTorch twins are skipped"
    fi
fi

if [ "$quick" = 1 ]; then
    # Software drivers bind at most 128 MiB per buffer (lavapipe): smaller vocabularies keep
    # the embedding and LM head under it.
    t155=(--batch 1 --seq 64 --warmup 1 --steps 1 --rounds 1 --vocab 32768)
    t1b=(--batch 1 --seq 32 --warmup 0 --steps 1 --rounds 1 --vocab 8192)
    g155=(--batch 2 --prompt-len 8 --new-tokens 8 --repeats 1 --vocab 32768)
    g1b=(--batch 1 --prompt-len 8 --new-tokens 4 --repeats 1 --vocab 8192)
    limit=1800
else
    t155=(--batch 4 --seq 256 --warmup 2 --steps 5 --rounds 1)
    t1b=(--batch 1 --seq 2048 --warmup 1 --steps 2 --rounds 1)
    g155=(--batch 8 --prompt-len 32 --new-tokens 64 --repeats 3)
    g1b=(--batch 8 --prompt-len 32 --new-tokens 64 --repeats 2)
    limit=180
fi

status=0
run() { # name, command...
    local name="$1"; shift
    echo "== $name"
    local start=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "($name: exit $rc, $(( $(date +%s) - start )) s)" | tee -a "$out/$name.txt"
    [ "$rc" = 0 ] || status=1
}

KD_GPU_DEVICE="$device" KD_REQUIRE_GPU=1 run parity \
    cargo test --profile "$profile" --workspace --test gpu "${flags[@]}"
run train-155m "$bin/train_step" --device "$device" "${t155[@]}" "${twin[@]}"
run train-1b "$bin/train_step" --preset seed-1b --device "$device" "${t1b[@]}" "${twin[@]}"
run generate-155m "$bin/generate_throughput" --device "$device" "${g155[@]}" "${twin[@]}"
run generate-1b "$bin/generate_throughput" --preset seed-1b --device "$device" "${g1b[@]}" "${twin[@]}"

field() { # file, line prefix, sed expression
    grep -m1 "^$2" "$out/$1.txt" 2>/dev/null | sed -n "$3" | head -1
}
{
    echo "| check | ours ($device) | PyTorch |"
    echo "|---|---|---|"
    echo "| parity tests | $(grep -m1 '^test result' "$out/parity.txt" 2>/dev/null || echo 'did not finish') | — |"
    for t in train-155m train-1b; do
        ours=$(field $t "ours (round 1)" 's/.*median step \([^,]*\), \([^,]*\),.*/\1, \2/p')
        mem=$(field $t "ours:    device memory" 's/.*memory: //p')
        theirs=$(field $t "pytorch: median" 's/.*median step \([^,]*\), \([^,]*\),.*/\1, \2/p')
        tmem=$(field $t "pytorch: device memory" 's/.*memory: //p')
        echo "| $t step | ${ours:-—}; ${mem:-—} | ${theirs:-—}; ${tmem:-—} |"
    done
    for g in generate-155m generate-1b; do
        ours=$(field $g "ours:" 's/.*, \(.*generated tokens\/s\).*/\1/p')
        theirs=$(field $g "hf:" 's/.*, \(.*generated tokens\/s\).*/\1/p')
        echo "| $g | ${ours:-—} | ${theirs:-—} |"
    done
} | tee "$out/summary.md"
exit "$status"
