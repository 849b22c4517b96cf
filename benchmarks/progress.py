"""Live progress of a comparison: which run, epoch E/T, current test accuracy, elapsed time and
a remaining-time estimate, for the current run and for the whole sweep.

On a terminal this is a `rich` live display; when stdout is not a terminal (CI logs, pipes) or
rich is not installed, the same information is printed as plain lines, one per event.
Epoch events arrive from the thread that reads a run's output, so every method is thread-safe.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from typing import Any

# The per-epoch line printed by common.results.RunRecorder.end_epoch (rank 0 only).
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)((?: \w+=\S+)+)\s*$")


def parse_epoch_line(line: str) -> dict[str, float] | None:
    """`epoch 2/6 sec=1.5 ... test_accuracy=0.9` -> {"epoch": 2, "epochs": 6, "sec": 1.5, ...}."""
    m = EPOCH_LINE.match(line.strip())
    if not m:
        return None
    row: dict[str, float] = {"epoch": int(m.group(1)), "epochs": int(m.group(2))}
    for item in m.group(3).split():
        key, _, value = item.partition("=")
        try:
            row[key] = float(value)
        except ValueError:
            continue
    return row


def duration(sec: float | None) -> str:
    if sec is None:
        return "?"
    sec = max(0.0, sec)
    if sec < 60:
        return f"{sec:.0f}s"
    if sec < 3600:
        return f"{int(sec // 60)}m{int(sec % 60):02d}s"
    return f"{int(sec // 3600)}h{int(sec % 3600 // 60):02d}m"


class PlainProgress:
    """One line per event, for logs. Elapsed and remaining time are counted in epochs (the unit
    every run reports); every event updates them and shows itself under the lock (`started`,
    `show_epoch`, `show_sweep`: what RichProgress draws instead)."""

    def __init__(self, planned_epochs: list[int], stream: Any = None):
        self.total_epochs, self.total_runs = sum(planned_epochs), len(planned_epochs)
        self.t0 = self.run_t0 = time.monotonic()
        self.done_epochs = 0  # epochs of finished runs count in full, even if stopped early
        self.run_index, self.run_epochs, self.run_done = 0, 1, 0
        self.stream = stream or sys.stdout
        self.lock = threading.Lock()
        self.label = ""

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run_elapsed(self) -> float:
        return time.monotonic() - self.run_t0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def run_remaining(self) -> float | None:
        done = self.run_done
        return self.run_elapsed() / done * (self.run_epochs - done) if done else None

    def remaining(self) -> float | None:
        done = self.done_epochs + self.run_done
        return self.elapsed() / done * (self.total_epochs - done) if done else None

    def print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start_run(self, label: str, epochs: int, log: str) -> None:
        with self.lock:
            self.run_index, self.run_t0 = self.run_index + 1, time.monotonic()
            self.run_epochs, self.run_done = max(1, epochs), 0
            self.label = f"[{self.run_index}/{self.total_runs}] {label}"
            self.started(epochs, log)

    def epoch(self, row: dict[str, float]) -> None:
        with self.lock:
            self.run_done = int(row["epoch"])
            self.show_epoch(row)

    def end_run(self, summary: str) -> None:
        with self.lock:
            self.done_epochs, self.run_done = self.done_epochs + self.run_epochs, 0
            self.show_sweep()
            self.print(f"{self.label}: {summary}")

    def started(self, epochs: int, log: str) -> None:
        self.print(f"{self.label}: started (log: {log})")

    def show_epoch(self, row: dict[str, float]) -> None:
        self.print(f"{self.label}: epoch {int(row['epoch'])}/{int(row['epochs'])} "
                   f"test_accuracy={row.get('test_accuracy', float('nan')):.4f} "
                   f"sec={row.get('sec', float('nan')):.2f} | run {duration(self.run_elapsed())}, "
                   f"~{duration(self.run_remaining())} left | all {duration(self.elapsed())}, "
                   f"~{duration(self.remaining())} left")  # fmt: skip

    def show_sweep(self) -> None:
        return None


class RichProgress(PlainProgress):
    """A live display: the current run (epochs, accuracy, elapsed, remaining) and the sweep."""

    def __init__(self, planned_epochs: list[int], console: Any):
        super().__init__(planned_epochs)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            refresh_per_second=4,
        )
        self.console = console
        self.sweep = self.progress.add_task(
            "all runs", total=self.total_epochs, info="epochs, ~? left"
        )
        self.run: Any = None

    def __enter__(self) -> RichProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def print(self, text: str) -> None:
        self.progress.console.print(text, markup=False, highlight=False)

    def show_sweep(self) -> None:
        self.progress.update(
            self.sweep,
            completed=self.done_epochs + self.run_done,
            info=f"epochs  {duration(self.elapsed())} elapsed, ~{duration(self.remaining())} left",
        )

    def started(self, epochs: int, log: str) -> None:
        if self.run is not None:
            self.progress.remove_task(self.run)
        self.run = self.progress.add_task(self.label, total=epochs, info="starting")
        self.show_sweep()

    def show_epoch(self, row: dict[str, float]) -> None:
        self.progress.update(
            self.run,
            completed=int(row["epoch"]),
            info=(
                f"epochs  test_accuracy={row.get('test_accuracy', float('nan')):.4f}  "
                f"{duration(self.run_elapsed())} elapsed, ~{duration(self.run_remaining())} left"
            ),
        )
        self.show_sweep()


def make_progress(planned_epochs: list[int]) -> PlainProgress:
    """A rich live display on a terminal, plain lines otherwise."""
    try:
        from rich.console import Console
    except ImportError:
        return PlainProgress(planned_epochs)
    console = Console()
    if not console.is_terminal:
        return PlainProgress(planned_epochs)
    return RichProgress(planned_epochs, console)
