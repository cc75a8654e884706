"""Checkpoint directories: safetensors shards per layer plus a small JSON manifest.

::

    ckpt/
      manifest.json                 format, step, job, optimizer layout, RNG protocol,
                                    each layer's LR scheduler state (JSON), and
                                    with fp16 each layer's loss scale
      weights-00000.safetensors     layer 0's state_dict, keys "0.weight", "0.bias"
      optimizer-00000.safetensors   its optimizer's tensors, keys "0.weight.exp_avg", ...
      weights-00001.safetensors     ...

Merging every ``weights-*`` shard with ``safetensors.torch.load_file`` gives exactly the
whole model's ``state_dict()``. Optimizer tensors are keyed ``"<layer>.<param>.<name>"``;
their non-tensor values and each layer's ``param_groups`` (hyper-parameters) sit in the
manifest. Nothing in a checkpoint is code: loading one never unpickles anything.

The directory is written beside its target and renamed into place once complete, so a
crash while saving leaves the previous checkpoint as it was.

``open_for`` opens a checkpoint for ``Pipeline.load``: a directory, or the one msgpack file
of earlier versions (``V1_FORMAT``: still read, no longer written), checked against the job
before anything is sent; ``Pipeline`` streams its layers to the stages.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from elasticpipe.errors import InvalidRequest
from elasticpipe.models import weights
from elasticpipe.models.weights import MANIFEST, TensorSource, read_json
from elasticpipe.training.job import JobConfig
from elasticpipe.training.rng import RNG_PROTOCOL
from elasticpipe.wire import codec

FORMAT = "elasticpipe-checkpoint-v2"
V1_FORMAT = "elasticpipe-checkpoint-v1"  # one msgpack file: read, no longer written


def weights_name(layer: int) -> str:
    """The file of one layer's weights and buffers."""
    return f"weights-{layer:05d}.safetensors"


def optimizer_name(layer: int) -> str:
    """The file of one layer's optimizer tensors."""
    return f"optimizer-{layer:05d}.safetensors"


def job_description(job: JobConfig) -> dict[str, Any]:
    """What a checkpoint records of the job (and ``load`` compares)."""
    return {
        "model": job.model,
        "model_kwargs": job.model_kwargs,
        "seed": job.seed,
        "optimizer": job.optimizer,
        "optimizer_kwargs": job.optimizer_kwargs,
        "loss": job.loss,
        "micro_batches": job.micro_batches,
        "schedule": job.schedule,
    }


class Writer:
    """Writes one checkpoint, a layer at a time, into a temporary sibling directory."""

    def __init__(self, target: Path, job: JobConfig, params: list[list[str]]):
        replaceable = not target.exists() or (target / MANIFEST).is_file()
        if not replaceable and (not target.is_dir() or any(target.iterdir())):
            raise InvalidRequest(
                f"{target} exists and is not a checkpoint directory: refusing to replace it"
            )
        self._target = target
        self._tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
        self._tmp.mkdir(parents=True)
        self._job = job
        self._params = params
        self._weights: list[str] = []
        self._optimizer: list[str] = []
        self._groups: dict[str, Any] = {}
        self._scalars: dict[str, Any] = {}
        self._schedulers: dict[str, Any] = {}
        self._loss_scales: dict[str, Any] = {}

    def add(self, state: Mapping[str, Any]) -> None:
        """Writes one exported layer state (``{"index", "model", "optimizer"?}``)."""
        layer = int(state["index"])
        model = {f"{layer}.{k}": _contiguous(v) for k, v in state["model"].items()}
        save_file(model, str(self._tmp / weights_name(layer)))
        self._weights.append(weights_name(layer))
        if isinstance(state.get("scheduler"), str):  # its LR scheduler's state, JSON text
            self._schedulers[str(layer)] = json.loads(state["scheduler"])
        if isinstance(state.get("loss_scale"), dict):  # fp16: {"scale", "growth_tracker"}
            self._loss_scales[str(layer)] = dict(state["loss_scale"])
        optimizer = state.get("optimizer")
        if optimizer is None:
            return
        names = self._params[layer]
        tensors: dict[str, torch.Tensor] = {}
        for idx, per_param in optimizer["state"].items():
            for key, value in per_param.items():
                full = f"{layer}.{names[int(idx)]}.{key}"
                if isinstance(value, torch.Tensor):
                    tensors[full] = _contiguous(value)
                else:
                    self._scalars[full] = value
        save_file(tensors, str(self._tmp / optimizer_name(layer)))
        self._optimizer.append(optimizer_name(layer))
        self._groups[str(layer)] = [
            {**g, "params": [names[int(i)] for i in g["params"]]} for g in optimizer["param_groups"]
        ]

    def commit(self, step: int) -> None:
        """Writes the manifest and puts the directory in place of ``target``."""
        manifest = {
            "format": FORMAT,
            "step": step,
            "job": job_description(self._job),
            "rng_protocol": RNG_PROTOCOL,
            "weights": self._weights,
            "optimizer": {
                "name": self._job.optimizer,
                "shards": self._optimizer,
                "layout": "<layer>.<parameter>.<state name>",
                "param_groups": self._groups,
                "scalars": self._scalars,
            },
            "schedulers": self._schedulers,  # by layer: each scheduler's state_dict()
            "loss_scales": self._loss_scales,  # by layer (fp16): GradScaler's scale, tracker
        }
        (self._tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if self._target.exists():
            old = self._target.with_name(f".{self._target.name}.{uuid.uuid4().hex[:8]}.old")
            self._target.rename(old)
            self._tmp.rename(self._target)
            shutil.rmtree(old)
        else:
            self._tmp.rename(self._target)

    def abandon(self) -> None:
        """Removes the partial directory."""
        shutil.rmtree(self._tmp, ignore_errors=True)


class Reader:
    """Reads a checkpoint directory back, a layer at a time."""

    def __init__(self, directory: Path):
        manifest = read_json(directory / MANIFEST)
        if manifest.get("format") != FORMAT:
            raise InvalidRequest(
                f"{directory} is not an ElasticPipe checkpoint (format "
                f"{manifest.get('format')!r}, expected {FORMAT!r})"
            )
        self.directory = directory
        self.manifest = manifest
        self.step = int(manifest["step"])
        self.job: dict[str, Any] = manifest["job"]
        optimizer = manifest["optimizer"]
        self._groups: dict[str, Any] = optimizer["param_groups"]
        self._scalars: dict[str, Any] = optimizer["scalars"]
        self._schedulers: dict[str, Any] = manifest.get("schedulers") or {}
        self._loss_scales: dict[str, Any] = manifest.get("loss_scales") or {}
        if len({json.dumps(v, sort_keys=True) for v in self._loss_scales.values()}) > 1:
            raise InvalidRequest(
                f"{directory}: the layers' loss scales differ ({self._loss_scales}); every "
                "layer of an fp16 job holds the same one"
            )
        self.weights = TensorSource(files=[directory / n for n in manifest["weights"]])
        self.optimizer = TensorSource(files=[directory / n for n in optimizer["shards"]])

    def layer_state(
        self, layer: int, model: Mapping[str, torch.Tensor], names: list[str]
    ) -> dict[str, Any]:
        """The exported form of one layer (what a stage's ``load_layer`` takes).

        Args:
            layer: the layer index.
            model: its weights, already read and checked.
            names: its trainable parameters in optimizer order.
        """
        state: dict[str, Any] = {"index": layer, "model": dict(model)}
        if self._loss_scales and str(layer) not in self._loss_scales:
            raise InvalidRequest(
                f"{self.directory}: no loss scale for layer {layer} (the checkpoint has "
                f"them for layers {sorted(self._loss_scales, key=int)[:10]}); an fp16 "
                "checkpoint holds one for every layer"
            )
        if str(layer) in self._loss_scales:  # checked by the stage that loads it
            state["loss_scale"] = self._loss_scales[str(layer)]
        groups = self._groups.get(str(layer))
        if groups is None:
            return state
        index = {name: i for i, name in enumerate(names)}
        per_param: dict[int, dict[str, Any]] = {}
        prefix = f"{layer}."
        tensor_keys = [k for k in self.optimizer.keys() if k.startswith(prefix)]  # noqa: SIM118 (no dict)
        for full in [*tensor_keys, *(k for k in self._scalars if k.startswith(prefix))]:
            param, _, key = full[len(prefix) :].rpartition(".")
            if param not in index:
                raise InvalidRequest(
                    f"optimizer state {full!r} names no parameter of layer {layer} ({names})"
                )
            value = self.optimizer.get(full) if full in tensor_keys else self._scalars[full]
            per_param.setdefault(index[param], {})[key] = value
        param_groups = [{**g, "params": [index[n] for n in g["params"]]} for g in groups]
        state["optimizer"] = {"state": per_param, "param_groups": param_groups}
        if str(layer) in self._schedulers:
            state["scheduler"] = json.dumps(self._schedulers[str(layer)])
        return state

    def close(self) -> None:
        """Closes the shards."""
        self.weights.close()
        self.optimizer.close()


@dataclass(frozen=True)
class Opened:
    """A checkpoint opened for ``load``: its step and each layer's state (what a stage's
    ``load_layer`` takes), read one layer at a time."""

    path: str | os.PathLike[str]
    step: int
    layer_state: Callable[[int], Any]
    close: Callable[[], None]
    layers: list[int] | None = None  # a V1 file's layers, checked once the model is known

    def check_layers(self, num_layers: int) -> None:
        """Fails unless the checkpoint holds layers 0 to ``num_layers - 1`` (V1 files; the
        shards of a directory were checked against the model when it was opened)."""
        if self.layers is not None and self.layers != list(range(num_layers)):
            raise InvalidRequest(
                f"checkpoint {self.path} has layers {self.layers}, the model {num_layers}"
            )


def check_job(path: str | os.PathLike[str], recorded: Mapping[str, Any], job: JobConfig) -> None:
    """Fails unless the job a checkpoint records has ``job``'s model and optimizer.

    Raises:
        InvalidRequest: naming both.
    """
    mine = {"model": job.model, "model_kwargs": job.model_kwargs, "optimizer": job.optimizer}
    theirs = {k: recorded.get(k) for k in mine}
    if json.dumps(theirs, sort_keys=True) != json.dumps(mine, sort_keys=True):
        raise InvalidRequest(f"checkpoint {path} is of {theirs}, this pipeline trains {mine}")


def open_for(path: str | os.PathLike[str], job: JobConfig) -> Opened:
    """Opens a checkpoint of ``save`` (or an earlier version's file) to load into ``job``.

    Raises:
        InvalidRequest: not a checkpoint, one of another model or optimizer, or shards that
            do not fit the model.
    """
    if Path(path).is_file():
        return _open_v1(path, job)
    reader = Reader(Path(path))
    try:
        check_job(path, reader.job, job)
        expected, params = weights.expected_state(job.model, job.model_kwargs)
        plan = weights.plan(reader.weights, expected, weights.no_rename)
    except BaseException:
        reader.close()
        raise
    return Opened(
        path,
        reader.step,
        lambda layer: reader.layer_state(layer, plan.layer_state(layer), params[layer]),
        reader.close,
    )


def _open_v1(path: str | os.PathLike[str], job: JobConfig) -> Opened:
    """Opens a one-file msgpack checkpoint of an earlier version (read only)."""
    raw = Path(path).read_bytes()
    checkpoint = codec.unpack_state(raw, max(len(raw), 1))
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != V1_FORMAT:
        raise InvalidRequest(f"{path} is not an ElasticPipe checkpoint")
    check_job(path, checkpoint["job"], job)
    layers: dict[int, bytes] = checkpoint["layers"]
    max_bytes = max(len(raw), 1)
    return Opened(
        path,
        int(checkpoint["step"]),
        lambda layer: codec.unpack_state(layers[layer], max_bytes, max_bytes),
        lambda: None,
        sorted(layers),
    )


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous()
