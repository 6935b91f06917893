"""Calibration over several processes: torchrun starts them, torch.distributed reduces their sums.

Data parallel. Process r of W (torchrun's RANK and WORLD_SIZE) takes samples s + r·B … s + r·B + B − 1 of
every round of W·B samples starting at s, so after any round the samples counted are a prefix of the
sample list: a resumed run continues from there, on any number of processes. At a checkpoint the float64
sums gathered since the last one are reduced to rank 0 (SUM; scaling by MAX, all equal), probe rows are
gathered to it, and rank 0 alone writes. Addition commutes, so the totals equal one process's up to
floating-point rounding: Σ_r Σ_{n∈r} x_n = Σ_n x_n.

Backends: NCCL for CUDA tensors, gloo on the CPU. A process that dies ends the run: torchrun's agent stops
the others (SIGTERM), and since only rank 0 writes, through a temporary file renamed into place, no
statistics file is ever half-written (a temporary file left by a process stopped mid-write is removed
when the run is resumed).
"""

import logging
import os
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch

from oscar_core.errors import OscarError
from oscar_core.formats.fileio import atomic_write_json

LAUNCHED = "OSCAR_LAUNCHED"  # set for the processes of launch(): the launcher reports their errors


@dataclass(frozen=True)
class Group:
    """This process's place among the calibration processes (one process: rank 0 of 1)."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def first(self) -> bool:
        return self.rank == 0


def from_env() -> Group:
    """The group torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", 1))
    return Group(rank=int(env.get("RANK", 0)), world=world, local_rank=int(env.get("LOCAL_RANK", 0)),
                 local_world=int(env.get("LOCAL_WORLD_SIZE", world)))


def is_first_process() -> bool:
    return from_env().first


def backend(device: str) -> str:
    """nccl for CUDA, gloo for the CPU; one line when this torch has no NCCL."""
    if not device.startswith("cuda"):
        return "gloo"
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        raise OscarError("NCCL is not available in this torch build: calibrating on several GPUs needs it "
                         "(use --gpus 1, or a CUDA build of torch)")
    return "nccl"


def process_gpus(group: Group, visible: int, shard: bool) -> list[int]:
    """The GPU indices this process uses: its own one, or (shard) its 1/local_world share of the visible ones."""
    if visible < group.local_world:
        raise OscarError(f"{group.local_world} GPU processes asked for, but only {visible} CUDA device(s) are visible")
    if not shard:
        return [group.local_rank]
    share = visible // group.local_world
    return list(range(group.local_rank * share, (group.local_rank + 1) * share))


def join(device: str) -> Group:
    """Join the process group torchrun set up (nothing to do for a single process)."""
    group = from_env()
    if group.world == 1:
        return group
    name = backend(device)
    if not torch.distributed.is_initialized():
        kwargs = {}
        if name == "nccl":
            torch.cuda.set_device(torch.device(device))
            kwargs["device_id"] = torch.device(device)
        torch.distributed.init_process_group(name, **kwargs)
    return group


def barrier(group: Group) -> None:
    if group.world > 1:
        torch.distributed.barrier()


def leave(group: Group) -> None:
    if group.world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def agree(group: Group, flag: bool, device: str) -> bool:
    """Rank 0's flag, on every rank (a checkpoint is a collective step: all ranks must take it together)."""
    if group.world == 1:
        return flag
    x = torch.tensor([int(flag)], device=device)
    torch.distributed.broadcast(x, 0)
    return bool(x.item())


def broadcast(group: Group, obj):
    """Rank 0's object, on every rank."""
    if group.world == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, 0)
    return box[0]


def reduce_to_first(group: Group, sums: dict[str, torch.Tensor], probe_rows: list, device: str,
                    gather_probes: bool) -> tuple[dict[str, torch.Tensor], list] | tuple[None, None]:
    """Sum every rank's sums on rank 0 (scaling: max); gather probe rows there when gather_probes.

    Returns (sums, probe rows) on rank 0, (None, None) elsewhere. gather_probes must be the same on all ranks.
    """
    if group.world == 1:
        return sums, probe_rows
    out = {}
    for name in sorted(sums):
        x = sums[name].to(device)
        op = torch.distributed.ReduceOp.MAX if name == "scaling" else torch.distributed.ReduceOp.SUM
        torch.distributed.reduce(x, 0, op=op)
        out[name] = x
    rows = []
    if gather_probes:
        gathered = [None] * group.world if group.first else None
        torch.distributed.gather_object(probe_rows, gathered, dst=0)
        rows = [row for part in gathered for row in part] if group.first else []
    elif probe_rows:
        raise RuntimeError("probe rows outside the probe window")  # a bug, not a user error
    return (out, rows) if group.first else (None, None)


def record_error(e: BaseException) -> None:
    """Leave e for torchrun's agent in the file it names in TORCHELASTIC_ERROR_FILE, in the JSON its `record`
    writes, but whole or not at all (a temporary file, then a rename): when a peer dies the agent stops this
    process with SIGTERM and reads its file at once, and torch's own writer, killed half-way, left it empty (the
    agent then failed on the JSON instead of reporting the death)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    atomic_write_json(path, {"message": {"message": f"{type(e).__name__}: {e}",
                                         "extraInfo": {"py_callstack": "".join(traceback.format_exception(e)),
                                                       "timestamp": str(int(time.time()))}}})


def failure_line(rank: int, failure) -> str:
    """One line for the first process that failed (torchrun's ProcessFailure)."""
    message = failure.message
    if isinstance(message, dict):
        text = str(message.get("message", "")).strip().splitlines()[0] if message.get("message") else ""
        if text.startswith("OscarError: "):
            return text.removeprefix("OscarError: ")
        return f"calibration process {rank} failed: {text}"
    if failure.exitcode < 0:
        return f"calibration process {rank} died: {message}; no statistics were written for the unfinished round"
    return f"calibration process {rank} exited with code {failure.exitcode}"


def root_failure(failures: dict) -> tuple:
    """The (rank, failure) that caused the others. A process killed from outside (any signal but the SIGTERM
    with which torchrun stops the rest) comes first, then one that raised an OscarError, then the earliest.
    A killed process's peers fail too (gloo: connection reset) and their records can be stamped earlier than
    the agent's notice of the death, so the earliest failure is not always the cause."""
    def cause(item):
        rank, failure = item
        raised = isinstance(failure.message, dict)
        killed = not raised and failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM
        user_error = raised and str(failure.message.get("message", "")).startswith("OscarError: ")
        return 0 if killed else 1 if user_error else 2, failure.timestamp, rank

    return min(failures.items(), key=cause)


def launch(args: list[str], processes: int, module: str = "oscar_cli") -> None:
    """Run `python -m module args` in `processes` processes on this host with torchrun (torch.distributed.run).

    Rank 0 keeps the terminal; the others' output goes to a temporary log directory. A failure raises one
    OscarError line: the message of the process whose failure caused the others (root_failure), or how it died.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    saved_env = {name: os.environ.get(name) for name in (LAUNCHED, "OMP_NUM_THREADS")}
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    os.environ[LAUNCHED] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun would set, without its warning
    try:
        with tempfile.TemporaryDirectory(prefix="oscar-ranks-") as logs:
            others = ",".join(f"{r}:3" for r in range(1, processes)) or "0"
            parsed = get_args_parser().parse_args(
                ["--standalone", "--nnodes", "1", "--nproc-per-node", str(processes), "--log-dir", logs,
                 "--redirects", others, "--tee", "0", "--max-restarts", "0", "-m", module, *args])
            for name in list(logging.root.manager.loggerDict):  # the agent's own reports: we print one line
                if name.startswith("torch.distributed"):
                    logging.getLogger(name).setLevel(logging.CRITICAL)
            run(parsed)
    except ChildFailedError as e:
        rank, failure = root_failure(e.failures)
        raise OscarError(failure_line(rank, failure)) from None
    except SignalException:
        raise KeyboardInterrupt from None
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)


def check_processes(processes: int, device: str | None) -> None:
    """Refuse before starting anything: fewer than one process, or more GPU processes than GPUs."""
    if processes < 1:
        raise OscarError("--gpus must be at least 1")
    if processes == 1 or (device or "").startswith("cpu"):
        return
    if not torch.cuda.is_available():
        raise OscarError(f"--gpus {processes} asked for, but no CUDA device is available (use --device cpu to run "
                         "several CPU processes)")
    backend("cuda")
    visible = torch.cuda.device_count()
    if processes > visible:
        raise OscarError(f"--gpus {processes} asked for, but only {visible} CUDA device(s) are visible")


def calibration_args(req, out_dir) -> list[str]:
    """The `calibrate` command line that reproduces a CalibrationRequest (for the processes launch() starts)."""
    args = ["calibrate", *([req.model] if req.model else []), "--out", str(out_dir), "--split", req.split,
            "--text-field", req.text_field, "--samples", str(req.samples), "--seq-len", str(req.seq_len),
            "--batch-size", str(req.batch_size), "--seed", str(req.seed), "--checkpoint-every", str(req.checkpoint_s)]
    for flag, value in (("--data", req.data), ("--device", req.device), ("--dtype", req.dtype)):
        if value:
            args += [flag, value]
    return args + (["--shard"] if req.shard else [])


def launch_calibration(req, out_dir, processes: int) -> None:
    """`oscar calibrate` in `processes` data-parallel processes (torchrun), after the checks that need none."""
    check_processes(processes, req.device)
    launch(calibration_args(req, out_dir), processes)
