#!/bin/bash
# Copies a commit's csrc/, python/, tests/, benches/ and tools/ into .carry/NAME (gitignored), for a device
# call that must not see uncommitted work, or that compares two commits on one machine (tools/gpu_compare.sh).
# Name `.carry` in the call's carry list.
#
#   bash tools/gpu_snapshot.sh REV NAME [--core]   # --core: also the built python/voltllm/_core.abi3.so
set -eu
rev=$1
name=$2
dest=.carry/$name
tmp=$(mktemp -d)
git worktree add -q --detach "$tmp" "$rev"
rm -rf "$dest"
mkdir -p "$dest"
# csrc/ holds the kernels since the move out of python/voltllm/ops/csrc/ (python/voltllm/_csrc links to it;
# an older commit has no csrc/).
for dir in csrc python tests benches tools; do
  if [ -e "$tmp/$dir" ]; then cp -r "$tmp/$dir" "$dest/"; fi
done
git worktree remove --force "$tmp"
if [ "${3:-}" = --core ]; then
  cp python/voltllm/_core.abi3.so "$dest/python/voltllm/"
fi
echo "$dest: $(git rev-parse --short "$rev")"
