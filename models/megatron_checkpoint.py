"""Reading Megatron-LM checkpoints of GPT models, one full tensor at a time, without process groups.

A Megatron-LM `--save` directory holds `latest_checkpointed_iteration.txt` and `iter_XXXXXXX/`
(or `release/`); an iteration directory is in one of two formats:

  torch_dist  Megatron-Core's dist_checkpointing (the default): `.metadata`, `__N_M.distcp`,
              `common.pt` (args, iteration), `metadata.json`. Tensors are stored under global
              names as full (unsharded) tensors, a layer's tensors either stacked over the layers
              (`decoder.layers.X` [num_layers, ...]) or one per layer (`decoder.layers.N.X`; SwiGLU's
              fc1 then as `..._w` / `..._v`). Read with torch.distributed.checkpoint into
              preallocated tensors, one layer (one box of a stored tensor) at a time.
  legacy      `mp_rank_XX/model_optim_rng.pt` (PP = 1) or `mp_rank_XX_YYY/` (TP rank XX, PP rank
              YYY): each rank's state dict (`model`, or `model0`, `model1`, ... with virtual
              pipeline stages), layer numbers local to the chunk. The TP pieces of a tensor are
              merged (megatron_conversion.merge_tp) and the layers renumbered globally by the
              chunks' order (chunk v of stage p is the (v * pp + p)-th), which covers uneven splits.

Both give `get(name)`: the full tensor of a Megatron-Core name (megatron_conversion's canonical
names, with the layer number global), the vocabulary trimmed to `vocab` rows. Every .pt file is
read with torch.load(weights_only=True) and an allow-list (ALLOWED: what Megatron-Core itself
declares safe in its checkpoints); a file naming any other class is refused, naming it.
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import pickle
import re
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, TensorStorageMetadata
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio, create_read_items_for_chunk_list

from megatron_lite.parallel.pipeline.placement import StagePlacement

from .hf_conversion import ConversionError
from .megatron_conversion import ALIASES, IGNORED, VOCAB_TENSORS, layout_of_args, merge_tp

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


# --- unpickling with an allow-list ------------------------------------------------------------
# What Megatron-Core declares safe in its own checkpoints (megatron/core/safe_globals.py, registered
# when megatron.core is imported): the args Namespace and the values its fields take (paths, a
# signal, Megatron-Core's enums), NumPy's RNG state arrays, Transformer Engine's extra state
# (BytesIO), the optimizer config. Python's and NumPy's classes are allowed as themselves;
# Megatron-Core's as stand-ins that only record what they are given (nothing of megatron-core runs,
# nor need it be installed).
_PLAIN = {"argparse.Namespace": "argparse.Namespace", "types.SimpleNamespace": "types.SimpleNamespace",
          "pathlib.PosixPath": "pathlib.PosixPath", "signal.Signals": "signal.Signals", "_io.BytesIO": "io.BytesIO",
          "numpy.core.multiarray._reconstruct": "numpy.core.multiarray._reconstruct",
          "numpy._core.multiarray._reconstruct": "numpy._core.multiarray._reconstruct", "numpy.ndarray": "numpy.ndarray",
          "numpy.dtype": "numpy.dtype", "numpy.dtypes.UInt32DType": "numpy.dtypes.UInt32DType"}
_MEGATRON_ENUMS = ("megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphScope",
                   "megatron.core.transformer.enums.CudaGraphModule",  # (0.19)
                   "megatron.core.transformer.enums.InferenceCudaGraphScope", "megatron.core.enums.ModelType", "megatron.core.rerun_state_machine.RerunDiagnostic",
                   "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState")
# (0.19 also lists torch._C.Generator: an RNG's state, read here as a stand-in like Megatron-Core's objects)
_MEGATRON_OBJECTS = ("megatron.core.optimizer.optimizer_config.OptimizerConfig", "torch._C.Generator")
ALLOWED = set(_PLAIN) | set(_MEGATRON_ENUMS) | set(_MEGATRON_OBJECTS)
# A NumPy array's dtype is rebuilt with the class of the dtype, which the pickle does not name.
_IMPLIED = {"numpy.dtype": ("numpy.dtypes.UInt32DType",)}


def _stand_in(qualname: str):
    """(class, its pickled name) for a Megatron-Core class: an enum member is unpickled by calling
    the class with its value, an object by creating it and setting its fields; both are recorded."""
    class MegatronValue:
        def __init__(self, value=None):
            self.value = value

        def __setstate__(self, state):
            self.state = state

        def __repr__(self):
            return f"{qualname}({getattr(self, 'value', None)!r})"
    MegatronValue.__qualname__ = qualname
    return (MegatronValue, qualname)


def _allowed_object(name: str):
    import importlib

    if name not in _PLAIN:
        return _stand_in(name)
    module, attr = _PLAIN[name].rsplit(".", 1)
    return (getattr(importlib.import_module(module), attr), name)


def safe_load(path, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) allowing only the classes in ALLOWED that the file names. What
    this process may have registered as safe elsewhere (importing megatron.core registers its list)
    is set aside meanwhile: the allow-list here is the whole of it."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        return _load_allowed(path, mmap)
    finally:
        torch.serialization.add_safe_globals(registered)


def _load_allowed(path, mmap: bool) -> Any:
    """(`path`: a file's path, or (what it is called, a file-like object))"""
    path, f = path if isinstance(path, tuple) else (path, path)
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception as e:  # not a zip-format torch.save file
        raise ConversionError(f"{path} is not a readable torch.save file: {e}") from e
    refused = [g for g in needed if g not in ALLOWED]
    if refused:
        raise ConversionError(f"{path}: refused to unpickle {', '.join(sorted(refused))}: not on the allow-list "
                              f"(torch.load weights_only=True; besides tensors only what Megatron-Core declares "
                              f"safe in its checkpoints: args, paths, signals, its enums and optimizer config, "
                              f"NumPy RNG states, BytesIO)")
    needed = list(needed) + [g for n in needed for g in _IMPLIED.get(n, ())]
    try:
        with torch.serialization.safe_globals([_allowed_object(g) for g in needed]):
            if not isinstance(f, str):
                f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = next((lines[i + 1] for i, line in enumerate(lines[:-1]) if "WeightsUnpickler error" in line),
                      lines[0] if lines else type(e).__name__)
        raise ConversionError(f"{path}: not loadable with torch.load(weights_only=True): {detail}") from e


# --- directories --------------------------------------------------------------------------------
def iteration_dir(path: str, iteration: Optional[int] = None) -> str:
    """The iteration directory of a --save directory (its latest, or `iteration`), or `path` itself
    when it is one."""
    if not os.path.isdir(path):
        raise ConversionError(f"Megatron checkpoint {path!r} is not a directory")
    if iteration is not None:
        out = os.path.join(path, f"iter_{iteration:07d}")
        if not os.path.isdir(out):
            raise ConversionError(f"{path} has no iteration {iteration} ({out} is missing)")
        return out
    tracker = os.path.join(path, TRACKER)
    if os.path.exists(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        name = "release" if text == "release" else (f"iter_{int(text):07d}" if text.isdigit() else None)
        if name is None:
            raise ConversionError(f"{tracker} holds {text!r}, neither an iteration nor 'release'")
        out = os.path.join(path, name)
        if not os.path.isdir(out):
            raise ConversionError(f"{tracker} names {name}, which is missing")
        return out
    return path


def open_megatron_checkpoint(path: str, iteration: Optional[int] = None):
    """The reader of the checkpoint at `path` (a --save directory or an iteration directory)."""
    d = iteration_dir(path, iteration)
    entries = os.listdir(d)
    if ".metadata" in entries:
        return TorchDistCheckpoint(d)
    if any(_RANK_DIR.match(e) for e in entries):
        return LegacyCheckpoint(d)
    raise ConversionError(f"{d} holds neither a Megatron-LM checkpoint tracker ({TRACKER}), a torch_dist checkpoint "
                          f"(.metadata, *.distcp, common.pt) nor legacy mp_rank_*/{LEGACY_FILE} files")


def _canonical(name: str) -> str:
    for canonical, local in ALIASES.items():
        name = name.replace(local, canonical)
    return name


def _ignored(name: str) -> bool:
    return any(s in name for s in IGNORED)


def _check_version(version, where: str) -> None:
    if version is not None and float(version) < 3.0:
        raise ConversionError(f"{where}: checkpoint_version {version} (a QKV layout older than 3.0) is not supported")


class _Reader:
    """What both formats share: the args, an index of the canonical names (-> where the tensor
    lies), the vocabulary trim."""
    format = ""

    def __init__(self, directory: str, common: dict):
        self.dir, self.vocab, self.swiglu = directory, None, False
        _check_version(common.get("checkpoint_version"), directory)
        args = common.get("args")
        self.args: Dict[str, Any] = dict(vars(args)) if isinstance(args, argparse.Namespace) else {}
        self.iteration = common.get("iteration")
        self.index: Dict[str, tuple] = {}

    def configure(self, vocab: int, swiglu: bool) -> None:
        """Before reading: the true vocabulary (rows kept of the vocabulary tensors), and whether the
        MLP is SwiGLU (its fc1 pieces are [gate; up] per TP rank)."""
        self.vocab, self.swiglu = vocab, swiglu

    def names(self) -> List[str]:
        return sorted(self.index)

    def has(self, name: str) -> bool:
        return name in self.index

    def get(self, name: str) -> torch.Tensor:
        if name not in self.index:
            raise ConversionError(f"Megatron checkpoint {self.dir} has no {name!r}")
        rows = self.vocab if name in VOCAB_TENSORS else None
        t = self._read(name, self.index[name], rows)
        return t if rows is None else t[:rows]

    def rows(self, name: str) -> Optional[int]:
        return self._shape(name)[0] if name in self.index else None

    def dtype(self) -> torch.dtype:
        for name in self.names():
            dt = self._dtype(name)
            if dt.is_floating_point:
                return dt
        return torch.float32


# --- torch_dist -----------------------------------------------------------------------------------
class TorchDistCheckpoint(_Reader):
    format = "torch_dist"

    def __init__(self, directory: str, prefix: str = ""):
        """`prefix`: read the tensors stored under it, named without it (an optimizer state:
        `optimizer.state.exp_avg.`, Megatron-Core's model names after it); else the model's."""
        meta_json = os.path.join(directory, "metadata.json")
        if os.path.exists(meta_json):
            with open(meta_json) as f:
                backend = json.load(f).get("sharded_backend")
            if backend != "torch_dist":
                raise ConversionError(f"{directory}: sharded_backend {backend!r} is not supported; supported: torch_dist")
        common_path = os.path.join(directory, "common.pt")
        metadata = read_dcp_metadata(os.path.join(directory, ".metadata"))
        reader = _Storage(directory, metadata)
        if os.path.exists(common_path):
            common = safe_load(common_path)
        else:  # Megatron-Core 0.19: the args, iteration and version are an object inside the .distcp files
            key = next((k for k in metadata.state_dict_metadata if k.startswith("common_state/")), None)
            common = safe_load((f"{directory}:{key}", io.BytesIO(_read_bytes(reader, key)))) if key else {}
            common = common[0] if isinstance(common, list) and common else common  # (a list: one object per rank)
        super().__init__(directory, common)
        self.common = common  # (a training checkpoint's optimizer scalars and LR schedule too)
        self.metadata, self.reader = metadata, reader
        self.stored = {k: m for k, m in self.metadata.state_dict_metadata.items()
                       if isinstance(m, TensorStorageMetadata) and not _ignored(k)
                       and (k.startswith(prefix) if prefix else not k.startswith("optimizer."))}
        for key, m in self.stored.items():
            if self._halves(key[:-2]) and key.endswith("_v"):
                continue  # indexed with its _w half
            base = key[:-2] if self._halves(key[:-2]) else key
            self._index_key(key, base[len(prefix):], m)

    def _index_key(self, key: str, base: str, m) -> None:
        """A layer's tensors are stacked over the layers (`decoder.layers.X` [num_layers, ...]) or one
        per layer (`decoder.layers.N.X`: Megatron-Core's choice when dense and MoE layers mix); an
        MoE layer's expert tensors are stacked over the experts after that (`mlp.experts.experts.X`)."""
        parts = base.split(".")
        if not base.startswith("decoder.layers."):
            self.index[_canonical(base)] = (key, None)
            return
        stacked = not parts[2].isdigit()
        rest = ".".join(parts[2:] if stacked else parts[3:])
        experts = rest.startswith("mlp.experts.experts.")
        if experts:
            rest = f"mlp.experts.local_experts.{{e}}.{rest[len('mlp.experts.experts.'):]}"
        if not stacked and not experts:
            self.index[_canonical(base)] = (key, None)
            return
        for where in _stored_boxes(m, stacked + experts):
            layer = where[0] if stacked else parts[2]
            name = f"decoder.layers.{layer}.{rest.format(e=where[-1]) if experts else rest}"
            self.index[_canonical(name)] = (key, where)

    def _halves(self, base: str) -> bool:
        """Whether SwiGLU's fc1 `base` is stored as two tensors, base_w (gate) and base_v (up)."""
        return base + "_w" in self.stored and base + "_v" in self.stored

    def _shape(self, name: str) -> Tuple[int, ...]:
        key, where = self.index[name]
        size = tuple(self.stored[key].size)
        size = size[len(where):] if where is not None else size
        if key.endswith("_w") and self._halves(key[:-2]):
            size = (2 * size[0],) + size[1:]
        return size

    def _dtype(self, name: str) -> torch.dtype:
        return self.stored[self.index[name][0]].properties.dtype

    def _box(self, key: str, where: Optional[Tuple[int, ...]], rows: Optional[int]) -> torch.Tensor:
        """One layer (or one layer's expert) of a stored tensor, or all of it; its first `rows` rows
        only if given."""
        m = self.stored[key]
        where = where or ()
        size, offsets = list(m.size), [0] * len(m.size)
        for d, i in enumerate(where):
            size[d], offsets[d] = 1, i
        first = len(where)
        if rows is not None and first < len(size):
            size[first] = min(size[first], rows)
        out = torch.empty(size, dtype=m.properties.dtype)
        with warnings.catch_warnings():  # "torch.distributed is disabled ...: load in a single process" (we do)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({key: out}, storage_reader=self.reader, planner=_BoxPlanner(key, offsets, size), no_dist=True)
        return out.reshape(size[first:])

    def _read(self, name: str, where: tuple, rows: Optional[int]) -> torch.Tensor:
        key, layer = where
        if key.endswith("_w") and self._halves(key[:-2]):
            return torch.cat([self._box(key, layer, None), self._box(key[:-2] + "_v", layer, None)])
        return self._box(key, layer, rows)


def _stored_boxes(m, dims: int) -> List[Tuple[int, ...]]:
    """The indices over the first `dims` dimensions that a stored tensor's chunks cover (Megatron-Core
    stores a key of some layers only, e.g. the experts of the MoE layers, under the model's layer count)."""
    out = set()
    for c in m.chunks:
        out.update(itertools.product(*(range(o, o + n) for o, n in zip(c.offsets[:dims], c.sizes[:dims]))))
    return sorted(out)


# torch.distributed.checkpoint's own reader unpickles `.metadata` with pickle.load, any class at all;
# here only the classes of its metadata may appear (DCP's dataclasses, torch.Size and dtypes).
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "TensorWriteData", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not dtype and name not in _DCP_CLASSES.get(module, ()):
            raise ConversionError(f"refused to unpickle {module}.{name}: not a class of "
                                  f"torch.distributed.checkpoint's metadata")
        return super().find_class(module, name)


def read_dcp_metadata(path: str):
    """The Metadata of a torch.distributed.checkpoint directory, unpickled with DCP's classes only."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except ConversionError as e:
        raise ConversionError(f"{path}: {e}") from e
    except Exception as e:
        raise ConversionError(f"{path} is not a readable torch.distributed.checkpoint metadata file: {e}") from e
    if not hasattr(metadata, "state_dict_metadata"):
        raise ConversionError(f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint's Metadata")
    return metadata


class _Storage(FileSystemReader):
    """DCP's file reader with the metadata read once, safely (read_metadata is what DCP's load asks)."""

    def __init__(self, directory: str, metadata):
        super().__init__(directory)
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs):
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def _read_bytes(reader, key: str) -> bytes:
    """The bytes of one object (a BytesStorageMetadata entry) of a DCP checkpoint, unpickled by no one."""
    class Planner(DefaultLoadPlanner):
        data = b""

        def create_local_plan(self) -> LoadPlan:
            index = MetadataIndex(key)
            return LoadPlan([_create_read_item_for_byteio(index, 0, index, 0, 0)])

        def load_bytes(self, read_item, value) -> None:
            Planner.data = value.read()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({}, storage_reader=reader, planner=Planner(), no_dist=True)
    return Planner.data


class _BoxPlanner(DefaultLoadPlanner):
    """Loads one box (offsets, sizes) of one stored tensor into a tensor shaped like the box."""

    def __init__(self, key: str, offsets: List[int], sizes: List[int]):
        super().__init__()
        self.key, self.offsets, self.sizes = key, offsets, sizes

    def create_local_plan(self) -> LoadPlan:
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))
        return LoadPlan(create_read_items_for_chunk_list(self.key, self.metadata.state_dict_metadata[self.key],
                                                         [chunk]))

    def lookup_tensor(self, index) -> torch.Tensor:  # the box itself (its offsets are the read items')
        return self.state_dict[index.fqn]


# --- legacy (per-rank torch.save files) -------------------------------------------------------------
class LegacyCheckpoint(_Reader):
    format = "legacy"

    def __init__(self, directory: str):
        found = {entry: m.groups() for entry in os.listdir(directory) if (m := _RANK_DIR.match(entry))}
        firsts = [e for e, g in found.items() if not any(int(x or 0) for x in g)]  # mp_rank_00[_000][_000]
        first = os.path.join(directory, firsts[0], LEGACY_FILE) if firsts else ""
        if not os.path.exists(first):
            raise ConversionError(f"{directory} lacks the first rank's file mp_rank_00*/{LEGACY_FILE}")
        state0 = safe_load(first, mmap=True)
        super().__init__(directory, state0)
        layout = layout_of_args(self.args) if self.args else {
            "tp": 1 + max(int(g[0]) for g in found.values()), "pp": 1 + max(int(g[1] or 0) for g in found.values()),
            "ep": 1}
        self.tp, self.pp, self.ep = layout["tp"], layout["pp"], layout["ep"]
        states, expected = {}, set()
        for t, p, e in itertools.product(range(self.tp), range(self.pp), range(self.ep)):
            name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "") + (f"_{e:03d}" if self.ep > 1 else "")
            expected.add(name)
            path = os.path.join(directory, name, LEGACY_FILE)
            if not os.path.exists(path):
                raise ConversionError(f"missing TP shard {path} (the checkpoint is tensor_model_parallel_size="
                                      f"{self.tp}, pipeline_model_parallel_size={self.pp}, "
                                      f"expert_model_parallel_size={self.ep})")
            states[(t, p, e)] = state0 if path == first else safe_load(path, mmap=True)
        extra = sorted(set(found) - expected)
        if extra:
            raise ConversionError(f"{directory} has rank files beyond tensor_model_parallel_size={self.tp} x "
                                  f"pipeline_model_parallel_size={self.pp} x expert_model_parallel_size={self.ep}, "
                                  f"e.g. {extra[0]}")
        self.chunks = {key: self._chunks(state, key) for key, state in states.items()}
        self._index_layers()

    @staticmethod
    def _chunks(state: dict, key) -> List[dict]:
        if "model" in state:
            return [state["model"]]
        chunks = [state[f"model{v}"] for v in range(len(state)) if f"model{v}" in state]
        if not chunks:
            raise ConversionError(f"rank file of TP rank {key[0]}, PP rank {key[1]} holds no 'model' state dict")
        return chunks

    def _index_layers(self) -> None:
        """Global layer numbers: the chunks' runs of consecutive layers in (loop-placed) stage order;
        global expert numbers: EP rank e's local expert j is expert e * local experts + j."""
        placement = StagePlacement(self.pp, len(self.chunks[(0, 0, 0)]))
        offset = 0
        for p, v in map(placement.location, range(placement.num_stages)):
            local = sorted({int(m.group(1)) for k in self.chunks[(0, p, 0)][v] if (m := _LAYER.match(k))})
            for e in range(self.ep):
                sd = self.chunks[(0, p, e)][v]
                per_rank = len({m.group(1) for k in sd if (m := _LOCAL_EXPERT.search(k))})
                for key, value in sd.items():
                    if _ignored(key) or not isinstance(value, torch.Tensor):
                        continue
                    x = _LOCAL_EXPERT.search(key)
                    if e and not x:
                        continue  # the same on every EP rank: read from the first
                    name = key if x is None else key.replace(x.group(0), f".local_experts.{e * per_rank + int(x.group(1))}.")
                    if m := _LAYER.match(name):
                        name = f"decoder.layers.{offset + local.index(int(m.group(1)))}.{m.group(2)}"
                    self.index[_canonical(name)] = (p, v, key, e)
            offset += len(local)

    def _pieces(self, where: tuple) -> List[torch.Tensor]:
        p, v, key, e = where
        out = []
        for t in range(self.tp):
            sd = self.chunks[(t, p, e)][v]
            if key not in sd:
                raise ConversionError(f"{self.dir}: TP rank {t}, PP rank {p} lacks {key!r}, which TP rank 0 has")
            out.append(sd[key])
        return out

    def _shape(self, name: str) -> Tuple[int, ...]:  # (only dim 0 is asked for: the vocabulary rows)
        pieces = self._pieces(self.index[name])
        rows = sum(p.shape[0] for p in pieces) if len(pieces) > 1 and name in VOCAB_TENSORS else pieces[0].shape[0]
        return (rows,) + tuple(pieces[0].shape[1:])

    def _dtype(self, name: str) -> torch.dtype:
        p, v, key, e = self.index[name]
        return self.chunks[(0, p, e)][v][key].dtype

    def _read(self, name: str, where: tuple, rows: Optional[int]) -> torch.Tensor:
        return merge_tp(where[2], self._pieces(where), self.swiglu)
