"""Model files: how a program to plan is handed to the CLI.

A model file is a Python file that defines a function returning a ``Model``:

    # models/mlp.py
    def mlp(size: str = "small") -> shardsolve.Model:
        ...
        return shardsolve.Model(fun=step, args=(params, batch),
                                in_shardings=(None, P("data")))

``shardsolve plan models/mlp.py:mlp --size small`` calls ``mlp("small")``;
``NAME`` defaults to the file's stem. Sizes are ``"small"`` (runs numerically
on 8 fake CPU devices) and ``"large"`` (realistic; arguments are
``jax.ShapeDtypeStruct``s, for planning and compiling only). A file may also
define ``model`` directly as a ``Model`` instance.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shardsolve.errors import ShardsolveError

SIZES = ("small", "large")


@dataclass(frozen=True)
class Model:
    """A function, example arguments and the user's sharding annotations.

    ``in_shardings``/``out_shardings`` are pytree prefixes of the arguments /
    outputs whose leaves are ``PartitionSpec`` (pinned) or ``None`` (free).
    ``carry`` pairs (argument index, output index) whose shardings must agree,
    e.g. ``((0, 0),)`` for ``step(params, batch) -> (new_params, loss)``.
    ``expert_in_shardings`` optionally holds a hand-written (e.g. Megatron-style)
    annotation of every argument, used by benchmarks as a reference plan.
    """

    fun: Callable
    args: tuple
    in_shardings: Any = None
    out_shardings: Any = None
    name: str = ""
    description: str = ""
    expert_in_shardings: Any = None
    expert_out_shardings: Any = None
    mesh_axes: tuple[str, ...] = field(default=())  # axis names the annotations use
    carry: tuple[tuple[int, int], ...] = ()  # (argument, output) pairs: state carried round a loop


def load_model(spec: str, size: str = "small") -> Model:
    """Load ``FILE[:NAME]`` and return its ``Model`` at ``size``."""
    if size not in SIZES:
        raise ShardsolveError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    path_text, _, name = spec.partition(":")
    if ":" not in spec and len(spec) > 1 and spec[1] == ":":  # Windows drive letter
        path_text, name = spec, ""
    path = Path(path_text)
    if not path.is_file():
        raise ShardsolveError(f"model file {path_text!r} does not exist; pass FILE[:NAME], e.g. models/mlp.py:mlp")
    module_name = f"_shardsolve_model_{path.stem}_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ShardsolveError(f"cannot import model file {path_text!r}; it must be a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except ShardsolveError:
        raise
    except Exception as e:  # a user's file may fail in any way
        raise ShardsolveError(f"importing {path_text} failed: {type(e).__name__}: {e}") from e
    names = [name] if name else [path.stem, "model"]
    for candidate in names:
        obj = getattr(module, candidate, None)
        if obj is None:
            continue
        if isinstance(obj, Model):
            return obj
        if callable(obj):
            try:
                result = obj(size)
            except ShardsolveError:
                raise
            except Exception as e:
                raise ShardsolveError(f"{path_text}:{candidate}({size!r}) failed: {type(e).__name__}: {e}") from e
            if isinstance(result, Model):
                if not result.name:
                    object.__setattr__(result, "name", candidate)
                return result
            raise ShardsolveError(
                f"{path_text}:{candidate}({size!r}) returned {type(result).__name__}, not a shardsolve.Model; "
                "return shardsolve.Model(fun=step, args=(...), in_shardings=(...)) (args may be "
                "jax.ShapeDtypeStruct), or plan it from Python with shardsolve.plan(step, *args, mesh=...)"
            )
    available = sorted(
        k for k, v in vars(module).items() if not k.startswith("_") and (isinstance(v, Model) or _returns_model(v))
    )
    hint = f"; it defines {', '.join(available)}" if available else "; define a function returning shardsolve.Model"
    raise ShardsolveError(f"{path_text} has no model named {' or '.join(repr(n) for n in names)}{hint}")


def _returns_model(obj: Any) -> bool:
    ann = getattr(obj, "__annotations__", {}).get("return") if callable(obj) else None
    return ann in ("Model", "shardsolve.Model", Model)
