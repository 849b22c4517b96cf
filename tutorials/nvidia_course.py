"""nvidia-course: the DDP solution script (fashion_mnist.py) of the NVIDIA DLI course "Data
Parallelism: How to Train Deep Learning Models on Multiple GPUs", on this project's data, model
and config; compared with torch-ddp.

    python -m tutorials.nvidia_course --preset throughput --no-augment --gpus 2

The course's loop, and what each part costs:
- Processes: `torch.multiprocessing.spawn(worker, nprocs=num_gpus)`; each worker joins the
  process group (NCCL; gloo here on CPU) with a fixed rendezvous port. (Added here: each
  worker dies with its parent, common.runtime.die_with_parent.)
- Input: datasets with `transforms.Compose([transforms.ToTensor()])` (a per-image transform),
  a `DistributedSampler` for train AND test (shuffled; the index list is padded with repeats to
  a multiple of the world size), `DataLoader(batch_size=<per-GPU batch>, drop_last=True,
  sampler=...)` for both, `num_workers` left at 0: every image is converted and collated in the
  training process itself, between steps.
- Step: labels and images `.to(device)` (pageable memory), forward through
  `DistributedDataParallel` (gradients averaged over ranks in buckets during backward()),
  `nn.CrossEntropyLoss`, zero_grad, backward, `torch.optim.SGD.step`. No per-step host sync.
- Timing: t0, `train_sampler.set_epoch(epoch)`, the epoch, `dist.barrier()`, then the clock
  (so each epoch lasts as long as the slowest rank); images/sec as a tensor reduced to rank 0.
  This rebuild also synchronises CUDA before the barrier.
- Evaluation: eval mode, no_grad, per batch `correct += (predictions == labels).sum()` and
  `loss_total += loss` kept as device tensors (no per-batch sync), accuracy = correct / total,
  then `all_reduce(op=AVG)` of accuracy and loss and the early-stop check over the accuracy
  tensors (a host sync per epoch). Each rank evaluates floor(ceil(M / world) / b) * b of the M
  test images (padding repeats, drop_last), so the record's `test_examples` is that sum over
  ranks, not M.
Timed as every tutorial loop (tutorials/record.py): the first epoch is warm-up.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from common.config import Config, ConfigError, per_device
from common.datasets import load_for
from common.results import write_json_atomic
from common.runtime import cpu_threads, die_with_parent, free_port
from common.schedule import scaled_lr
from common.trainer import describe, keep_measured_epochs, run_main
from frameworks.torch_ddp import FRAMEWORK as COMPARED, build_model
from frameworks.torch_support import device_plan, initialize, make_optimizer, sync, use_device_plan
from tutorials.d2l_torch import image_datasets  # torchvision-dataset stand-ins
from tutorials.record import Tutorial, TutorialRecorder, failure_recorder, refuse_options

SOURCE = (
    "NVIDIA DLI, Data Parallelism: How to Train Deep Learning Models on Multiple GPUs, "
    "DDP solution fashion_mnist.py, "
    "https://learn.nvidia.com/courses/course-detail?course_id=course-v1:DLI+C-MG-01+V3"
)
DEVIATIONS: tuple[str, ...] = (
    "float32 precision by the benchmark's rule, as the compared trainer (TF32 off unless "
    "--tf32); torch's default lets cuDNN convolutions use TF32",
    "data come from common.datasets arrays instead of torchvision.datasets.FashionMNIST "
    "(no download, so no rank-0-downloads-first barrier); ToTensor gets each uint8 (H, W, C) "
    "ndarray instead of a PIL image",
    "images are normalised per item with the dataset mean/std (transforms.Normalize after "
    "ToTensor) like our trainers; the course does not normalise",
    "the model is the compared trainer's (torch-ddp build_model: our WideResNet with global "
    "average pooling over all pixels, or ResNet-18) instead of the course's WideResNet class",
    "gloo on CPU instead of NCCL (N CPU processes stand in for N GPUs; threads per process set "
    "as torch-ddp sets them); torch.cuda.set_device(local_rank) on CUDA",
    "rendezvous on a free port from common.runtime.free_port instead of the hard-coded "
    "MASTER_PORT, and no module-level argparse / WORLD_SIZE: the config comes from the "
    "trainers' command line",
    "SGD weight decay from the config on conv/linear weights only, like our trainers (the "
    "course has none); the LR is the config's constant (scaled) LR; no warm-up scheduler",
    "DistributedSampler seeded with --seed (the course keeps the default seed 0)",
    "torch.cuda.synchronize() before the end-of-epoch barrier (the barrier alone does not wait "
    "for queued kernels on every backend)",
    "--target-accuracy 0 means no early stop (the course's check would stop after --patience "
    "epochs); --max-steps-per-epoch caps the loop when given",
    "a barrier and destroy_process_group at the end (gloo could abort a rank at exit otherwise)",
)

PACKAGES = ("torch", "torchvision")
TUTORIAL = Tutorial("nvidia-course", SOURCE, DEVIATIONS, PACKAGES)
PROG = "python -m tutorials.nvidia_course"


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: DataLoader,
    loss_fn: nn.Module,
    device: torch.device,
    max_steps: int,
) -> int:
    """The course's train(): one pass over this rank's loader; returns the steps taken."""
    model.train()
    steps = 0
    for images, labels in train_loader:  # ToTensor + collate here, in this process
        if max_steps and steps == max_steps:
            break
        labels = labels.to(device)
        images = images.to(device)  # (b, C, H, W) float32
        outputs = model(images)
        loss = loss_fn(outputs, labels)
        optimizer.zero_grad()
        loss.backward()  # DDP: gradients averaged over ranks in here
        optimizer.step()
        steps += 1
    return steps


def test(
    model: nn.Module, test_loader: DataLoader, loss_fn: nn.Module, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The course's test(): (accuracy, mean batch loss) as device tensors, and images seen."""
    total_labels = 0
    correct_labels: torch.Tensor | int = 0
    loss_total: torch.Tensor | int = 0
    model.eval()
    with torch.no_grad():
        for images, labels in test_loader:
            labels = labels.to(device)
            images = images.to(device)
            outputs = model(images)
            loss = loss_fn(outputs, labels)
            predictions = torch.max(outputs, 1)[1]
            total_labels += len(labels)
            correct_labels = correct_labels + (predictions == labels).sum()  # stays on device
            loss_total = loss_total + loss
    v_accuracy = correct_labels / total_labels
    v_loss = loss_total / len(test_loader)
    return v_accuracy, v_loss, total_labels  # type: ignore[return-value]  # tensors, as the course's


def worker(
    local_rank: int, cfg: Config, port: int, result: str, argv: list[str], parent: int
) -> None:
    """One rank: the course's worker(local_rank, args) on our data, model and config. Added:
    it dies with its parent (kill -9, the OOM killer): no rank trains on alone."""
    die_with_parent(parent)
    sys.argv = argv  # the record's "command"
    world, rank = cfg.gpus, local_rank  # one node
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        use_device_plan(
            device_plan(cfg, "cuda" if cuda else "cpu")
        )  # as torch-ddp (see DEVIATIONS)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(world))  # N processes share the cores
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        world_size=world,
        rank=rank,
        timeout=datetime.timedelta(minutes=10),
    )
    try:
        record = run_rank(cfg, rank, world, device)
        if rank == 0:
            write_json_atomic(result, record)
        if record["status"] != "ok":
            raise RuntimeError(record["error"])
        dist.barrier()  # no rank tears gloo/NCCL down while another is still in a collective
    finally:
        dist.destroy_process_group()


def run_rank(cfg: Config, rank: int, world: int, device: torch.device) -> dict:
    """Datasets, samplers, loaders, DDP model and the epoch loop of one rank."""
    ds = load_for(cfg)
    b = per_device(cfg.batch_size, world)  # the course's per-GPU --batch-size
    train_set, test_set = image_datasets(ds)  # ToTensor + Normalize per item, no workers
    train_sampler: DistributedSampler = DistributedSampler(
        train_set, num_replicas=world, rank=rank, seed=cfg.seed
    )
    test_sampler: DistributedSampler = DistributedSampler(
        test_set, num_replicas=world, rank=rank, seed=cfg.seed
    )
    train_loader = DataLoader(train_set, batch_size=b, drop_last=True, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=b, drop_last=True, sampler=test_sampler)

    torch.manual_seed(cfg.seed)  # the same initial weights as torch-ddp
    model = build_model(cfg, ds.channels, ds.num_classes)
    initialize(cfg, model)  # --init shared: the arrays every framework starts from
    if cfg.bn == "sync":  # CUDA only (refused on CPU before spawning)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    # DDP broadcasts rank 0's weights now and averages gradients in buckets during backward().
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    optimizer = make_optimizer(cfg, model.module)  # torch-ddp's SGD: decay on conv/linear only
    for group in optimizer.param_groups:  # the course's constant LR, no warm-up scheduler
        group["lr"] = scaled_lr(cfg.lr, cfg.batch_size, cfg.lr_base_batch, cfg.lr_scaling)
    kind = "cpu-simulated" if device.type == "cpu" else f"cuda:{torch.cuda.get_device_name(device)}"
    recorder = TutorialRecorder(
        cfg, TUTORIAL, ds, devices=world, device_kind=kind, is_main=rank == 0
    )
    with keep_measured_epochs(recorder):
        val_accuracy: list[torch.Tensor] = []
        for epoch in range(cfg.epochs):
            t0 = time.perf_counter()
            train_sampler.set_epoch(epoch)
            steps = train_epoch(
                model, optimizer, train_loader, loss_fn, device, cfg.max_steps_per_epoch
            )
            sync()  # added: the barrier below need not wait for this rank's queued kernels
            dist.barrier()  # the epoch ends when the slowest rank is done
            epoch_time = time.perf_counter() - t0
            images_per_sec = torch.tensor(steps * b / epoch_time).to(device)
            dist.reduce(images_per_sec, 0)  # the course's figure (sum over ranks), on rank 0

            t1 = time.perf_counter()
            v_accuracy, v_loss, seen = test(model, test_loader, loss_fn, device)
            dist.all_reduce(v_accuracy, op=dist.ReduceOp.AVG)
            dist.all_reduce(v_loss, op=dist.ReduceOp.AVG)
            val_accuracy.append(v_accuracy)
            accuracy = float(v_accuracy)  # host sync (the course prints it here)
            eval_sec = time.perf_counter() - t1
            total = seen * world  # every rank sees the same count (padding + drop_last)
            recorder.end_epoch(epoch_time, steps * b * world, eval_sec, accuracy * total, total)

            recent = val_accuracy[-cfg.patience :]
            if (
                cfg.target_accuracy > 0
                and len(recent) == cfg.patience
                and all(acc >= cfg.target_accuracy for acc in recent)  # a sync per tensor
            ):
                if rank == 0:
                    print(f"Early stopping after epoch {epoch + 1}", flush=True)
                break
    return recorder.finish()


def spawn(cfg: Config) -> dict:
    """torch.multiprocessing.spawn(worker, nprocs=num_gpus); rank 0's record comes back through
    a temporary file."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "record.json"
        try:
            args = (cfg, free_port(), str(result), sys.argv, os.getpid())
            mp.spawn(worker, args=args, nprocs=cfg.gpus)
        except Exception as exc:
            if not result.exists():  # another rank failed first: rank 0 never wrote
                raise
            with open(result) as f:  # rank 0 finished, another rank failed after it
                record = json.load(f)
            record["status"] = "failed"
            record["error"] = record.get("error") or describe(exc)
            return record
        with open(result) as f:
            return json.load(f)


def images_per_rank(n_test: int, world: int, b: int) -> int:
    """Test images one rank evaluates: the padded shard, cut to whole batches (drop_last)."""
    return math.ceil(n_test / world) // b * b


def check_supported(cfg: Config) -> None:
    """Options the course's loop has no equivalent for, and runs it cannot make (ConfigError)."""
    refuse_options(cfg, "the course's loop", early_stop=True)
    if torch.cuda.is_available():
        if cfg.gpus > torch.cuda.device_count():
            raise ConfigError(
                f"--gpus {cfg.gpus} but only {torch.cuda.device_count()} CUDA devices are "
                f"visible; use --gpus {torch.cuda.device_count()} or fewer"
            )
    elif cfg.bn == "sync":
        raise ConfigError(
            "--bn sync: torch's SyncBatchNorm (convert_sync_batchnorm) needs CUDA; "
            "use --bn local on CPU"
        )
    ds = load_for(cfg)
    b = per_device(cfg.batch_size, cfg.gpus)
    for name, n in (("training", len(ds.train_x)), ("test", len(ds.test_x))):
        if images_per_rank(n, cfg.gpus, b) == 0:
            raise ConfigError(
                f"the {name} set ({n} images) gives no full per-GPU batch of {b} on "
                f"{cfg.gpus} processes (drop_last=True); use a smaller --batch-size"
            )


def main(argv: list[str] | None = None) -> int:
    """Command line: the trainers' flags. Exit 0 ok, 1 failed, 2 bad input. A rank that fails
    before rank 0 writes its record leaves a failed one (the worker's last traceback line)."""
    cuda = torch.cuda.is_available()
    kind = f"cuda:{torch.cuda.get_device_name(0)}" if cuda else "cpu-simulated"
    fail = failure_recorder(TUTORIAL, device_kind=kind)
    return run_main(argv, COMPARED, prog=PROG, check=check_supported, train=spawn, on_failure=fail)


if __name__ == "__main__":
    sys.exit(main())
