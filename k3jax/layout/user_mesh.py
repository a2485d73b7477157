"""The user's mesh and the layer's mesh.

k3jax's programs name three mesh axis roles, NODE, DATA and TENSOR
(k3jax.layout.parallel), with Auto axis types: the modules place weights and
tokens with NamedShardings and ``jax.shard_map`` in_specs themselves. A user
may build the mesh any way: ``jax.make_mesh`` (Explicit axes, JAX's
default), ``jax.sharding.Mesh``, an AbstractMesh, k3jax's ``make_mesh``;
under k3jax's axis names or, through ``ParallelConfig(axis_names={"data":
"batch", "tensor": "model"})``, under the user's (role -> axis name; a role
left out keeps its own name).

``check_mesh(mesh, parallel, who)`` reads the user's mesh once (make_layout
and the modules' constructors call it) and returns the layer's mesh: the same
devices in the same order, each axis under its role's name (data, tensor,
node), all axes Auto; the axes stay in the user's order (k3jax reads axes by
name only; ``role_devices`` lists the devices in role order). It is the
user's mesh itself when that already is this. The
modules hold and run on the layer's mesh (``module.mesh``); an input placed
on the user's mesh is moved onto it and the output placed back like the
input (k3jax.parallel.sequence.row_sharded_forward).

Refused, with a ValueError naming the axis:
  - a role mapped (``axis_names``) to an axis the mesh does not have;
  - a role of size > 1 under its own name (no mapping) the mesh does not have;
  - a role's axis whose size is not the ParallelConfig's (node: nodes,
    data: dp / nodes, tensor: tp);
  - an axis of size > 1 that no role names;
  - an axis of Manual type (inside a shard_map).
A layer's mesh (k3jax's names, the right sizes, Auto axes: what
``make_mesh`` builds without ``axis_names``) is always taken as it is.
Axes of size 1 that no role names are dropped; a role of size 1 that the
mesh does not have (under its own name) is added. Under NODE the user's mesh
must put each node's devices at one index of the node role's axis (what
``make_mesh`` does); k3jax cannot tell hosts apart on one process and
trusts it.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh
from jax.sharding import PartitionSpec as P

from k3jax.layout.parallel import DATA, NODE, TENSOR, ParallelConfig

_SIZE_FIELD = {NODE: "nodes", DATA: "dp / nodes", TENSOR: "tp"}


def role_sizes(parallel: ParallelConfig) -> dict[str, int]:
    """{role: size} of the three roles (NODE 1 on one node)."""
    return {NODE: parallel.nodes, DATA: parallel.dp // parallel.nodes, TENSOR: parallel.tp}


def check_mesh(mesh: Mesh | AbstractMesh, parallel: ParallelConfig,
               who: str) -> Mesh | AbstractMesh:
    """The layer's mesh for the user's ``mesh`` (module docstring): the same
    devices in the same order, the axes of ``parallel.mesh_axes`` (k3jax's
    names) of their ``parallel.axis_sizes``, Auto. ValueError starting with
    ``who`` and naming the axis for a mesh it cannot use."""
    if _is_layer_mesh(mesh, parallel):
        return mesh
    names = tuple(mesh.axis_names)
    sizes = dict(zip(names, mesh.axis_sizes))
    shown = "{" + ", ".join(f"{n!r}: {s}" for n, s in sizes.items()) + "}"
    mapped = dict(parallel.axis_names)

    def refuse(why: str):
        raise ValueError(f"{who}: mesh {shown} does not match the layout "
                         f"({parallel.describe()}): {why}")

    for name, kind in zip(names, mesh.axis_types):
        if kind == AxisType.Manual:
            refuse(f"axis {name!r} is Manual (inside a shard_map); k3jax needs Auto or "
                   f"Explicit axes")
    expected = role_sizes(parallel)
    axis_of: dict[str, str] = {}
    for role in (NODE, DATA, TENSOR):
        name = parallel.axis_name(role)
        if name not in sizes:
            if role in mapped:
                refuse(f"role {role} is mapped to axis {name!r}, which the mesh does not have")
            if expected[role] > 1:
                refuse(f"no axis {name!r} for role {role} (ParallelConfig {_SIZE_FIELD[role]} = "
                       f"{expected[role]}); name it so, or map the role to one of the mesh's "
                       f"axes with ParallelConfig(axis_names={{{role!r}: ...}})")
            continue
        if sizes[name] != expected[role]:
            refuse(f"axis {name!r} (role {role}) has size {sizes[name]}, but ParallelConfig "
                   f"{_SIZE_FIELD[role]} = {expected[role]}")
        axis_of[role] = name
    roleless = [n for n in names if n not in axis_of.values() and sizes[n] > 1]
    if roleless:
        refuse(f"axis {roleless[0]!r} of size {sizes[roleless[0]]} has no role; the roles are "
               f"{NODE}, {DATA}, {TENSOR} (map one to it with ParallelConfig(axis_names=...)), "
               f"and an axis without one must have size 1")
    return _layer_mesh(mesh, parallel, axis_of)


def _is_layer_mesh(mesh: Mesh | AbstractMesh, parallel: ParallelConfig) -> bool:
    """Is ``mesh`` a layer's mesh already: the axes of ``parallel.mesh_axes``
    (k3jax's names, any order) of their sizes, every axis Auto?
    (Unambiguous whatever ``axis_names`` says: no role is named after another role.)"""
    return (sorted(mesh.axis_names) == sorted(parallel.mesh_axes)
            and all(mesh.shape[a] == parallel.axis_sizes[a] for a in parallel.mesh_axes)
            and all(t == AxisType.Auto for t in mesh.axis_types))


def _layer_mesh(mesh: Mesh | AbstractMesh, parallel: ParallelConfig,
                axis_of: dict[str, str]) -> Mesh | AbstractMesh:
    """``mesh`` under k3jax's names (roles found at ``axis_of``), all axes
    Auto, the axes in the user's order, so that the devices keep their order
    (jax.jit takes arrays of one computation in one device order); roles of
    size 1 the mesh lacks come first, size-1 axes without a role go."""
    role_at = {name: role for role, name in axis_of.items() if role in parallel.mesh_axes}
    kept = [i for i, name in enumerate(mesh.axis_names) if name in role_at]
    missing = [role for role in parallel.mesh_axes if role not in axis_of]
    names = (*missing, *(role_at[mesh.axis_names[i]] for i in kept))
    sizes = (*(1 for _ in missing), *(mesh.axis_sizes[i] for i in kept))
    auto = (AxisType.Auto,) * len(names)
    if not isinstance(mesh, Mesh):
        return AbstractMesh(sizes, names, axis_types=auto)
    return Mesh(np.asarray(mesh.devices).reshape(sizes), names, axis_types=auto)


def role_devices(mesh: Mesh) -> list:
    """The devices of a layer's mesh (``module.mesh``) in role order: (node,)
    data, tensor row-major, the order of ``ExpertLoad.tokens_per_device``
    and of the experts under EP (device i holds experts [i E_l, (i + 1) E_l))."""
    roles = [r for r in (NODE, DATA, TENSOR) if r in mesh.axis_names]
    order = [list(mesh.axis_names).index(r) for r in roles]
    return list(np.transpose(mesh.devices, order).flat)


def layer_spec(spec: P, parallel: ParallelConfig) -> P:
    """A PartitionSpec over the user's mesh axes -> the same placement over
    the layer's mesh (each user axis name -> its role; a name no role has,
    size 1 by ``check_mesh``, dropped)."""
    role_of = {parallel.axis_name(role): role for role in parallel.mesh_axes}

    def entry(e):
        if e is None:
            return None
        names = tuple(role_of[n] for n in (e if isinstance(e, tuple) else (e,)) if n in role_of)
        return names[0] if len(names) == 1 else (names or None)

    return P(*(entry(e) for e in spec))


__all__ = ["check_mesh", "layer_spec", "role_devices", "role_sizes"]
