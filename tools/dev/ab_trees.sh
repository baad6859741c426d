#!/usr/bin/env bash
# Build the trees of an interleaved A/B (tools/dev/ab_served.sh) from commits or branches, here, without a GPU:
#   bash tools/dev/ab_trees.sh main exp/x exp/y      ->  .scratch/ab/main, .scratch/ab/exp-x, .scratch/ab/exp-y
# Each tree is `git archive` of the commit without bench/results (the carry stays small), with its commit id
# in COMMIT, which ab_served.sh hands to the bench as NINFER_COMMIT. Earlier trees under .scratch/ab go first.
set -eu
cd "$(git rev-parse --show-toplevel)"
rm -rf .scratch/ab && mkdir -p .scratch/ab
for ref in "$@"; do
  dir=.scratch/ab/${ref//\//-}
  mkdir -p "$dir"
  git archive "$ref" -- . ':!bench/results' | tar -x -C "$dir"
  git rev-parse --short "$ref" > "$dir/COMMIT"
  echo "$dir $(cat "$dir/COMMIT")"
done
du -sh .scratch/ab
