"""The verdicts on a GPU check: did what scripts/gpu_check.sh ran on a GPU machine come out right?

    python -m benchmarks.analysis.gpu_verdicts ARCHIVE.tar.xz | OUT_DIR

reads what gpu_check.sh wrote (its --archive, or the folder before packing) and prints one line
per check, PASS or FAIL, the check and its figure:

- tests: the main suite (tests.xml) and the GPU tests (suite/gpu-tests.xml) have 0 failed (and
  0 errors); a missing file is a FAIL saying it did not run;
- precision, per throughput row: the dtype the row's GPU kernels compute in (their names, read
  from the row's profiler trace: benchmarks.analysis.breakdowns.kernel_dtype_shares) agrees with the
  dtype its record says ran (`ran.activation_dtype`; older records have no `ran`: the config's
  precision then, said in the line), and that dtype is the one asked for. Under bfloat16 more
  than half of the kernel time whose kernel names a dtype is bf16 (XLA's fusions and Inductor's
  Triton kernels name none: 41% of the time of torch's CUDA-graph rows on an H200); under
  float32 none is bf16 or fp16;
- real loop / compute-only, per compiled row (JAX; torch with torch.compile): at least 0.9.
  Eager rows are reported, not judged: an eager step launches every kernel from Python;
- the GPU, per row: the record's and the compute-only run's device_kind start with "cuda:";
- rows reached, per table: every framework its command asked for has a row (a call that ran out
  of time names the rows it did not reach).

Exit status: 0 when every check passes, 1 when one fails, 2 (one line on stderr) when the input
cannot be read (no such file, not a .tar.xz or a folder, no throughput.json). The standard
library and numpy only: judged anywhere, without the frameworks.
"""

from __future__ import annotations

import json
import lzma
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.analysis.breakdowns import kernel_dtype_shares
from common.breakdown import TraceError

MIN_RATIO = 0.9  # a compiled row's real loop against its compute-only step
ASKED = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --precision -> dtype
NO_SUITE = "the main suite did not run (--no-tests?)"
NO_GPU_TESTS = "the GPU tests did not run (step 8)"
FIX = "give the .tar.xz that scripts/gpu_check.sh --archive wrote, or its OUT_DIR"


class InputError(Exception):
    """The input cannot be judged at all (exit 2)."""


@dataclass
class Verdict:
    ok: bool | None  # None: reported, not judged
    check: str
    figure: str

    def line(self) -> str:
        status = {True: "PASS", False: "FAIL", None: "  - "}[self.ok]
        return f"{status}  {self.check:<44}  {self.figure}"


# ---- the input ------------------------------------------------------------------------------


@contextmanager
def opened(path: str | Path) -> Iterator[Path]:
    """The folder gpu_check.sh wrote: `path` itself, or an archive's unpacked into a temporary
    folder (removed after). InputError when it is neither."""
    path = Path(path)
    if path.is_dir():
        yield top(path)
        return
    if not path.is_file():
        raise InputError(f"no file or folder {path}; {FIX}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with tarfile.open(path, "r:xz") as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as exc:
            raise InputError(f"{path} is not a readable .tar.xz archive ({exc}); {FIX}") from None
        yield top(Path(tmp))


def top(folder: Path) -> Path:
    """gpu_check.sh's OUT_DIR: `folder`, or the one folder it holds (an archive holds OUT_DIR)."""
    while True:
        entries = list(folder.iterdir())
        if len(entries) != 1 or not entries[0].is_dir():
            return folder
        folder = entries[0]


def read_json(path: Path) -> Any:
    """The JSON in `path`; InputError (one line naming the file) when it cannot be read."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path} as JSON ({exc}); {FIX}") from None


def tables(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every throughput table under `root` (gpu_suite.sh's step 1 writes throughput-bf16/)."""
    found = sorted(root.rglob("throughput.json"))
    if not found:
        raise InputError(f"no throughput.json under {root.name}/ (step 1 did not run?); {FIX}")
    out = []
    for path in found:
        table = read_json(path)
        if not isinstance(table, dict) or "rows" not in table:
            raise InputError(f"{path.relative_to(root)} is not a throughput table (no rows)")
        out.append((path.parent, table))
    return out


# ---- the checks -----------------------------------------------------------------------------


def junit(path: Path, check: str, absent: str) -> Verdict:
    """0 failed and 0 errors in JUnit XML file `path`, and some test ran."""
    if not path.is_file():
        return Verdict(False, check, f"{path.name} absent: {absent}")
    try:
        root = ET.fromstring(path.read_bytes())
    except (OSError, ET.ParseError) as exc:
        return Verdict(False, check, f"{path.name} unreadable ({exc})")
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key) or 0)
    failed = [f"{case.get('classname', '')}::{case.get('name', '')}"
              for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]  # fmt: skip
    bad = counts["failures"] + counts["errors"]
    passed = counts["tests"] - bad - counts["skipped"]
    figure = f"{counts['tests']} tests: {passed} passed, {bad} failed, {counts['skipped']} skipped"
    if failed:
        figure += "; failed: " + ", ".join(failed)
    if counts["tests"] == 0:
        return Verdict(False, check, f"no test ran ({path.name} lists none)")
    return Verdict(bad == 0 and not failed, check, figure)


def local(where: Path, table: dict[str, Any], path: str) -> Path:
    """A path the GPU machine wrote into a table (absolute there), found in this copy."""
    out = str((table.get("settings") or {}).get("out") or "")
    if out and path.startswith(out.rstrip("/") + "/"):
        return where / path[len(out.rstrip("/")) + 1 :]
    if not path.startswith("/"):
        return where / path
    if "/runs/" in path:
        return where / "runs" / path.split("/runs/", 1)[1]
    return Path(path)


def family(framework: str) -> str:
    return next((f for f in ("torch", "jax", "mxnet") if framework.startswith(f)), "")


def precision(where: Path, table: dict[str, Any], row: dict[str, Any], label: str) -> Verdict:
    """The row's kernels compute in the dtype its record says ran, the dtype asked for."""
    check = f"precision {label}"
    verdicts = []
    for real in row.get("real") or []:
        if real.get("status") != "ok":
            continue
        record = read_json(local(where, table, str(real.get("record") or "")))
        config = record.get("config") or {}
        asked = ASKED.get(str(config.get("precision")), str(config.get("precision")))
        said = (record.get("ran") or {}).get("activation_dtype")
        whence = "record's ran" if said else "config's precision: record has no 'ran'"
        said = said or asked
        if said != asked:
            return Verdict(False, check, f"record says {said} ran, {asked} was asked")
        trace = real.get("trace") or (record.get("profile") or {}).get("trace")
        if not trace:
            if not (table.get("settings") or {}).get("profile"):
                return Verdict(None, check, "not profiled (no --profile): not judged")
            return Verdict(False, check, "the record names no trace (its profiler failed?)")
        path = local(where, table, str(trace))
        if not path.is_file():
            return Verdict(False, check, f"trace {path.name} absent (packed without traces?)")
        shares = kernel_dtype_shares(path, family(str(row.get("framework"))))
        verdicts.append(judge_dtype(check, said, whence, shares))
    if not verdicts:
        return Verdict(False, check, f"no ok run to judge (status {row.get('status')})")
    return next((v for v in verdicts if not v.ok), verdicts[0])


def judge_dtype(check: str, dtype: str, whence: str, shares: dict[str, Any]) -> Verdict:
    named = shares["named"]
    of_named = {k: shares[k] / named if named else 0.0 for k in ("bfloat16", "float16", "float32")}
    figure = (
        f"bf16 {of_named['bfloat16']:.2f}, fp32 {of_named['float32']:.2f}"
        + (f", fp16 {of_named['float16']:.2f}" if of_named["float16"] else "")
        + f" of the kernel time naming a dtype ({named:.0%} of {shares['kernel_ms']:.1f} ms)"
    )
    if dtype in ("bfloat16", "float16"):
        want = f"want > 0.5 {'bf16' if dtype == 'bfloat16' else 'fp16'} for {dtype} ({whence})"
        return Verdict(of_named[dtype] > 0.5, check, f"{figure}; {want}")
    if dtype == "float32":
        ok = shares["bfloat16"] + shares["float16"] == 0
        return Verdict(ok, check, f"{figure}; want 0 bf16 for float32 ({whence})")
    return Verdict(False, check, f"{dtype}: not a dtype this check knows ({whence})")


def ratio(row: dict[str, Any], label: str) -> Verdict:
    """A compiled row's real loop against its compute-only step."""
    check = f"real/compute-only {label}"
    mode = str(row.get("mode") or "")
    value = row.get("ratio")
    if row.get("status") != "ok" or not isinstance(value, (int, float)):
        status = f"{row.get('status')} {row.get('note') or ''}".strip()
        return Verdict(False, check, f"no ratio: row status {status}")
    real, compute = row.get("real_images_per_sec") or 0, row.get("compute_images_per_sec") or 0
    figure = f"{value:.3f} = {real:,.0f} / ({row.get('devices')} x {compute:,.0f}) img/s"
    if family(str(row.get("framework"))) == "jax" or "torch.compile" in mode:
        return Verdict(value >= MIN_RATIO, check, f"{figure} (at least {MIN_RATIO} wanted)")
    if mode.startswith("eager"):
        return Verdict(None, check, f"eager: host-bound by nature, not judged ({figure})")
    return Verdict(None, check, f"{mode or 'mode unknown'}: not judged ({figure})")


def saw_gpu(where: Path, table: dict[str, Any], row: dict[str, Any], label: str) -> Verdict:
    """The row's record and its compute-only run ran on a GPU."""
    kinds = []
    for real in row.get("real") or []:
        record = local(where, table, str(real.get("record") or ""))
        said = read_json(record).get("device_kind") if record.is_file() else None
        kinds += [said, real.get("device_kind")]
    kinds += [c.get("device_kind") for c in row.get("compute") or []]
    seen = [str(k) for k in kinds if k]
    ok = bool(seen) and all(k.startswith("cuda:") for k in seen)
    return Verdict(ok, f"saw the GPU {label}", ", ".join(dict.fromkeys(seen)) or "no device_kind")


def reached(table: dict[str, Any], where: str) -> Verdict:
    """Every framework the table's command asked for (`--frameworks`) has a row."""
    command = table.get("command") or []
    asked = []
    if "--frameworks" in command:
        asked = command[command.index("--frameworks") + 1].split(",")
    missing = [f for f in asked if f not in {row.get("framework") for row in table["rows"]}]
    figure = f"not reached: {', '.join(missing)}" if missing else f"all {len(asked)} rows"
    return Verdict(not missing, f"rows reached ({where})", figure)


def verdicts(root: Path) -> list[Verdict]:
    """Every check on gpu_check.sh's OUT_DIR `root`. InputError when it holds no table."""
    found = tables(root)
    suite = root / "suite" if (root / "suite").is_dir() else root
    out = [
        junit(root / "tests.xml", "main suite: 0 failed", NO_SUITE),
        junit(suite / "gpu-tests.xml", "GPU tests: 0 failed", NO_GPU_TESTS),
    ]
    for where, table in found:
        out.append(reached(table, where.name))
        for row in table["rows"]:
            label = f"{row.get('framework')} x{row.get('devices')}"
            label += f" ({where.name})" if len(found) > 1 else ""
            checks: tuple[tuple[str, Callable[..., Verdict], tuple[Any, ...]], ...] = (
                ("precision", precision, (where, table, row, label)),
                ("real/compute-only", ratio, (row, label)),
                ("saw the GPU", saw_gpu, (where, table, row, label)),
            )
            for name, judge, args in checks:
                try:
                    out.append(judge(*args))
                except (InputError, TraceError, OSError, ValueError, KeyError, TypeError) as exc:
                    out.append(Verdict(False, f"{name} {label}", f"unreadable: {exc}"))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        usage = "python -m benchmarks.analysis.gpu_verdicts ARCHIVE_OR_FOLDER"
        print(f"gpu_verdicts: usage: {usage}; {FIX}", file=sys.stderr)
        return 2
    try:
        with opened(args[0]) as root:
            results = verdicts(root)
    except InputError as exc:
        print(f"gpu_verdicts: {exc}", file=sys.stderr)
        return 2
    for v in results:
        print(v.line())
    failed = sum(v.ok is False for v in results)
    judged = sum(v.ok is not None for v in results)
    print(f"gpu_verdicts: {judged - failed} of {judged} checks pass"
          + (f", {failed} FAIL" if failed else ""))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
