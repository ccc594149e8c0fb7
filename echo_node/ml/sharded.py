"""The learner over several processes: the policy sharded with FSDP2 (`fully_shard`) under torchrun.

Rules:
- Launch with torchrun (`python -m torch.distributed.run --nproc-per-node N ...`), or anything
  that sets the same WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. `init_from_env`
  joins the group: gloo on the CPU, NCCL on CUDA with one GPU per process (cuda:LOCAL_RANK).
- Every rank builds the same model (same arch and seed, or the same checkpoint) and wraps it in a
  `ShardedLearner`, which shards each decoder layer and then the root: a rank keeps 1/N of the
  parameters, gradients and AdamW state, and a layer's full weights exist only around its own
  forward and backward.
- Rank 0 drives, the other ranks follow. Rank 0 calls `step`, `full_state`, `optimizer_state`,
  `load` and `close`; every other rank calls `follow()`, which runs its part of each command rank
  0 sends, until `close`. The rule behind it: every collective (every FSDP forward and backward,
  the gradient-norm clip, a state-dict gather) must be entered by all ranks, in the same order.
  Each method on rank 0 therefore first broadcasts its command, and then every rank runs the same
  code on the same data. So nothing else may run a collective or a forward of the sharded model
  on rank 0, and rank 0's calls must not overlap: one call at a time, from one thread at a time
  (a trio worker thread is fine; overlapping calls raise). On CUDA each call selects the rank's
  device itself, as the current device is per thread.
- A step equals the single-process `PolicyOptimizer.step` up to float rounding (measured on two
  CPU ranks at lr 1e-4: parameters within 6.8e-7 after three steps, tests/unit/test_sharded.py;
  3.8e-7 after twenty, benchmarks/fsdp.py): every rank gets the whole batch and
  computes its share (`grpo.Share`: each minibatch's rows split into contiguous parts, the loss
  divided by the minibatch's token count over all ranks). FSDP's reduce-scatter then *sums* the
  shares' gradients instead of averaging them: divide factor 1, with sum-only reductions forced,
  since FSDP turns a custom factor into ReduceOp.PREMUL_SUM, which gloo refuses ("Cannot use
  ReduceOp.PREMUL_SUM with Gloo"; torch 2.13). `clip_grad_norm_` over the sharded (DTensor)
  gradients clips by the whole model's norm; AdamW is elementwise, so a shard steps as the whole.
  A rank whose share has no token still runs the forward and backward, on a masked stand-in row.
- Commands travel on their own gloo group with a long timeout: followers wait in a broadcast for
  as long as the learner waits for rollouts. The model's collectives use the default group and
  its timeout. Commands are pickled: the ranks trust each other as one process trusts itself; the
  network's data reaches them only as rank 0's already decoded `TrainGroup`s.
- Failures: rank 0 checks a batch (prompts, token ids) or a state (names, shapes, dtypes) before
  it sends anything, so a malformed one raises there alone. After a command was sent, every rank
  reports its outcome to rank 0 at the end of it; rank 0 raises if any rank failed and the
  followers go on following. That is sound when all ranks fail at the same point, as they do on
  anything that follows from the batch itself. A failure that leaves other ranks inside a
  collective (a rank dying, out of memory) is not recoverable: they block until the default
  group's timeout; end the job and let torchrun tear it down.
- Run on the CPU with gloo only so far; CUDA with NCCL takes the same FSDP2 calls, untested here.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from echo_node.ml.grpo import Correction, PolicyOptimizer, Share, TrainGroup, merge_share_stats
from echo_node.ml.model import canonical_state

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

T = TypeVar("T")

# Followers block on the command group between commands, as long as the learner waits for
# rollouts: its timeout bounds that wait, not a step.
COMMAND_TIMEOUT = datetime.timedelta(days=30)

_GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


@dataclass(frozen=True, slots=True)
class DistInfo:
    """This process's place in the job: rank of world, its device, and the command group."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    commands: dist.ProcessGroup


def init_from_env(*, command_timeout: datetime.timedelta = COMMAND_TIMEOUT) -> DistInfo | None:
    """Join the process group torchrun's environment describes; None when there is none (a
    single process). Every rank must call it (it creates the command group collectively)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    except KeyError as exc:
        raise ValueError(f"WORLD_SIZE is {world} but {exc.args[0]} is unset: launch with torchrun") from None
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    commands = dist.new_group(backend="gloo", timeout=command_timeout)
    return DistInfo(rank=rank, world=world, local_rank=local_rank, device=device, commands=commands)


def _storages(tensors: Iterable[Any]) -> set[tuple[torch.device, int]]:
    """Where the plain (unsharded) tensors among `tensors` keep their data."""
    return {
        (t.device, t.untyped_storage().data_ptr())
        for t in tensors
        if isinstance(t, Tensor) and not isinstance(t, DTensor)
    }


def _unshared(state: T, live: Iterable[Any]) -> T:
    """`state` with each tensor that shares memory with a `live` one copied.

    Why: a state handed out or taken in must not move with later steps, yet the state-dict
    functions share unsharded tensors (AdamW's step counts): `cpu_offload` copies only what is
    not on the CPU already, and a loaded step count becomes the optimizer's own.
    """
    shared = _storages(live)
    return tree_map_only(Tensor, lambda t: t.clone() if _storages([t]) & shared else t, state)


class ShardedLearner:
    """`PolicyOptimizer` over a model sharded across all ranks (module docstring).

    Rank 0 calls `step` as it would `PolicyOptimizer.step`; ranks > 0 call `follow()`. The model
    is sharded in place: afterwards only this object may run it.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        info: DistInfo,
        *,
        lr: float,
        clip_eps: float = 0.2,
        temperature: float = 1.0,
        max_grad_norm: float = 1.0,
        pad_id: int = 0,
        correction: Correction = "tis",
        is_cap: float = 2.0,
        minibatches: int = 1,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """Every rank constructs it, at the same point (sharding may run collectives).

        `model`: an HF causal LM with its decoder layers at `model.model.layers`, the same on
        every rank. `compute_dtype`: the forward's and backward's dtype (FSDP mixed precision:
        parameters gathered in it, gradients reduced in float32, the float32 shards the
        optimizer steps); None computes in the model's own dtype."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            raise ValueError(f"{type(model).__name__} has no decoder layers at model.model.layers")
        self.info = info
        # The unsharded model's canonical names, shapes and dtypes (what `full_state` returns and
        # `load` takes), and its aliases (a tied lm_head), which FSDP's state dicts carry too.
        canonical = canonical_state(model)
        self._layout = {name: (tuple(t.shape), t.dtype) for name, t in canonical.items()}
        by_storage = {t.data_ptr(): name for name, t in canonical.items()}
        self._aliases = {
            name: by_storage[t.data_ptr()] for name, t in model.state_dict().items() if name not in canonical
        }
        self._vocab = int(model.config.vocab_size)
        mesh = init_device_mesh(info.device.type, (info.world,))
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Sum the shares' gradients (each is already divided by the global token count),
                # by plain SUM: a factor alone would reduce by PREMUL_SUM, which gloo lacks.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self.model = model
        # The model's own forward: the lean one reads parameters directly and would not gather
        # the shards.
        self.optimizer = PolicyOptimizer(
            model, lr=lr, clip_eps=clip_eps, temperature=temperature, max_grad_norm=max_grad_norm,
            pad_id=pad_id, correction=correction, is_cap=is_cap, minibatches=minibatches, fast_path=False,
        )
        self._share = Share(info.rank, info.world)
        self._busy = threading.Lock()
        self._closed = False

    @property
    def steps(self) -> int:
        return self.optimizer.steps

    @property
    def closed(self) -> bool:
        return self._closed

    # Rank 0's side: each call sends its command, then runs this rank's part of it.

    def step(self, groups: list[TrainGroup]) -> dict[str, float]:
        """One GRPO update on `groups` over all ranks; `PolicyOptimizer.step`'s stats."""
        with self._driving():
            self._check_batch(groups)
            return merge_share_stats(self._lead(("step", groups), lambda: self._step_part(groups)))

    def full_state(self) -> dict[str, Tensor]:
        """The whole model's weights, gathered on rank 0, on the CPU: `canonical_state` of the
        unsharded model (same names and order, tied aliases dropped), so `tensors_to_bytes` of it
        is the publication of these weights."""
        with self._driving():
            return self._lead(("full_state",), self._gather_state)[0]

    def optimizer_state(self) -> dict[str, Any]:
        """The whole AdamW state, gathered on rank 0, on the CPU, keyed by parameter name
        (`get_optimizer_state_dict`'s full form), for a checkpoint."""
        with self._driving():
            return self._lead(("optimizer_state",), self._gather_optimizer_state)[0]

    def load(self, model_state: dict[str, Tensor], optimizer_state: dict[str, Any] | None = None) -> None:
        """Set every rank's shards from rank 0's `model_state` (as `full_state` returns it; tied
        aliases optional) and, if given, `optimizer_state` (as `optimizer_state` returns it)."""
        with self._driving():
            full = self._complete_state(model_state)
            self._lead(("load", optimizer_state is not None), lambda: self._load_part(full, optimizer_state))

    def close(self) -> None:
        """Release the followers from `follow()`. The process group stays up: each rank calls
        `torch.distributed.destroy_process_group()` when it is done with it."""
        with self._driving():
            self._send(("close",))
            self._closed = True

    # The followers' side.

    def follow(self) -> None:
        """Ranks > 0: run this rank's part of each command of rank 0's until `close`."""
        if self.info.rank == 0:
            raise RuntimeError("rank 0 drives: follow() is for the other ranks")
        while True:
            command = self._receive()
            match command:
                case ("close",):
                    return
                case ("step", groups):
                    self._run(lambda: self._step_part(groups))
                case ("full_state",):
                    self._run(self._gather_state)
                case ("optimizer_state",):
                    self._run(self._gather_optimizer_state)
                case ("load", with_optimizer):
                    self._run(lambda: self._load_part({}, {} if with_optimizer else None))
                case _:
                    raise RuntimeError(f"unknown command from rank 0: {command[0]!r}")

    # Each command's part on one rank: the same collectives on every rank, in the same order. A
    # follower's result goes to rank 0 (pickled), so only a step's is more than empty.

    def _step_part(self, groups: list[TrainGroup]) -> dict[str, float]:
        return self.optimizer.step(groups, share=self._share)

    def _gather_state(self) -> dict[str, Tensor]:
        state = get_model_state_dict(self.model, options=_GATHERED)
        if self.info.rank != 0:
            return {}
        return _unshared({name: cast(Tensor, state[name]) for name in self._layout}, list(self.model.buffers()))

    def _gather_optimizer_state(self) -> dict[str, Any]:
        state = get_optimizer_state_dict(self.model, self.optimizer.opt, options=_GATHERED)
        if self.info.rank != 0:
            return {}
        return _unshared(state, [t for s in self.optimizer.opt.state.values() for t in s.values()])

    def _load_part(self, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> None:
        set_model_state_dict(self.model, model_state, options=_FROM_RANK0)
        if optimizer_state is not None:
            set_optimizer_state_dict(self.model, self.optimizer.opt, optimizer_state, options=_FROM_RANK0)
            given = tree_leaves(optimizer_state)
            for per_param in self.optimizer.opt.state.values():
                per_param.update(_unshared(dict(per_param), given))

    # The protocol.

    @contextlib.contextmanager
    def _driving(self) -> Iterator[None]:
        """Rank 0, open, one call at a time."""
        if self.info.rank != 0:
            raise RuntimeError(f"rank {self.info.rank} follows: only rank 0 drives")
        if self._closed:
            raise RuntimeError("the sharded learner is closed")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("overlapping calls: rank 0's calls must come one at a time (module docstring)")
        try:
            yield
        finally:
            self._busy.release()

    def _send(self, command: tuple[Any, ...]) -> None:
        dist.broadcast_object_list([command], src=0, group=self.info.commands)

    def _receive(self) -> tuple[Any, ...]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.info.commands)
        return tuple(box[0])

    def _lead(self, command: tuple[Any, ...], part: Callable[[], T]) -> list[T]:
        """Rank 0: send `command`, run rank 0's `part` of it; every rank's result, in rank order."""
        self._send(command)
        results = self._run(part)
        assert results is not None  # rank 0 gathers them
        return results

    def _run(self, part: Callable[[], T]) -> list[T] | None:
        """Run this rank's `part` of a command, then gather every rank's outcome on rank 0: there,
        each rank's result in rank order (rank 0's own never pickled), or a failure raised. Every
        rank gets to the gather, failed or not, so none is left waiting in it."""
        result: Any = None
        error: Exception | None = None
        try:
            with self._on_device():
                result = part()
        except Exception as exc:
            error = exc
            if self.info.rank != 0:
                log.exception("rank %d failed its part of a command", self.info.rank)
        message = None if error is None else f"{type(error).__name__}: {error}"
        outcome = (message, None if self.info.rank == 0 else result)
        outcomes: list[Any] | None = [None] * self.info.world if self.info.rank == 0 else None
        dist.gather_object(outcome, outcomes, dst=0, group=self.info.commands)
        if outcomes is None:
            return None
        if error is not None:
            raise error
        failed = [f"rank {r} failed: {m}" for r, (m, _) in enumerate(outcomes) if m is not None]
        if failed:
            raise RuntimeError("; ".join(failed))
        return [result, *(r for _, r in outcomes[1:])]

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(self.info.device) if self.info.device.type == "cuda" else contextlib.nullcontext()

    # Rank 0's checks before anything is sent: what could fail on one rank only.

    def _check_batch(self, groups: list[TrainGroup]) -> None:
        """The embedding's index range and the one-token prompt `sequence_logprobs` needs: a share
        failing them alone would leave the other ranks in a collective."""
        for g in groups:
            if not g.prompt_ids:
                raise ValueError("every prompt needs at least one token (bos)")
            for ids in (g.prompt_ids, *g.completions):
                if ids and not (min(ids) >= 0 and max(ids) < self._vocab):
                    raise ValueError(f"a token id is outside the model's vocabulary [0, {self._vocab})")

    def _complete_state(self, model_state: dict[str, Tensor]) -> dict[str, Tensor]:
        """`model_state` checked against the model's canonical layout, with the aliases added."""
        missing = sorted(self._layout.keys() - model_state.keys())
        extra = sorted(model_state.keys() - self._layout.keys() - self._aliases.keys())
        if missing or extra:
            raise ValueError(f"state does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, (shape, dtype) in self._layout.items():
            t = model_state[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{name}: got {t.dtype} {tuple(t.shape)}, model has {dtype} {shape}")
        return {**model_state, **{alias: model_state[name] for alias, name in self._aliases.items()}}
