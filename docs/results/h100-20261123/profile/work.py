"""The work the profile scripts run: gpu_suite.sh step 1's trainer flags (ResNet-18, 32x32
synthetic images, global batch 512, bf16, channels-last, one GPU, 16 steps per epoch)."""

WORK = (
    "--preset throughput --dataset synthetic --model resnet18 --width 1 --image-size 32 "
    "--batch-size 512 --lr 0.01 --precision bf16 --channels-last --gpus 1 "
    "--max-steps-per-epoch 16"
).split()
