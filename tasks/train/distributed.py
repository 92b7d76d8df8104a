"""Several training processes: process groups formed in rounds, model wrappers, shared decisions.

Launch: torchrun (the local backend runs `torchrun --standalone --nproc_per_node=N -m
tasks.pretrain ...`; SageMaker's torch_distributed and HyperPod run the same). Each process torchrun
starts is a per-rank supervisor (tasks/train/supervisor.py) that runs the rank's training in a
child worker process and restarts that child, alone, when it fails.

Rounds: workers meet in torchrun's agent store (a TCPStore that outlives every worker). Each
round r gets a fresh process group under the prefix round<r>; a worker joins the current round
unless it is already full, in which case the round is stale (someone in it died) and the joiner
moves everyone on to round r+1. A surviving worker whose collective fails because a peer died
(gloo: "Connection reset by peer"; NCCL: a timeout or async error) leaves its group, moves the
round on and joins the next one, keeping its process, imports, data and model: only the failed
worker is restarted. Everyone then loads the checkpoint rank 0 chose.

Failure notice through the store: whoever moves the round on (a survivor that got an error, or
the failed rank's replacement finding its old round full) also sets round<r>/stale. Every worker
has a thread blocked on that key (its own store connection, no polling). When it fires while the
worker is still in round r, the worker's collectives may be blocked on a peer that will never
answer, so the thread
  - NCCL: aborts the communicators (distributed_c10d._abort_process_group): a collective blocked
    on the dead peer returns an error at once, the training thread takes it as a peer failure,
    destroys the group and joins the next round in place (DDP; FSDP restarts the worker);
  - gloo: has nothing that unblocks a collective (ProcessGroupGloo.abort() returns and the call
    stays blocked until the peer's socket closes; measured), but a dead peer's socket closing
    already makes the call fail at once;
and if the worker is still in round r STALE_GRACE_S later (blocked on a peer that is hung, not
dead, or behind a lost network), it exits with STALE_GROUP_EXIT and its supervisor restarts it,
from the hot spare: a fast restart instead of waiting out the collective timeout.

NCCL_ENV: TORCH_NCCL_ASYNC_ERROR_HANDLING=2 ("CleanUpOnly": on an error or timeout the NCCL
watchdog aborts the communicators and the error is raised in the training thread, which rejoins)
instead of torch's default 3 ("SkipCleanUp": end the process without aborting), which would make
every survivor of a peer failure restart; 1 aborts and then ends the process, 0 does nothing and
leaves a failed collective blocked. The abort above is the same clean-up, only sooner: it does not
wait for the collective timeout.

Timeouts: every collective and rendezvous has `timeout` (the hang watchdog's wait plus a margin,
so the watchdog fires first and dumps stacks); the flight recorder dumps the last NCCL
collectives on timeout.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

log = logging.getLogger(__name__)

# Set before the first NCCL process group exists; a value already in the environment wins.
NCCL_ENV = {
    # a failed or timed-out collective aborts the communicator and raises: the rank rejoins
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # flight recorder: the last collectives per rank
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # ... written out when one times out
    "TORCH_NCCL_ENABLE_MONITORING": "1",  # a stuck NCCL watchdog thread also ends the process
}


STALE_GROUP_EXIT = 75  # a worker stuck in a group its peers have left; its supervisor restarts it
STALE_GRACE_S = 10.0  # time for the training thread to get its error and leave the stale round


class PeerFailure(RuntimeError):
    """A collective failed because another rank died or hung: rejoin a new round."""


def is_peer_failure(exc: BaseException) -> bool:
    if isinstance(exc, PeerFailure) or isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("gloo", "Gloo", "NCCL", "Connection reset", "Connection closed",
                            "Broken pipe", "Timed out", "timed out", "peer"))


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout: datetime.timedelta
    parallelism: str = "ddp"
    store: Any = None
    key: str = "llmops"
    round: int = -1
    shared: int = field(default=0)  # decisions shared in this round (same count on every rank)
    watch_store: Any = None  # a second connection to the store, for the stale-round watcher
    stale_grace_s: float = STALE_GRACE_S
    in_round: bool = False  # between join() and leave(): the watcher acts only then
    stale_notices: list[float] = field(default_factory=list)  # when the watcher fired
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _watcher: threading.Thread | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, device: torch.device, *, parallelism: str, timeout_s: float
                 ) -> "DistContext | None":
        """None for a single process; else this rank's context, connected to the agent store."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not os.environ.get("MASTER_ADDR"):
            raise RuntimeError(
                f"WORLD_SIZE is {world} but this process was not started by torchrun. Launch "
                "several processes with `torchrun --nproc_per_node=N -m tasks.pretrain ...` (the "
                "local backend does when JobSpec.nproc_per_node > 1): the workers meet in "
                "torchrun's store, which outlives any one of them.")
        if device.type == "cuda":
            for name, value in NCCL_ENV.items():
                os.environ.setdefault(name, value)
            os.environ.setdefault("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(int(timeout_s) + 60))
        timeout = datetime.timedelta(seconds=timeout_s)
        def connect() -> Any:
            return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 is_master=False, timeout=timeout)

        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        return cls(rank=int(os.environ["RANK"]), world_size=world,
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")), device=device,
                   timeout=timeout, parallelism=parallelism, store=connect(),
                   key=f"llmops/{run_id}", watch_store=connect())

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    # -- rounds ------------------------------------------------------------------------------
    def join(self) -> int:
        """Join the current round's process group (blocks until all ranks are in it)."""
        round_key = f"{self.key}/round"
        self.store.compare_set(round_key, "", "0")  # the first joiner creates round 0
        while True:
            r = int(self.store.get(round_key))
            if self.store.add(f"{self.key}/round{r}/joined", 1) <= self.world_size:
                break
            # full: a round whose member died; move everyone on (no-op if someone already did)
            self._move_on(r)
        kwargs: dict[str, Any] = {}
        if self.device.type == "cuda":
            kwargs["device_id"] = self.device  # eager NCCL init: errors surface here, not later
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"{self.key}/round{r}/pg", self.store),
                                rank=self.rank, world_size=self.world_size, timeout=self.timeout,
                                **kwargs)
        with self._lock:
            self.round, self.shared, self.in_round = r, 0, True
        if self.watch_store is not None and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_rounds, name="stale-round-watcher",
                                             daemon=True)
            self._watcher.start()
        return r

    def leave(self, *, failed: bool) -> None:
        """Destroy this round's group; after a failure also move the round on."""
        with self._lock:
            self.in_round = False
        if failed and self.round >= 0:
            self._move_on(self.round)
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - a broken group may fail to tear down cleanly
            log.warning("destroying the process group of round %d failed: %s", self.round, exc)
        gc.collect()  # drop the old DDP reducer and its hooks before the model is wrapped again

    def _move_on(self, r: int) -> None:
        """Round r is over (a member failed): the next joiner starts round r+1, and every member
        still in round r hears of it through round<r>/stale."""
        self.store.compare_set(f"{self.key}/round", str(r), str(r + 1))
        self.store.set(f"{self.key}/round{r}/stale", "1")

    def _watch_rounds(self) -> None:
        """The stale-round watcher (see the module docstring): blocks on round<r>/stale of the
        round this rank is in, on its own store connection."""
        done = -1
        while True:
            with self._lock:
                r = self.round if self.in_round else -1
            if r < 0 or r == done:
                time.sleep(0.05)
                continue
            try:
                self.watch_store.wait([f"{self.key}/round{r}/stale"], datetime.timedelta(hours=1))
            except Exception:  # noqa: BLE001 - a timeout (wait again) or the store gone (retry)
                time.sleep(1.0)
                continue
            done = r
            self._on_stale(r)

    def _on_stale(self, r: int) -> None:
        with self._lock:
            if not (self.in_round and self.round == r):
                return  # it left round r on its own (it got the error first)
            self.stale_notices.append(time.time())
        log.warning("round %d is over (a peer failed, the store says); %s", r,
                    "aborting this rank's NCCL communicators" if self.backend == "nccl" else
                    f"waiting {self.stale_grace_s:.0f}s for this rank's collectives to fail")
        if self.backend == "nccl":
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as exc:  # noqa: BLE001 - the grace below still ends a stuck worker
                log.warning("aborting the process group of round %d failed: %s", r, exc)
        deadline = time.monotonic() + self.stale_grace_s
        while time.monotonic() < deadline:
            with self._lock:
                if not (self.in_round and self.round == r):
                    return
            time.sleep(0.05)
        log.error("still blocked in round %d %.0fs after its end (a peer hung, not dead); "
                  "exiting with %d for the supervisor to restart this worker", r,
                  self.stale_grace_s, STALE_GROUP_EXIT)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(STALE_GROUP_EXIT)

    def share(self, name: str, compute: Callable[[], Any]) -> Any:
        """Rank 0 computes a JSON value, every rank returns it (through the store, so a rank
        that is still loading does not hold a collective open)."""
        self.shared += 1
        key = f"{self.key}/round{self.round}/share{self.shared}-{name}"
        if self.rank == 0:
            value = compute()
            self.store.set(key, json.dumps(value))
            return value
        return json.loads(self.store.get(key))

    # -- collectives -------------------------------------------------------------------------
    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.div_(self.world_size)

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    # -- models ------------------------------------------------------------------------------
    def wrap(self, model: nn.Module, init_weights: Callable[[], dict[str, torch.Tensor]] | None = None
             ) -> nn.Module:
        """DDP: a replica per rank, gradients averaged during backward. FSDP (fully_shard):
        parameters, gradients and optimizer state sharded across ranks, one unit per block
        (gathered just before the block runs), for models that do not fit one device.

        FSDP of a model built on the meta device: shard first, then allocate only this rank's
        shards on its device (to_empty) and fill them from init_weights(), the full initial
        weights, which only rank 0 computes (on its CPU) and broadcasts one tensor at a time:
        no device ever holds the whole model, and every world size starts from the same
        weights as a single-process build."""
        if self.parallelism == "fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 set_model_state_dict)
            from torch.distributed.fsdp import fully_shard

            on_meta = any(p.is_meta for p in model.parameters())
            from tasks.model.causal_lm import decoder_layers

            units = decoder_layers(model)  # GPT blocks, LlamaDecoderLayer ...
            log.info("FSDP units: %d %s, then the rest of the model", len(units),
                     ", ".join(sorted({type(b).__name__ for b in units})) or "-")
            for block in units:
                fully_shard(block)
            fully_shard(model)
            if on_meta:
                if init_weights is None:
                    raise ValueError("a model built on the meta device needs init_weights.")
                model.to_empty(device=self.device)
                full = init_weights() if self.rank == 0 else {}
                set_model_state_dict(model, full, options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=True))
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(model, device_ids=ids, gradient_as_bucket_view=True)

    def checkpoint_group(self) -> Any:
        """A gloo group of all ranks for sharded checkpoints: their collectives run on a
        background thread while training uses the main group, and gloo carries the small CPU
        messages (write plans, file lists) whatever the training backend."""
        return dist.new_group(backend="gloo", timeout=self.timeout)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """FSDP: this rank's shards of the model and optimizer state (DTensors, no copy, no gather),
    as torch.distributed.checkpoint saves them. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike,
                       fetch: Callable[[list[str]], None] | None = None) -> None:
    """FSDP: read this rank's shards of a checkpoint written by torch.distributed.checkpoint,
    whatever world size wrote it (DCP reshards), into the model and optimizer. fetch(names), if
    given, is called with the files this rank's load plan reads before they are read: a rank
    restoring on a fresh node fetches exactly its own part, in parallel with the other ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_state(model, optimizer)
    if fetch is None:
        dcp.load(state, checkpoint_id=os.fspath(path))
    else:
        dcp.load(state, storage_reader=_fetching_reader(path, fetch))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def _fetching_reader(path: str | os.PathLike, fetch: Callable[[list[str]], None]) -> Any:
    """DCP's file reader, calling fetch(files) with the files of the rank's plan first."""
    from torch.distributed.checkpoint import FileSystemReader

    class FetchingReader(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            fetch(sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}))
            return super().read_data(plan, planner)

    return FetchingReader(os.fspath(path))


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optim_state: dict) -> None:
    """FSDP from a checkpoint of one process or DDP: every rank loads the full state and keeps
    its own shard of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
