"""Cluster health inside a training job: burn-in before a node joins, stragglers, and silent data
corruption (SDC) between data-parallel replicas.

At thousands of accelerators the failures that cost the most do not crash anything: a node
whose link or device is slow holds every synchronous step back, a device that computes subtly
wrong numbers lets the loss drift for hours, and a node that should never have joined fails
both ways. Three checks, each cheap enough to leave on:

  burn-in     once, when the job's first process group forms: a deterministic matmul of small
              integers (every product and sum exact in float32, compared with the same product
              in int64) and an all-reduce of a known tensor (its sum is exact too), timed. A
              rank with a wrong result, or an all-reduce slower than burn_in_min_gbps, makes
              the job refuse to start, naming the rank, its host and the reason.
  stragglers  every rank times its own part of each step: from the step's start to its first
              wait on the others (the last micro-batch's backward, where DDP's gradient
              all-reduce begins). Every straggler_check_every steps one all_gather of one float
              per rank (the mean since the last check) compares ranks: a rank at >=
              straggler_factor x the median of the others for straggler_steps consecutive
              checks (and STRAGGLER_MIN_GAP_S behind) is a straggler, named in the
              log, the events, MLflow and the job's result; the policy warns or stops the job
              for its node to be replaced (NODE_UNHEALTHY_EXIT).
  SDC         before each checkpoint (so that none holds weights no check has seen) and every
              sdc_check_every steps, each replica hashes its parameters exactly (their bytes
              summed as integers of two widths, param_checksum, on the device) and one
              all_gather of two integers per rank compares them: DDP replicas must be bitwise
              equal. The ranks outside the majority are named; the job rolls back to the newest
              checkpoint at or before the last check that agreed (the spike guard's rollback
              path, tasks/train/loop.py); the same rank again stops the job for its node to be
              replaced. FSDP shards are not replicas: there the check is off.

Every rank acts on the same decision (JobHealth: rank 0's, shared), so the job stops as one: with
a fixed world size, a node that leaves alone would only leave its peers waiting for it.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

# The worker exits with NODE_UNHEALTHY_EXIT when the job must go on without a node (burn-in
# failed, a straggler under straggler_action=restart, SDC on the same rank twice): the
# supervisor does not restart it on the same node; the job fails with the reason in its log.
from tasks.train.supervisor import NODE_UNHEALTHY_EXIT  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

# A rank slower by less than this per step is not worth a node, whatever the ratio: on a loaded
# host a tiny model's steps of a few ms vary by more than 1.5x from scheduling alone, while at
# scale a step takes seconds and a 1.5x straggler is hundreds of ms behind.
STRAGGLER_MIN_GAP_S = 0.02
BURN_IN_MATMUL = 128  # side of the burn-in's square matrices
BURN_IN_ALLREDUCE_BYTES = 8 << 20


class NodeUnhealthy(Exception):
    """The job must stop for a node to be replaced; the message says which rank and why. Not a
    RuntimeError: the loop must not take it for a peer failure to rejoin from."""

    def __init__(self, reason: str, ranks: list[int]) -> None:
        super().__init__(reason)
        self.reason, self.ranks = reason, ranks


def _gather(t: torch.Tensor) -> torch.Tensor:
    """One all_gather of a small tensor: (world, *t.shape)."""
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out)


def param_checksum(params: list[torch.Tensor]) -> torch.Tensor:
    """An exact hash of the parameters' bytes, on their device, in one pass over them: their
    bytes summed as integers of two widths (the element size, and 16 bits), each sum wrapping at
    its own width. Integer addition that wraps is exact and independent of the order of the
    reduction, so equal bytes give equal sums on every rank; one flipped bit changes both by a
    power of two; several flips cancel out in both only if they cancel at both widths. (Summing
    into int64 instead is 25x slower on a CPU, and a position-weighted sum, which would also
    catch values trading places, needs an int64 copy: a bad device flips bits, it does not
    permute a tensor.)"""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    total = torch.zeros(2, dtype=torch.int64, device=params[0].device if params else "cpu")
    for p in params:
        flat = p.detach().contiguous().view(-1)
        width = ints[p.element_size()]
        total[0] += flat.view(width).sum(dtype=width).to(torch.int64)
        if p.element_size() > 1:
            total[1] += flat.view(torch.int16).sum(dtype=torch.int16).to(torch.int64)
    return total


def flip_bit(params: list[torch.Tensor], bit: int = 22) -> str:
    """Flip one bit of the first parameter's middle element in place (fault injection: what a
    bad device or memory does silently); returns which."""
    p = next(p for p in params if p.numel())
    flat = p.data.view(-1)
    i = flat.numel() // 2
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[p.element_size()]
    flat.view(ints)[i] ^= 1 << bit
    return f"bit {bit} of element {i} of a {tuple(p.shape)} parameter"


def burn_in(*, rank: int, world: int, device: torch.device, min_gbps: float,
            hosts: list[str], corrupt: bool = False) -> dict[str, Any]:
    """The burn-in (module docstring); every rank returns the same report or raises the same
    NodeUnhealthy. corrupt: this rank's matmul result is made wrong (fault injection)."""
    g = torch.Generator().manual_seed(1234)
    # integers in [-8, 8]: each product and every sum of 128 of them is exact in float32
    a = torch.randint(-8, 9, (BURN_IN_MATMUL, BURN_IN_MATMUL), generator=g)
    b = torch.randint(-8, 9, (BURN_IN_MATMUL, BURN_IN_MATMUL), generator=g)
    expected = a @ b  # int64 on the CPU
    t0 = time.perf_counter()
    got = (a.float().to(device) @ b.float().to(device)).cpu()
    if corrupt:
        got[0, 0] += 1.0
    matmul_s = time.perf_counter() - t0
    wrong = int((got.to(torch.int64) != expected).sum())
    problems: list[str] = []
    if wrong:
        problems.append(f"its matmul has {wrong} wrong elements out of {expected.numel()}")
    allreduce_s, gbps = 0.0, 0.0
    if world > 1:
        import torch.distributed as dist

        n = BURN_IN_ALLREDUCE_BYTES // 4
        # each rank adds (rank + 1) x the same small integers: the exact sum is known everywhere
        base = torch.arange(n, dtype=torch.float32, device=device) % 1000
        buf = base * (rank + 1)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        allreduce_s = time.perf_counter() - t0
        if not torch.equal(buf, base * (world * (world + 1) // 2)):
            problems.append("its all-reduce returned a wrong sum")
        # bus bandwidth of a ring all-reduce: each rank moves 2 (n-1)/n of the buffer
        gbps = 8 * BURN_IN_ALLREDUCE_BYTES * 2 * (world - 1) / world / max(allreduce_s, 1e-9) / 1e9
        if min_gbps and gbps < min_gbps:
            problems.append(f"its all-reduce of {BURN_IN_ALLREDUCE_BYTES >> 20} MiB ran at "
                            f"{gbps:.2f} Gb/s, below burn_in_min_gbps {min_gbps}")
        verdicts = _gather_objects({"rank": rank, "problems": problems, "matmul_s": matmul_s})
    else:
        verdicts = [{"rank": 0, "problems": problems, "matmul_s": matmul_s}]
    bad = [v for v in verdicts if v["problems"]]
    report = {"ok": not bad, "allreduce_s": round(allreduce_s, 6), "allreduce_gbps": round(gbps, 3),
              "matmul_s": [round(v["matmul_s"], 6) for v in verdicts],
              "failed": [{"rank": v["rank"], "host": hosts[v["rank"]], "reasons": v["problems"]}
                         for v in bad]}
    if bad:
        raise NodeUnhealthy("burn-in failed: " + "; ".join(
            f"rank {v['rank']} on {hosts[v['rank']]}: {', '.join(v['problems'])}" for v in bad)
            + "; the node must be replaced before it joins", [v["rank"] for v in bad])
    return report


def _gather_objects(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_hosts(world: int) -> list[str]:
    """Every rank's host name (once per process group: a rejoined rank may be on a new node)."""
    return _gather_objects(socket.gethostname()) if world > 1 else [socket.gethostname()]


@dataclass(kw_only=True)
class HealthSettings:
    """TrainConfig's health fields (tasks/configs/train_config.py documents each)."""

    burn_in: bool = True
    burn_in_min_gbps: float = 0.0
    straggler_check_every: int = 0  # 0: off
    straggler_factor: float = 1.5
    straggler_steps: int = 3
    straggler_action: str = "warn"
    sdc_check: bool = True
    sdc_check_every: int = 0  # 0: only before each checkpoint


def health_settings(cfg: Any) -> HealthSettings:
    """The health fields of a TrainConfig."""
    return HealthSettings(**{f: getattr(cfg, f) for f in HealthSettings.__dataclass_fields__})


class JobHealth:
    """The loop's side of the checks. Every rank gathers the same numbers; the decisions that
    carry memory (a straggler's streak of checks, a rank's SDC strikes) are taken by rank 0 and
    shared through the store (`share`, tasks/train/distributed.py), and rank 0 keeps that
    memory in `state_file`: a restarted worker, on any rank, takes the same decisions as one
    that never restarted, so the ranks never disagree on whether to stop."""

    def __init__(self, settings: HealthSettings, *, state_file: Any = None,
                 faults: Any = None) -> None:
        self.s, self.state_file, self.faults = settings, state_file, faults
        self.rank, self.world, self.device = 0, 1, torch.device("cpu")
        self.replicas = False
        self.hosts = [socket.gethostname()]
        self.share: Any = None
        self.emit: Any = lambda kind, **fields: None
        self.log_metrics: Any = lambda metrics, step: None
        self.state: dict[str, Any] = {"streak": {}, "strikes": {}, "stragglers": [], "sdc": []}
        if state_file is not None and state_file.exists():
            from tasks.common.io import read_json

            self.state = read_json(state_file)
        self.last_clean = 0  # the last step at which every replica agreed (0: the initial weights)
        self._own_s, self._own_n = 0.0, 0
        self._burnt_in = False

    def attach(self, *, emit: Any, log_metrics: Any) -> None:
        """The loop's event and metric writers (rank 0 logs to MLflow)."""
        self.emit, self.log_metrics = emit, log_metrics

    def connect(self, *, rank: int, world: int, device: torch.device, share: Any,
                replicas: bool, first_round: bool) -> None:
        """A process group formed (the first or a rejoined one): learn the hosts; burn in in
        the job's first round only, where every rank is new (a rank restarted into a later
        round meets peers that burned in already and would wait for its collectives in vain).
        replicas: the ranks hold whole copies of the weights (DDP, not FSDP)."""
        self.rank, self.world, self.device, self.share = rank, world, device, share
        self.replicas = replicas and world > 1
        self.hosts = gather_hosts(world)
        if self.s.burn_in and first_round and not self._burnt_in:
            corrupt = bool(self.faults and self.faults.corrupt_burn_in())
            try:
                report = burn_in(rank=rank, world=world, device=device,
                                 min_gbps=self.s.burn_in_min_gbps, hosts=self.hosts,
                                 corrupt=corrupt)
            except NodeUnhealthy as exc:
                self.emit("burn_in", ok=False, reason=exc.reason, ranks=exc.ranks)
                raise
            self._burnt_in = True
            self.emit("burn_in", **report)
            log.info("burn-in passed on %d rank(s): matmul exact, all-reduce %.4fs (%.2f Gb/s)",
                     world, report["allreduce_s"], report["allreduce_gbps"])

    def step_time(self, seconds: float) -> None:
        """This rank's own time in a step (its start to its first wait on the others)."""
        self._own_s += seconds
        self._own_n += 1

    def after_step(self, step: int, params: list[torch.Tensor], *, checkpoint: bool) -> int | None:
        """The checks due at `step`. Returns the step to roll back to, at most (the replicas
        disagreed), or None; raises NodeUnhealthy when the job must stop."""
        every = self.s.straggler_check_every
        if self.world > 1 and every and step % every == 0:
            self._check_stragglers(step)
        sdc_every = self.s.sdc_check_every
        if self.replicas and self.s.sdc_check and (checkpoint or (sdc_every and step % sdc_every == 0)):
            return self._check_replicas(step, params)
        return None

    def rolled_back(self, step: int) -> None:
        """The weights were reloaded from step's checkpoint on every rank: replicas agree again."""
        self.last_clean = step

    # -- stragglers ------------------------------------------------------------------------
    def _check_stragglers(self, step: int) -> None:
        mine = torch.tensor([self._own_s / max(self._own_n, 1)], dtype=torch.float64,
                            device=self.device)
        self._own_s, self._own_n = 0.0, 0
        times = [float(x) for x in _gather(mine).view(-1).cpu()]
        if not any(self._slow(r, times) for r in range(len(times))):
            if self.rank == 0:
                self._name_stragglers(step, times)  # ends every streak
            return  # every rank knows: no decision to share, no store round trip
        found = self.share("stragglers", lambda: self._name_stragglers(step, times))
        for f in found:
            log.warning("straggler: rank %d on %s took %.4fs per step against the others' median "
                        "%.4fs (%.2fx) for %d checks in a row (straggler_action %s)", f["rank"],
                        f["host"], f["step_s"], f["median_s"], f["ratio"], f["checks"],
                        self.s.straggler_action)
            # the event's own "rank" is the rank that writes it
            self.emit("straggler", **{"straggler_rank" if k == "rank" else k: v
                                      for k, v in f.items()})
            self.log_metrics({f"health/straggler_rank{f['rank']}": f["ratio"]}, step)
        if found and self.s.straggler_action == "restart":
            raise NodeUnhealthy(
                "straggler: " + "; ".join(f"rank {f['rank']} on {f['host']} at {f['ratio']}x the "
                                           f"median step time" for f in found)
                + " (straggler_action restart): stopping for the node to be replaced",
                [f["rank"] for f in found])

    def _slow(self, r: int, times: list[float]) -> bool:
        others = statistics.median(times[:r] + times[r + 1:])
        return (times[r] >= self.s.straggler_factor * others
                and times[r] - others >= STRAGGLER_MIN_GAP_S)

    def _name_stragglers(self, step: int, times: list[float]) -> list[dict[str, Any]]:
        """Rank 0: the straggler rule over the gathered times, with the streaks it keeps."""
        streak, found = self.state["streak"], []
        before = dict(streak)
        for r, t in enumerate(times):
            others = statistics.median(times[:r] + times[r + 1:])
            streak[str(r)] = streak.get(str(r), 0) + 1 if self._slow(r, times) else 0
            # named when the streak reaches straggler_steps, and again every as many checks
            if streak[str(r)] and streak[str(r)] % self.s.straggler_steps == 0:
                found.append({"step": step, "rank": r, "host": self.hosts[r],
                              "step_s": round(t, 6), "median_s": round(others, 6),
                              "ratio": round(t / others, 3) if others > 0 else 1e9,
                              "checks": streak[str(r)]})
        self.state["stragglers"] += found
        if {k: v for k, v in streak.items() if v} != {k: v for k, v in before.items() if v}:
            self._save_state()
        return found

    # -- silent data corruption --------------------------------------------------------------
    def _check_replicas(self, step: int, params: list[torch.Tensor]) -> int | None:
        sums = [[int(v) for v in row] for row in _gather(param_checksum(params)).cpu()]
        if all(s == sums[0] for s in sums):
            self.last_clean = step
            return None
        found = self.share("sdc", lambda: self._name_corrupt(step, sums))
        log.error("silent data corruption: at step %d the parameters of rank(s) %s (%s) differ "
                  "from the other replicas'; rolling back to the newest checkpoint at or before "
                  "step %d", step, found["ranks"], ", ".join(found["hosts"]), self.last_clean)
        self.emit("sdc_mismatch", **found)
        self.log_metrics({"health/sdc_mismatch": 1.0}, step)
        if found["repeat"]:
            raise NodeUnhealthy(
                f"silent data corruption on rank(s) {found['repeat']} again (step {step}; hosts "
                f"{[self.hosts[r] for r in found['repeat']]}): their replicas diverged twice; "
                "stopping for the node to be replaced", found["repeat"])
        return self.last_clean

    def _name_corrupt(self, step: int, sums: list[list[int]]) -> dict[str, Any]:
        """Rank 0: the ranks outside the majority (every rank when there is none: two replicas
        cannot tell which is wrong) and which of them had been named before."""
        counts: dict[tuple, int] = {}
        for s in sums:
            counts[tuple(s)] = counts.get(tuple(s), 0) + 1
        top = max(counts.values())
        majority = [s for s, c in counts.items() if c == top]
        suspects = [r for r, s in enumerate(sums) if len(majority) > 1 or tuple(s) != majority[0]]
        strikes = self.state["strikes"]
        repeat = [r for r in suspects if strikes.get(str(r), 0) >= 1]
        for r in suspects:
            strikes[str(r)] = strikes.get(str(r), 0) + 1
        found = {"step": step, "ranks": suspects, "hosts": [self.hosts[r] for r in suspects],
                 "repeat": repeat, "rollback_to_at_most": self.last_clean}
        self.state["sdc"].append(found)
        self._save_state()
        return found

    # -- reporting ---------------------------------------------------------------------------
    def _save_state(self) -> None:
        if self.state_file is not None and self.rank == 0:
            from tasks.common.io import write_json

            write_json(self.state_file, self.state)

    def report(self) -> dict[str, Any]:
        """For the job's result (and so the ledger): the stragglers and replica mismatches
        named, with rank, host and numbers."""
        return {"stragglers": self.state["stragglers"], "sdc_mismatches": self.state["sdc"]}
