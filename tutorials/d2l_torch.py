"""d2l-torch: the training loop of Dive into Deep Learning 13.6, "Concise Implementation for
Multiple GPUs" (PyTorch), on this project's data, model and config; compared with torch-dp.

    python -m tutorials.d2l_torch --preset throughput --no-augment --gpus 1

The tutorial's loop, and what each part costs:
- Input: `d2l.load_data_fashion_mnist(batch_size)` wraps a torchvision dataset whose transform
  (`ToTensor`) runs per image, in `DataLoader(shuffle=True, num_workers=4)` for training and
  `DataLoader(shuffle=False, num_workers=4)` for testing, both at the training batch size. The
  four worker processes are started afresh at every epoch (no persistent workers) and collate
  per-image tensors; the final partial batch is kept.
- Step: `nn.DataParallel(net, device_ids=devices)` scatters each batch from GPU 0, replicates
  the model and gathers the logits every step; zero_grad, `.to(devices[0])` of X and y (pageable
  memory, synchronous copy), `nn.CrossEntropyLoss`, backward, `torch.optim.SGD.step`. No
  per-step host sync in training.
- Timing: the tutorial stops its timer right after the loop WITHOUT `torch.cuda.synchronize()`,
  so queued kernels would be missed; this rebuild synchronises before reading the clock.
- Evaluation: `d2l.evaluate_accuracy_gpu`: eval mode, no_grad, per batch `float()` of the number
  correct (one host sync per test batch), every test image once (no drop, no padding).
Timed as every tutorial loop (tutorials/record.py): the first epoch is warm-up.

Without CUDA, DataParallel runs the module directly on the CPU (one replica), exactly like our
torch-dp: the record says devices 1, device_kind "cpu".
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from common.config import Config
from common.datasets import load_for
from common.runtime import cpu_threads
from common.schedule import scaled_lr
from common.trainer import keep_measured_epochs, run_main
from frameworks.torch_dp import FRAMEWORK as COMPARED, build_model, check_config
from frameworks.torch_support import device_plan, initialize, make_optimizer, sync, use_device_plan
from tutorials.record import Tutorial, TutorialRecorder, failure_recorder, refuse_options

SOURCE = (
    "Dive into Deep Learning, 13.6 Concise Implementation for Multiple GPUs (PyTorch), "
    "https://d2l.ai/chapter_computational-performance/multiple-gpus-concise.html"
)
DEVIATIONS: tuple[str, ...] = (
    "float32 precision by the benchmark's rule, as the compared trainer (TF32 off unless "
    "--tf32); torch's default lets cuDNN convolutions use TF32",
    "data come from common.datasets arrays instead of torchvision.datasets.FashionMNIST "
    "(no download here); ToTensor gets each uint8 (H, W, C) ndarray instead of a PIL image",
    "images are normalised per item with the dataset mean/std (transforms.Normalize after "
    "ToTensor) like our trainers; d2l does not normalise",
    "the model is the compared trainer's (torch-dp build_model: our ResNet-18/WideResNet and "
    "He-normal init) instead of d2l's resnet18 with normal(std 0.01) weights",
    "SGD with momentum and weight decay from the config (weight decay on conv/linear weights "
    "only, like our trainers); d2l uses plain SGD on net.parameters()",
    "label smoothing from the config in nn.CrossEntropyLoss (0 unless asked)",
    "torch.cuda.synchronize() before the epoch clock stops; d2l's timer omits it",
    "the model is moved to devices[0] before DataParallel wraps it (DataParallel requires it)",
    "torch seeded with --seed before the model is built (same initial weights as torch-dp)",
    "CPU threads set as torch-dp sets them; --max-steps-per-epoch caps the loop when given",
)
PACKAGES = ("torch", "torchvision")
TUTORIAL = Tutorial("d2l-torch", SOURCE, DEVIATIONS, PACKAGES)
PROG = "python -m tutorials.d2l_torch"


class ImageArrays(Dataset):
    """Stand-in for torchvision's FashionMNIST: item i is (transform(images[i]), int label)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: transforms.Compose):
        self.images = images  # (N, H, W, C) uint8
        self.labels = labels  # (N,) int32
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[i]), int(self.labels[i])


def image_datasets(ds) -> tuple[ImageArrays, ImageArrays]:  # type: ignore[no-untyped-def]
    """(train, test) torchvision-style datasets of our arrays: ToTensor then our normalisation,
    per item (in the DataLoader's workers, or in the training process without workers)."""
    trans = transforms.Compose([transforms.ToTensor(), transforms.Normalize(ds.mean, ds.std)])
    return ImageArrays(ds.train_x, ds.train_y, trans), ImageArrays(ds.test_x, ds.test_y, trans)


def load_data(cfg: Config, ds) -> tuple[DataLoader, DataLoader]:  # type: ignore[no-untyped-def]
    """d2l.load_data_fashion_mnist(batch_size): per-item transforms, 4 workers, one batch size."""
    train_set, test_set = image_datasets(ds)
    workers = 4  # d2l.get_dataloader_workers()
    return (
        DataLoader(train_set, cfg.batch_size, shuffle=True, num_workers=workers),
        DataLoader(test_set, cfg.batch_size, shuffle=False, num_workers=workers),
    )


def evaluate_accuracy_gpu(net: nn.Module, data_iter: DataLoader) -> tuple[float, float]:
    """d2l's accuracy loop: (correct, total), one host sync (`float`) per batch."""
    net.eval()
    device = next(iter(net.parameters())).device
    correct, total = 0.0, 0.0
    with torch.no_grad():
        for X, y in data_iter:
            X, y = X.to(device), y.to(device)
            y_hat = net(X).argmax(dim=1)
            correct += float((y_hat.type(y.dtype) == y).type(y.dtype).sum())  # host sync
            total += float(y.numel())
    return correct, total


def train(cfg: Config) -> dict:
    """The tutorial's train(net, num_gpus, batch_size, lr) on our data, model and config."""
    cuda = torch.cuda.is_available()
    devices = [torch.device("cuda", i) for i in range(cfg.gpus)]  # d2l.try_gpu(i)
    kind = f"cuda:{torch.cuda.get_device_name(0)}" if cuda else "cpu"
    use_device_plan(device_plan(cfg, "cuda" if cuda else "cpu"))  # as torch-dp (see DEVIATIONS)
    if not cuda:  # as torch-dp: DataParallel then runs the module itself, on the CPU
        devices = [torch.device("cpu")]
        torch.set_num_threads(cpu_threads(1))
        print(
            "note: no CUDA device: nn.DataParallel runs a single replica on the CPU "
            f"(--gpus {cfg.gpus} was asked)",
            flush=True,
        )
    ds = load_for(cfg)
    torch.manual_seed(cfg.seed)
    train_iter, test_iter = load_data(cfg, ds)
    net = build_model(cfg, ds.channels, ds.num_classes)
    initialize(cfg, net)  # --init shared: the arrays every framework starts from
    net = net.to(devices[0])
    recorder = TutorialRecorder(cfg, TUTORIAL, ds, devices=len(devices), device_kind=kind)
    with keep_measured_epochs(recorder):
        # Scatter / replicate / gather every step; gradients summed onto GPU 0 in backward().
        net = nn.DataParallel(net, device_ids=devices if cuda else None)
        trainer = make_optimizer(cfg, net.module)  # torch-dp's SGD: decay on conv/linear only
        for group in trainer.param_groups:  # d2l's constant LR
            group["lr"] = scaled_lr(cfg.lr, cfg.batch_size, cfg.lr_base_batch, cfg.lr_scaling)
        loss = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        for _ in range(cfg.epochs):
            net.train()
            t0 = time.perf_counter()
            images = 0
            for step, (X, y) in enumerate(train_iter):  # workers start here, every epoch
                if cfg.max_steps_per_epoch and step == cfg.max_steps_per_epoch:
                    break
                trainer.zero_grad()
                X, y = X.to(devices[0]), y.to(devices[0])  # (B, C, H, W) float32, (B,) int64
                l = loss(net(X), y)  # noqa: E741 (the tutorial's name)
                l.backward()
                trainer.step()
                images += y.shape[0]  # host-side shape: no sync
            sync()  # added: d2l stops its timer with kernels still queued
            sec = time.perf_counter() - t0
            t1 = time.perf_counter()
            correct, total = evaluate_accuracy_gpu(net, test_iter)
            recorder.end_epoch(sec, images, time.perf_counter() - t1, correct, total)
    return recorder.finish()


def check_supported(cfg: Config) -> None:
    """Options the tutorial's loop has no equivalent for, then what torch-dp refuses (device
    count, --bn sync under DataParallel, the dataset): ConfigError, one line."""
    refuse_options(cfg, "the d2l loop")
    check_config(cfg)


def main(argv: list[str] | None = None) -> int:
    """Command line: the trainers' flags. Exit 0 ok, 1 failed, 2 bad input."""
    cuda = torch.cuda.is_available()  # a failure before the loop: the devices it would use
    kind = f"cuda:{torch.cuda.get_device_name(0)}" if cuda else "cpu"
    fail = failure_recorder(TUTORIAL, devices=None if cuda else 1, device_kind=kind)
    return run_main(argv, COMPARED, prog=PROG, check=check_supported, train=train, on_failure=fail)


if __name__ == "__main__":
    sys.exit(main())
