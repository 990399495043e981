# Sourced by the faceshard-clean tests: trained_k3_run SEED NPROC writes a synthetic set
# ($work/data: 16 identities x 8 images, a .bin of 8 held-out ones) and trains a tiny run on
# it with three sub-centres per class ($work/out, one checkpoint at its step 4).
# Needs root, bin, work and fail() from the caller.
trained_k3_run() {
  local seed="$1" nproc="$2"
  "$bin/faceshard-synth" --output "$work/data" --identities 16 --images 8 --holdout 8 --pairs 40 --seed "$seed" \
    > /dev/null || fail "faceshard-synth"
  cat > "$work/tiny.yaml" <<YAML
base: $root/configs/base.yaml
output: $work/out
seed: 7
data: {rec: $work/data, num_classes: 16, batch_size: 8, num_workers: 1, val_targets: []}
model: {backbone: mbf, embedding_size: 64}
loss: {margin: [1.0, 0.0, 0.4], scale: 16, subcenters: 3}
optim: {lr: 0.05, epochs: 1, warmup_epochs: 0, total_steps: 4}
train: {log_every: 1, verify_every: 0, checkpoint_every: 4, keep_checkpoints: 1}
YAML
  "$root/tools/launch.sh" --nproc "$nproc" --grace-s 20 -- "$bin/faceshard-train" --config "$work/tiny.yaml" \
    > "$work/train.log" 2>&1 || { tail -20 "$work/train.log"; fail "training failed"; }
}
