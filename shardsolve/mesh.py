"""Device meshes as the planner sees them: named axes, sizes and link speeds.

A plan is made against axis names and sizes, never against devices, so
planning works offline. Each axis also carries the bandwidth and latency of the
links that connect devices along it; the cost model prices collectives with them.

    >>> mesh = MeshSpec.parse("data=2,model=4")
    >>> mesh.shape
    {'data': 2, 'model': 4}
    >>> mesh.size
    8

Defaults describe a TPU-v5e-like chip: one 4.5e10 bytes/s inter-chip link per
axis with 1 microsecond of start-up per collective and 1.97e14 FLOP/s of matrix
throughput, the figures of the yardstick plans are judged with. Override per
axis with ``MeshSpec.parse("data=2,model=4", bandwidth={"data": 1e10})`` or
build the ``MeshAxis`` tuple directly.

HBM bandwidth is unbounded by default, so compute is priced as the yardstick
prices it: FLOPs at peak. A finite ``hbm_bandwidth`` (``V5E_HBM_BANDWIDTH``,
8.19e11 bytes/s, for a v5e) makes compute a roofline over the bytes XLA's loop
fusion leaves in memory (``shardsolve.cost``): memory-bound work then costs
its bytes, and the planner shards it where that pays for its collectives.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from shardsolve.errors import ShardsolveError

DEFAULT_BANDWIDTH = 4.5e10  # bytes/s per link along one mesh axis
DEFAULT_LATENCY = 1e-6  # seconds of start-up per collective over the axis
DEFAULT_PEAK_FLOPS = 1.97e14  # FLOP/s per device
V5E_HBM_BANDWIDTH = 8.19e11  # bytes/s of HBM per device on a TPU v5e
DEFAULT_HBM_BANDWIDTH = math.inf  # bytes/s per device: unbounded, compute is FLOPs at peak (see the module docstring)

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class MeshAxis:
    """One named mesh axis and the links along it."""

    name: str
    size: int
    bandwidth: float = DEFAULT_BANDWIDTH
    latency: float = DEFAULT_LATENCY


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """A logical device mesh: ordered named axes plus per-device speeds."""

    axes: tuple[MeshAxis, ...]
    peak_flops: float = DEFAULT_PEAK_FLOPS
    hbm_bandwidth: float = DEFAULT_HBM_BANDWIDTH
    _index: Mapping[str, MeshAxis] = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    _names: tuple[str, ...] = field(default=(), compare=False, repr=False)
    _sizes: Mapping[str, int] = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    # Computed once: the mesh keys the reshard caches, looked up hundreds of thousands of times a plan.
    _hash: int = field(init=False, default=0, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.axes:
            raise ShardsolveError("mesh has no axes; give at least one, e.g. 'data=8'")
        seen: set[str] = set()
        for axis in self.axes:
            if not _AXIS_NAME.match(axis.name):
                raise ShardsolveError(
                    f"mesh axis name {axis.name!r} is not an identifier; use letters, digits and '_'"
                )
            if axis.name in seen:
                raise ShardsolveError(f"mesh axis {axis.name!r} appears twice; give each axis once")
            if not isinstance(axis.size, int) or axis.size < 1:
                raise ShardsolveError(f"mesh axis {axis.name!r} has size {axis.size!r}; sizes are integers >= 1")
            if axis.bandwidth <= 0 or axis.latency < 0:
                raise ShardsolveError(f"mesh axis {axis.name!r} needs bandwidth > 0 and latency >= 0")
            seen.add(axis.name)
        object.__setattr__(self, "_index", {a.name: a for a in self.axes})
        object.__setattr__(self, "_names", tuple(a.name for a in self.axes))
        object.__setattr__(self, "_sizes", {a.name: a.size for a in self.axes})
        object.__setattr__(self, "_hash", hash((self.axes, self.peak_flops, self.hbm_bandwidth)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # the hash of strings differs between processes: a copy computes its own
        return MeshSpec, (self.axes, self.peak_flops, self.hbm_bandwidth)

    # -- construction -----------------------------------------------------

    @classmethod
    def parse(
        cls,
        text: str,
        *,
        bandwidth: Mapping[str, float] | float | None = None,
        latency: Mapping[str, float] | float | None = None,
        peak_flops: float = DEFAULT_PEAK_FLOPS,
        hbm_bandwidth: float = DEFAULT_HBM_BANDWIDTH,
    ) -> MeshSpec:
        """Parse ``"data=2,model=4"`` (also ``"data:2 model:4"``)."""
        if not isinstance(text, str) or not text.strip():
            raise ShardsolveError("mesh is empty; write it as 'data=2,model=4'")
        axes = []
        for part in re.split(r"[,\s]+", text.strip()):
            if not part:
                continue
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\s*[=:]\s*(\d+)", part)
            if not m:
                raise ShardsolveError(f"cannot parse mesh axis {part!r} in {text!r}; write axes as name=size, e.g. 'data=2,model=4'")
            axes.append(MeshAxis(m.group(1), int(m.group(2))))
        return cls(tuple(axes), peak_flops=peak_flops, hbm_bandwidth=hbm_bandwidth).with_links(
            bandwidth=bandwidth, latency=latency
        )

    def with_links(
        self,
        *,
        bandwidth: Mapping[str, float] | float | None = None,
        latency: Mapping[str, float] | float | None = None,
    ) -> MeshSpec:
        """Return a copy with some axes' bandwidth or latency overridden."""

        def pick(values, axis: MeshAxis, default: float) -> float:
            if values is None:
                return default
            if isinstance(values, Mapping):
                return float(values.get(axis.name, default))
            return float(values)

        for values in (bandwidth, latency):
            if isinstance(values, Mapping):
                for name in values:
                    if name not in self.names:
                        raise ShardsolveError(f"link setting names unknown mesh axis {name!r}; mesh axes are {self.names}")
        axes = tuple(
            replace(a, bandwidth=pick(bandwidth, a, a.bandwidth), latency=pick(latency, a, a.latency)) for a in self.axes
        )
        return MeshSpec(axes, peak_flops=self.peak_flops, hbm_bandwidth=self.hbm_bandwidth)

    @classmethod
    def from_jax(cls, mesh: Any) -> MeshSpec:
        """Axis names and sizes of a ``jax.sharding.Mesh`` or ``AbstractMesh``."""
        shape = dict(mesh.shape)
        return cls(tuple(MeshAxis(str(name), int(size)) for name, size in shape.items()))

    # -- queries ----------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def shape(self) -> dict[str, int]:
        return {a.name: a.size for a in self.axes}

    @property
    def size(self) -> int:
        return math.prod(a.size for a in self.axes)

    def axis(self, name: str) -> MeshAxis:
        try:
            return self._index[name]
        except KeyError:
            raise ShardsolveError(f"unknown mesh axis {name!r}; mesh axes are {self.names}") from None

    def axis_size(self, name: str) -> int:
        try:
            return self._sizes[name]
        except KeyError:
            raise ShardsolveError(f"unknown mesh axis {name!r}; mesh axes are {self.names}") from None

    def group_size(self, names) -> int:
        """Number of devices in one group spanned by the given axes."""
        sizes, size = self._sizes, 1
        for n in names:
            if n not in sizes:
                self.axis_size(n)  # names the unknown axis
            size *= sizes[n]
        return size

    def order(self, names) -> tuple[str, ...]:
        """The given axis names in mesh order."""
        wanted = set(names)
        return tuple(n for n in self.names if n in wanted)

    def __str__(self) -> str:
        return ",".join(f"{a.name}={a.size}" for a in self.axes)

    # -- JAX objects ------------------------------------------------------

    def abstract_mesh(self):
        from jax.sharding import AbstractMesh

        return AbstractMesh(tuple(a.size for a in self.axes), self.names)

    def jax_mesh(self, devices=None):
        """A concrete ``jax.sharding.Mesh`` over the first ``size`` devices.

        Falls back to an ``AbstractMesh`` when fewer devices are present, so
        shardings can still be exported for planning on a laptop.
        """
        import jax
        import numpy as np

        devices = list(jax.devices()) if devices is None else list(devices)
        if len(devices) < self.size:
            return self.abstract_mesh()
        arr = np.array(devices[: self.size], dtype=object).reshape(tuple(a.size for a in self.axes))
        return jax.sharding.Mesh(arr, self.names)

    def devices_mesh(self, what: str, devices=None):
        """``jax_mesh(devices)``, refused in one line when fewer than ``size`` devices are present.

        ``what`` names the caller in the message, e.g. ``"lowering"`` or ``"plan.jit()"``.
        """
        import jax

        mesh = self.jax_mesh(devices)
        if not isinstance(mesh, jax.sharding.Mesh):
            present = len(jax.devices()) if devices is None else len(list(devices))
            raise ShardsolveError(
                f"{what} needs {self.size} devices for mesh {self}, but only {present} are present; run on more "
                f"devices (or set XLA_FLAGS=--xla_force_host_platform_device_count={self.size} on CPU)"
            )
        return mesh


def as_mesh_spec(mesh: Any) -> MeshSpec:
    """Accept a ``MeshSpec``, a ``jax`` ``Mesh``/``AbstractMesh`` or ``"data=2,model=4"``."""
    if isinstance(mesh, MeshSpec):
        return mesh
    if isinstance(mesh, str):
        return MeshSpec.parse(mesh)
    if hasattr(mesh, "shape") and hasattr(mesh, "axis_names"):
        return MeshSpec.from_jax(mesh)
    raise ShardsolveError(
        f"mesh must be a jax Mesh, an AbstractMesh or a string like 'data=2,model=4', not {type(mesh).__name__}"
    )
